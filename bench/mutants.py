"""Mutation score: named mutations of the product code, each a bug someone could plausibly write (an off-by-one in a
window, a skipped check, a wrong dtype, a stream shared across ranks, a reversed order), each with the tests that
must catch it. A mutation that survives its tests is a hole in the suite, to be closed with a test, not a line to
delete from this list.

    python bench/mutants.py --list                 # the mutations, one a line: name, file, tests
    python bench/mutants.py [NAME ...] [--keep]    # each applied alone in a temporary copy of the tree, its tests run

A mutation is a file, one line of it (compared without its indentation; it must occur there exactly once), the line
that replaces it, and pytest node ids. The copy holds the repository's files (git ls-files: tracked and untracked
but not ignored); the tests run there with PYTHONPATH pointing at it (so the copy's code wins over an installed
megamemo, also in the processes the tests start), one mutation at a time, stopping at the first failure. Killed:
the tests fail (or time out). Survived: they pass. Error: pytest could not run them (a bad node id: exit code 4 or
5) - a defect of this list. Prints one line a mutation, then killed / total, the survivors and the time taken.
Exit code 0 when every mutation is killed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository
    original: str  # one line of `file` (indentation aside)
    mutated: str  # what replaces it (indented as the original)
    tests: tuple[str, ...]  # pytest node ids that must fail


M = Mutation
SUBWORD = "tests/data/test_data_subword.py"
REMOTE = "tests/data/test_data_remote.py"
LAUNCHER = "tests/runtime/test_launcher_report.py"
STEPTIME = "tests/plan/test_steptime.py"
FUSED = "tests/kernels/test_fused_attention.py"
INTERRUPTIONS = "tests/runtime/test_interruptions.py"
SBATCH = "tests/launch/test_launch_sbatch_args.py"
SYNCS = "tests/gpu/test_sync_sites.py"
CLUSTER_ENV = "tests/launch/test_launch_cluster_env.py"
CLUSTER = "tests/train/test_cluster_step.py"
GPU_CHECK = "tests/gpu/test_gpu_check.py"
NUMERICS = "tests/train/test_numerics.py"
MUTATIONS = [
    # ---- megamemo/util ---------------------------------------------------------------------------------------
    M(
        "util-bits-per-byte-in-nats",
        "megamemo/util/units.py",
        'return total_nll_nats / LN2 / n_bytes if n_bytes > 0 else float("nan")',
        'return total_nll_nats / n_bytes if n_bytes > 0 else float("nan")',
        ("tests/util/test_util.py::test_units_by_hand",),
    ),
    M(
        "util-numpy-stream-not-seeded",
        "megamemo/util/seeding.py",
        "np.random.seed(seed % 2**32)",
        "pass",
        ("tests/util/test_util.py::test_seeding_makes_every_default_stream_repeat",),
    ),
    M(
        "util-atomic-directory-left-behind-on-error",
        "megamemo/util/files.py",
        "shutil.rmtree(tmp, ignore_errors=True)",
        "pass",
        (
            "tests/util/test_util.py::test_a_directory_appears_whole_or_not_at_all_and_its_clean_up_on_error",
            "tests/interop/test_convert_parallel.py::test_broken_checkpoint_is_refused_by_name",
        ),
    ),
    M(
        "util-manifest-entry-size-unchecked",
        "megamemo/util/files.py",
        "if expected is not None and size != expected:",
        "if False:",
        (
            "tests/util/test_util.py::test_the_hashing_writer_and_the_manifest_entry_check",
            "tests/checkpoint/test_checkpoint_layer.py::test_half_written_flipped_or_truncated_checkpoints_are_never_resumed",
            "tests/data/test_data_prepare.py::test_jsonl_records_are_documents_in_a_document_index",
        ),
    ),
    M(
        "util-saved-tensors-keep-safetensors-0600",
        "megamemo/util/files.py",
        "os.chmod(path, mode)",
        "pass",
        ("tests/export/test_export_hf.py::test_the_weights_are_as_readable_as_the_other_files",),
    ),
    # ---- megamemo.data ------------------------------------------------------------------------------------------
    M(
        "subword-document-index-restarts-each-block",
        "megamemo/data/subword.py",
        "doc += lengths.size",
        "doc = lengths.size",
        (f"{SUBWORD}::test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers",),
    ),
    M(
        "subword-bpe-pass-index-restarts-each-block",
        "megamemo/data/subword.py",
        "doc += len(texts)",
        "doc = len(texts)",
        (f"{SUBWORD}::test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers",),
    ),
    M(
        "subword-workers-blocks-reversed",
        "megamemo/data/subword.py",
        "pending.append((nb, pool.apply_async(_encode_in_worker, (block,))))",
        "pending.appendleft((nb, pool.apply_async(_encode_in_worker, (block,))))",
        (f"{SUBWORD}::test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers",),
    ),
    M(
        "documents-split-slot-off-by-one",
        "megamemo/data/documents.py",
        's = self._cache[g] = np.searchsorted(self.bounds, perm, side="right")',
        's = self._cache[g] = np.searchsorted(self.bounds, perm, side="left")',
        (f"{SUBWORD}::test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers",),
    ),
    M(
        "remote-vocabulary-sha256-unchecked",
        "megamemo/data/remote.py",
        "if sha and bytes_sha256(vdata) != sha:",
        "if False:",
        (f"{REMOTE}::test_a_damaged_vocabulary_or_tokenizer_file_is_named",),
    ),
    M(
        "remote-cached-shard-trusted-by-size",
        "megamemo/data/remote.py",
        'if str(dst) in _VERIFIED or file_sha256(dst) == entry["sha256"]:',
        "if True:",
        (f"{REMOTE}::test_a_cached_shard_damaged_in_place_is_fetched_again",),
    ),
    M(
        "remote-cache-use-not-recorded",
        "megamemo/data/remote.py",
        "os.utime(dst)  # least recently used = oldest mtime",
        "pass",
        (f"{REMOTE}::test_cache_limit_evicts_least_recently_used",),
    ),
    M(
        "stream-roll-ignores-the-epoch",
        "megamemo/data/stream.py",
        "rng = np.random.default_rng([self.seed, epoch])",
        "rng = np.random.default_rng([self.seed, 0])",
        ("tests/data/test_data_stream.py::test_roll_is_a_seeded_per_epoch_column_rotation",),
    ),
    M(
        "stats-unigram-unsmoothed",
        "megamemo/data/stats.py",
        "fit = _counts(fit_ids, n_symbols) + smoothing",
        "fit = _counts(fit_ids, n_symbols) + 1e-9",
        ("tests/data/test_data_stats.py",),
    ),
    M(
        "doc-index-starts-one-document-late",
        "megamemo/data/doc_index.py",
        "starts = first_token + np.concatenate(([0], np.cumsum(lengths[:-1])))",
        "starts = first_token + np.cumsum(lengths)",
        (f"{SUBWORD}::test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers",),
    ),
    M(
        "text-plain-corpus-utf8-unchecked",
        "megamemo/data/text_files.py",
        "_check_utf8(p)  # the other files are decoded line by line",
        "pass",
        ("tests/data/test_data_prepare.py::test_a_bad_text_corpus_exits_2_naming_its_line_and_column",),
    ),
    # ---- megamemo/model --------------------------------------------------------------------------------------
    M(
        "model-causal-mask-hides-the-query-itself",
        "megamemo/model/positions.py",
        "mask = j > i",
        "mask = j >= i",
        ("tests/model/test_model_reference.py::test_eval_nll_and_memory_over_segments[txl_tgt8_mem8-plain]",),
    ),
    M(
        "model-same-length-window-one-key-wider",
        "megamemo/model/positions.py",
        "mask = mask | (j <= i - mem_len)",
        "mask = mask | (j < i - mem_len)",
        ("tests/model/test_model_spec.py::test_matches_naive_spec[xl-6-12-None-True-5]",),
    ),
    M(
        "model-lookahead-sees-its-own-position",
        "megamemo/model/positions.py",
        "return p <= i",
        "return p < i",
        ("tests/model/test_model_reference.py::test_eval_nll_and_memory_over_segments[lamemo_at3_tgt8_mem8-plain]",),
    ),
    M(
        "model-clamp-one-too-far",
        "megamemo/model/positions.py",
        "pos = pos.clamp(max=clamp_len)",
        "pos = pos.clamp(max=clamp_len + 1)",
        ("tests/model/test_model_spec.py::test_matches_naive_spec[rpe-6-6-None-True-4]",),
    ),
    M(
        "positions-angles-in-half-precision",
        "megamemo/model/positions.py",
        "angles = pos.float()[:, None] * freq[None, :]",
        "angles = (pos[:, None] * freq[None, :]).to(dtype).float()",
        ("tests/model/test_half_positions.py::test_load_single_and_eval_half",),
    ),
    M(
        "flops-causal-scores-counted-twice-not-thrice",
        "megamemo/model/flops.py",
        "+ 3 * 2 * L * klen * H * B  # causal: content, position, values",
        "+ 2 * 2 * L * klen * H * B  # causal: content, position, values",
        ("tests/model/test_flops.py::test_analytic_count_matches_torch_flop_counter",),
    ),
    M(
        "mfu-memory-keys-left-out",
        "megamemo/model/flops.py",
        "return 6 * total_params(cfg) + 18 * cfg.n_layer * cfg.n_head * cfg.d_head * (M + L)",
        "return 6 * total_params(cfg) + 18 * cfg.n_layer * cfg.n_head * cfg.d_head * L",
        ("tests/train/test_mfu.py::test_model_flops_by_hand",),
    ),
    M(
        "attention-position-rows-aligned-one-short",
        "megamemo/model/attention.py",
        "return _rows(r, -(-n // align) * align)",
        "return _rows(r, -(-n // align) * align - 1)",
        ("tests/model/test_attention_alignment.py::test_aligned_position_rows_change_nothing",),
    ),
    M(
        "model-lengths-override-of-the-clamp-ignored",
        "megamemo/model/lengths.py",
        "cfg.clamp_len if self.clamp is None else self.clamp,",
        "cfg.clamp_len,",
        ("tests/train/test_seams.py::test_lengths_take_the_models_value_where_none_is_given",),
    ),
    # ---- megamemo/kernels ------------------------------------------------------------------------------------
    M(
        "kernels-dropout-last-digit-strict",
        "megamemo/kernels/dropout.py",
        "return torch.ge(b, digits[0], out=out)",
        "return torch.gt(b, digits[0], out=out)",
        ("tests/model/test_model_properties.py::test_dropout_mask_is_a_32_bit_comparison_drawn_digit_by_digit",),
    ),
    M(
        "kernels-dropout-unscaled",
        "megamemo/kernels/dropout.py",
        "return (_ReluKeepScale if relu else _KeepScale).apply(x, keep, 1.0 / (1.0 - p))",
        "return (_ReluKeepScale if relu else _KeepScale).apply(x, keep, 1.0)",
        ("tests/model/test_model_properties.py::test_dropout_mask_has_the_right_law_and_replays",),
    ),
    M(
        "flex-position-index-off-by-one",
        "megamemo/kernels/flex.py",
        "pos = bd[b, h, i, (s0 - i + j).clamp(0, W - 1)]",
        "pos = bd[b, h, i, (s0 - i + j + 1).clamp(0, W - 1)]",
        ("tests/kernels/test_kernels.py::test_flex_attention_forward_equals_the_eager_form_on_the_cpu",),
    ),
    M(
        "compiler-overrides-the-users-dynamo-off",
        "megamemo/kernels/compiler.py",
        'if os.environ.get(SET_BY_MEGAMEMO) == "1":',
        "if True:",
        ("tests/kernels/test_kernels.py::test_the_compiler_switch_lifts_megamemos_own_dynamo_off_only",),
    ),
    # the fused Triton attention (kernels/relattn_triton.py, kernels/fused.py), run in Triton's interpreter
    M(
        "fused-skew-off-by-one",
        "megamemo/kernels/relattn_triton.py",
        "skew = (BM - 1) - tl.arange(0, BM)[:, None] + tl.arange(0, BN)[None, :]  # in [0, BM+BN-2]",
        "skew = BM - tl.arange(0, BM)[:, None] + tl.arange(0, BN)[None, :]",
        (FUSED + "::test_causal_fp32_equals_the_naive_spec",),
    ),
    M(
        "fused-lse-gradient-ignored",
        "megamemo/kernels/fused.py",
        "delta = delta - g_lse.float()",
        "pass",
        (FUSED + "::test_lookahead_fp32_equals_the_naive_spec",),
    ),
    M(
        "fused-odd-r-bands-at-the-even-offset",
        "megamemo/kernels/fused.py",
        "buf[:, bn : bn + odd.size(1)] += odd",
        "buf[:, : odd.size(1)] += odd",
        (FUSED + "::test_causal_fp32_equals_the_naive_spec",),
    ),
    M(
        "fused-tile-table-hides-the-diagonal",
        "megamemo/kernels/fused.py",
        "return padded.view(n_qt, block, n_kt, block).any(3).any(1).to(torch.int32).contiguous()",
        "return padded.view(n_qt, block, n_kt, block).all(3).all(1).to(torch.int32).contiguous()",
        (FUSED + "::test_hidden_tiles_are_skipped", FUSED + "::test_causal_fp32_equals_the_naive_spec"),
    ),
    M(
        "fused-online-softmax-not-rescaled",
        "megamemo/kernels/relattn_triton.py",
        "acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC, UPCAST)",
        "acc = acc + _mm(p.to(v.dtype), v, PREC, UPCAST)",
        (FUSED + "::test_causal_fp32_equals_the_naive_spec",),
    ),
    M(
        "fused-du-takes-the-position-part",
        "megamemo/kernels/fused.py",
        "du, dvb = dqc.sum((1, 2)).to(u.dtype), dqp.sum((1, 2)).to(vb.dtype)",
        "du, dvb = dqp.sum((1, 2)).to(u.dtype), dqc.sum((1, 2)).to(vb.dtype)",
        (FUSED + "::test_without_a_gradient_of_the_lse",),
    ),
    M(
        "fused-position-bias-is-the-content-bias",
        "megamemo/kernels/relattn_triton.py",
        "return (qf + u[None, :]).to(q.dtype), (qf + vb[None, :]).to(q.dtype)",
        "return (qf + u[None, :]).to(q.dtype), (qf + u[None, :]).to(q.dtype)",
        (
            "tests/kernels/test_fused_training.py::test_eval_takes_attention_fused",
            "tests/kernels/test_fused_training.py::test_training_with_fused_attention_equals_eager",
        ),
    ),
    M(
        "keyed-lookahead-heads-not-split-across-tp-ranks",
        "megamemo/kernels/keyed.py",
        'SPLIT = ("ff_inner", "att", "att_ahead")  # sites whose features (heads) are split across TP ranks',
        'SPLIT = ("ff_inner", "att")',
        (
            "tests/kernels/test_keyed_dropout.py::test_under_tensor_parallelism_a_rank_drops_its_slice_of_a_split_site_and_all_"
            "of_the_others",
        ),
    ),
    M(
        "keyed-every-site-offset-by-the-tp-rank",
        "megamemo/kernels/sites.py",
        "new = KeyedDropout(old.p, key, site, layer, relu=_relu(old), split=tp_rank if site in SPLIT else 0)",
        "new = KeyedDropout(old.p, key, site, layer, relu=_relu(old), split=tp_rank)",
        (
            "tests/kernels/test_keyed_dropout.py::test_under_tensor_parallelism_a_rank_drops_its_slice_of_a_split_site_and_all_"
            "of_the_others",
        ),
    ),
    M(
        "compiler-compiled-copy-of-each-layer-dropped",
        "megamemo/kernels/compiler.py",
        "layer.compile(backend=backend, dynamic=None)",
        "torch.compile(layer, backend=backend, dynamic=None)",
        ("tests/kernels/test_compile.py::test_every_decoder_layer_is_compiled_and_runs_compiled",),
    ),
    M(
        "compiler-regions-share-one-function",
        "megamemo/kernels/compiler.py",
        "key = (fn, backend)",
        "key = backend",
        ("tests/kernels/test_compile.py::test_under_tensor_parallelism_the_attention_regions_are_compiled_and_said",),
    ),
    M(
        "compiler-regions-left-eager",
        "megamemo/kernels/compiler.py",
        "m.causal, m.lookahead = _compiled(m.causal, backend), _compiled(m.lookahead, backend)",
        "pass",
        ("tests/kernels/test_compile.py::test_under_tensor_parallelism_the_attention_regions_are_compiled_and_said",),
    ),
    # ---- megamemo/parallel -----------------------------------------------------------------------------------
    M(
        "parallel-tp-stream-shared-by-the-tp-ranks",
        "megamemo/parallel/groups.py",
        "tp = seed + 1 + 2 * _pair(_pair(group, tp_rank), step_salt) + 1",
        "tp = seed + 1 + 2 * _pair(group, step_salt) + 1",
        ("tests/runtime/test_gpu_path.py::test_dropout_seeds_are_unique_over_the_tp_dp_pp_grid",),
    ),
    M(
        "parallel-qkv-box-not-per-head",
        "megamemo/parallel/tensor.py",
        "per = shape[0] // 3",
        "per = shape[0]",
        ("tests/checkpoint/test_checkpoint_layer.py::test_qkv_shards_move_between_tensor_parallel_sizes",),
    ),
    M(
        "parallel-mcore-timeout-given-in-seconds-for-minutes",
        "megamemo/parallel/groups.py",
        'minutes = {} if timeout_s is None else {"distributed_timeout_minutes": max(1, math.ceil(timeout_s / 60))}',
        'minutes = {} if timeout_s is None else {"distributed_timeout_minutes": max(1, math.ceil(timeout_s))}',
        ("tests/train/test_train_units.py::test_the_collective_timeout_reaches_every_group_in_its_unit",),
    ),
    M(
        "zero-bf16-at-grad-accum-1-still-accumulates-in-fp32",
        "megamemo/parallel/zero.py",
        'return not (p.grad_accum_dtype == "auto" and p.dtype == "bf16" and zero == 1 and one_micro_batch)',
        "return True",
        (
            f"{CLUSTER}::test_the_shipped_large_configs_overlap_in_buckets_of_5e7",
            f"{CLUSTER}::test_deepspeed_reduces_in_the_dtype_the_planner_prices",
        ),
    ),
    M(
        "zero-bf16-optimizer-reduction-priced-in-fp32",
        "megamemo/parallel/zero.py",
        "return precision.dtype",
        'return "fp32" if precision.dtype == "bf16" else precision.dtype',
        (f"{CLUSTER}::test_deepspeed_reduces_in_the_dtype_the_planner_prices",),
    ),
    M(
        "engine-bf16-at-grad-accum-1-gets-bf16-optimizer",
        "megamemo/train/engine.py",
        'return "fp32" if fp32_accumulation(cfg.parallel, cfg.precision, cfg.train.grad_accum) else None',
        'return "fp32" if cfg.precision.dtype != "fp32" and cfg.parallel.zero_stage else None',
        (
            f"{CLUSTER}::test_the_shipped_large_configs_overlap_in_buckets_of_5e7",
            f"{CLUSTER}::test_two_gloo_ranks_reducing_bf16_overlapped_equal_one_process",
        ),
    ),
    M(
        "plan-zero-1-bucket-in-fp32-without-fp32-accumulation",
        "megamemo/plan/layouts.py",
        "zero_b = 4 * params / dp + bucket * (4 if zero == 1 and fp32_accumulation(*reduction) else p_bytes)",
        "zero_b = 4 * params / dp + bucket * (4 if zero == 1 else p_bytes)",
        ("tests/plan/test_plan.py::test_lamemo_7b_on_its_a100_cluster",),
    ),
    M(
        "steptime-reduction-priced-in-the-accumulation-dtype",
        "megamemo/plan/steptime.py",
        "wire = params * element_bytes(reduce_dtype(cfg.precision))  # what DeepSpeed all-reduces in (zero.py)",
        "wire = params * (4 if fp32_accumulation(*reduction) else pbytes)",
        (f"{STEPTIME}::test_overlap_comm_would_hide_all_buckets_but_the_last",),
    ),
    # ---- megamemo/config -------------------------------------------------------------------------------------
    M(
        "config-override-value-taken-as-text",
        "megamemo/config/run.py",
        'value = yaml.safe_load(raw) if raw.strip() else ""',
        "value = raw",
        ("tests/train/test_train_units.py::test_overrides_and_round_trip",),
    ),
    M(
        "config-int-field-takes-a-bool",
        "megamemo/config/fields.py",
        "Int = Annotated[int, Strict()]  # an int, never a bool or a float or a numeric string",
        "Int = int",
        ("tests/train/test_train_units.py::test_declared_fields_refuse_in_one_line",),
    ),
    M(
        "train-vocab-pads-a-full-multiple",
        "megamemo/model/config.py",
        "n = -(-vocab // step) * step",
        "n = (vocab // step + 1) * step",
        ("tests/train/test_vocab_padding.py::test_padded_vocab_by_hand",),
    ),
    M(
        "parallel-vocab-log-probs-gathered-out-of-rank-order",
        "megamemo/parallel/tensor.py",
        "return F.log_softmax(torch.cat(parts, dim=-1).float(), dim=-1)",
        "return F.log_softmax(torch.cat(parts[::-1], dim=-1).float(), dim=-1)",
        ("tests/parallel/test_parallel_tp.py::test_tensor_parallel_equals_single_device",),
    ),
    M(
        "parallel-overlap-where-deepspeed-ignores-it",
        "megamemo/parallel/zero.py",
        "return parallel.overlap_comm and overlap_problem(parallel, precision, grad_accum) is None",
        "return parallel.overlap_comm",
        (f"{STEPTIME}::test_overlap_comm_hides_it_where_deepspeed_overlaps_and_bucket_size_sets_the_buckets",),
    ),
    M(
        "field-comments-a-block-above-taken-as-the-previous-fields",
        "megamemo/util/field_comments.py",
        "return []  # the next field's block",
        "pass",
        ("tests/commands/test_cli_errors.py::test_a_comment_block_above_a_field_is_its_own_not_the_previous_fields",),
    ),
    # ---- megamemo/checkpoint ---------------------------------------------------------------------------------
    M(
        "checkpoint-sha256-not-checked",
        "megamemo/checkpoint/store.py",
        "(lambda: file_sha256(p)) if checksum else None,",
        "None,",
        (
            "tests/checkpoint/test_checkpoint_layer.py::test_half_written_flipped_or_truncated_checkpoints_are_never_resumed",
        ),
    ),
    M(
        "checkpoint-retention-keeps-the-marker-to-the-end",
        "megamemo/checkpoint/store.py",
        "marker.unlink()",
        "pass",
        ("tests/checkpoint/test_checkpoint_layer.py::test_retention_removes_the_marker_first",),
    ),
    M(
        "checkpoint-old-marker-layout-not-read",
        "megamemo/checkpoint/layout.py",
        "return cls(**{f.name: record.get(f.name) for f in fields(cls)})",
        "return cls()",
        ("tests/checkpoint/test_checkpoint_compat.py::test_old_checkpoint_resumes_to_the_old_codes_losses",),
    ),
    M(
        "checkpoint-global-state-from-the-ranks-own-file",
        "megamemo/checkpoint/state.py",
        "own_rank = rank if ctx.same_layout else 0",
        "own_rank = rank",
        ("tests/checkpoint/test_checkpoint_layer.py::test_registry_round_trip_is_exact_and_pickle_free",),
    ),
    M(
        "checkpoint-rank-streams-restored-under-another-layout",
        "megamemo/checkpoint/state.py",
        "if ctx.same_layout:",
        "if True:",
        ("tests/checkpoint/test_checkpoint_layer.py::test_registry_round_trip_is_exact_and_pickle_free",),
    ),
    M(
        "faults-kill-any-rank",
        "megamemo/checkpoint/faults.py",
        "if name == point and n == nth and rank in (None, self.rank):",
        "if name == point and n == nth:",
        ("tests/checkpoint/test_checkpoint_layer.py::test_a_fault_point_fires_at_its_count_on_its_rank_only",),
    ),
    M(
        "probe-bound-tp-roundings-uncounted",
        "megamemo/checkpoint/probe_bound.py",
        "return 4 * (max(int(tp), 1) - 1) * model.cfg.n_layer",
        "return 0",
        ("tests/checkpoint/test_probe_bound.py",),
    ),
    M(
        "probe-bound-width-without-the-memory",
        "megamemo/checkpoint/probe_bound.py",
        "return max(cfg.d_model, cfg.d_inner, cfg.n_head * cfg.d_head, segment_len + cfg.mem_len)",
        "return max(cfg.d_model, cfg.d_inner, cfg.n_head * cfg.d_head, segment_len)",
        (
            "tests/checkpoint/test_probe_bound.py::test_the_width_is_the_keys_when_segment_and_memory_outrun_every_projection",
        ),
    ),
    # ---- megamemo/runtime ------------------------------------------------------------------------------------
    M(
        "free-port-from-the-ephemeral-range",
        "megamemo/runtime/dist.py",
        "for _ in range(tries if low > PORTS_FROM else 0):",
        "for _ in range(0):",
        (
            "tests/launch/test_launch_cluster_env.py::test_a_free_port_is_drawn_below_the_ephemeral_range_and_skips_a_taken_one",
        ),
    ),
    M(
        "launcher-blames-the-lowest-rank",
        "megamemo/runtime/launcher.py",
        "min(failed, key=lambda rc: (rc[1] in (-signal.SIGABRT, interruptions.EXIT_PEER_LOST), rc[0]))",
        "min(failed, key=lambda rc: rc[0])",
        (f"{LAUNCHER}::test_a_sigabrt_is_a_consequence_whatever_the_ranks",),
    ),
    # (was: the wait loop polling with any(), which stops at the first running worker; since the launcher notes
    # every worker's exit each round (_note_exits, #40) that mutation changes nothing, so this one takes its place)
    M(
        "launcher-kills-rank-0-before-it-says-the-error",
        "megamemo/runtime/launcher.py",
        "grace = EXPLAINED_GRACE_S if first[1] in explained else 0.0",
        "grace = 0.0",
        (f"{LAUNCHER}::test_after_an_explained_error_rank_0_may_still_say_it",),
    ),
    M(
        "launcher-leaves-the-others-running-after-a-failure",
        "megamemo/runtime/launcher.py",
        "self.kill()  # the others cannot go on without it",
        "pass",
        (f"{LAUNCHER}::test_a_higher_rank_that_fails_stops_the_lower_ones_at_once",),
    ),
    M(
        "rundir-process-groups-left-to-interpreter-shutdown",
        "megamemo/runtime/rundir.py",
        "dist.destroy_process_group()",
        "pass",
        (
            "tests/train/test_train_units.py::test_a_refused_start_destroys_the_process_groups_before_the_interpreter_"
            "shuts_down",
        ),
    ),
    M(
        "lock-reused-pid-taken-for-the-holder",
        "megamemo/runtime/lock.py",
        'return holder.get("pid_start") in (None, start)',
        "return True",
        ("tests/runtime/test_run_lock.py::test_a_reused_pid_is_not_the_holder",),
    ),
    M(
        "lock-zombie-taken-for-alive",
        "megamemo/runtime/lock.py",
        "if fields is not None and fields[0] in DEAD_STATES:",
        "if False:",
        ("tests/runtime/test_run_lock.py::test_a_zombie_holder_is_dead_and_taken_over",),
    ),
    M(
        "launcher-one-restart-fewer-than-asked",
        "megamemo/runtime/launcher.py",
        "left = self.max_restarts - self.restarts",
        "left = self.max_restarts - self.restarts - 1",
        (f"{LAUNCHER}::test_max_restarts_are_used_up_each_start_numbered_then_the_failure_is_the_exit_code",),
    ),
    M(
        "launcher-restart-number-is-the-start-number",
        "megamemo/runtime/launcher.py",
        "MEGAMEMO_RESTART=str(self.restarts),",
        "MEGAMEMO_RESTART=str(self.restarts + 1),",
        (f"{LAUNCHER}::test_max_restarts_are_used_up_each_start_numbered_then_the_failure_is_the_exit_code",),
    ),
    M(
        "slurm-failure-helper-needs-megamemo-installed",
        "scripts/slurm_failure.py",
        'spec = importlib.util.spec_from_file_location("megamemo_slurm_interruptions", MODULE)',
        'return __import__("megamemo.runtime.interruptions").runtime.interruptions',
        (f"{INTERRUPTIONS}::test_the_slurm_helper_prints_shell_assignments",),
    ),
    M(
        "culprit-the-lowest-rank-before-the-earliest",
        "megamemo/runtime/interruptions.py",
        "return min(causes, key=lambda e: (e.time, e.rank)) if causes else None",
        "return min(causes, key=lambda e: (e.rank, e.time)) if causes else None",
        (f"{INTERRUPTIONS}::test_the_culprit_is_the_first_failure_that_no_other_caused",),
    ),
    M(
        "watchdog-peers-at-its-own-step-taken-for-behind",
        "megamemo/runtime/watchdog.py",
        'behind = sorted(r for r, b in beats.items() if b.get("step", 0) == low and low < self.step)',
        'behind = sorted(r for r, b in beats.items() if b.get("step", 0) == low)',
        (
            f"{INTERRUPTIONS}::test_the_watchdog_blames_no_fresh_peer_at_its_step_and_a_silent_one_only_past_the_stale_"
            "limit",
        ),
    ),
    M(
        "watchdog-stale-at-the-limit-itself",
        "megamemo/runtime/watchdog.py",
        'silent = sorted(r for r, b in beats.items() if now - float(b["beat"]) > stale)',
        'silent = sorted(r for r, b in beats.items() if now - float(b["beat"]) >= stale)',
        (
            f"{INTERRUPTIONS}::test_the_watchdog_blames_no_fresh_peer_at_its_step_and_a_silent_one_only_past_the_stale_"
            "limit",
        ),
    ),
    M(
        "goodput-wall-ends-at-an-earlier-starts-end",
        "megamemo/runtime/goodput.py",
        'ends = [r for r in records if r.get("kind") == "end" and float(r["time"]) >= float(starts[-1]["time"])]',
        'ends = [r for r in records if r.get("kind") == "end"]',
        (f"{INTERRUPTIONS}::test_goodput_of_a_running_restart_after_an_ended_start_and_with_older_interruptions",),
    ),
    M(
        "goodput-counts-an-earlier-historys-interruptions",
        "megamemo/runtime/goodput.py",
        'lost = [r for r in interruptions if float(r.get("time", 0)) >= t0]',
        "lost = list(interruptions)",
        (f"{INTERRUPTIONS}::test_goodput_of_a_running_restart_after_an_ended_start_and_with_older_interruptions",),
    ),
    M(
        "goodput-process-start-from-the-wrong-stat-field",
        "megamemo/runtime/goodput.py",
        'ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])',
        'ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[21])',
        (f"{INTERRUPTIONS}::test_the_process_start_is_read_from_proc_as_wall_clock_time",),
    ),
    M(
        "dist-default-group-timeout-in-minutes",
        "megamemo/runtime/dist.py",
        "timeout=timedelta(seconds=timeout_s),",
        "timeout=timedelta(minutes=timeout_s),",
        ("tests/train/test_train_units.py::test_the_collective_timeout_reaches_every_group_in_its_unit",),
    ),
    M(
        "replica-record-drops-the-partitions",
        "megamemo/checkpoint/replicas.py",
        'out["partitions"] = list(self.partitions)',
        "pass",
        (
            "tests/checkpoint/test_replica_record.py::"
            "test_an_old_rank_files_replicas_read_and_written_back_are_the_same_json",
        ),
    ),
    # ---- megamemo/interop ------------------------------------------------------------------------------------
    M(
        "reference-import-k-v-before-q",
        "megamemo/interop/reference.py",
        'out[f"{m}.attn.qkv.weight"] = torch.cat([take(f"{a}.q_net.weight"), take(f"{a}.kv_net.weight")], 0)',
        'out[f"{m}.attn.qkv.weight"] = torch.cat([take(f"{a}.kv_net.weight"), take(f"{a}.q_net.weight")], 0)',
        ("tests/interop/test_convert_reference.py::test_imported_reference_reproduces_the_reference_nll",),
    ),
    M(
        "convert-no-check-flag-not-passed-through",
        "megamemo/interop/convert.py",
        "_write_single(c, tmp, meta, request.dtype, data, request.memory, not request.no_check, log, progress_every)",
        "_write_single(c, tmp, meta, request.dtype, data, request.memory, True, log, progress_every)",
        ("tests/eval/test_eval_training.py::test_eval_of_a_run_equals_its_validation",),
    ),
    # ---- megamemo/train --------------------------------------------------------------------------------------
    M(
        "train-no-reseed-under-another-layout",
        "megamemo/train/loop.py",
        "self._reseed(saved.step)",
        "pass",
        (
            "tests/interop/test_convert_parallel.py::test_a_resume_under_another_layout_with_dropout_reseeds_every_stream",
        ),
    ),
    M(
        "train-peer-lost-runs-interpreter-shutdown",
        "megamemo/train/run.py",
        "leave_without_finalizing(lost)",
        "pass",
        (
            "tests/train/test_train_units.py::test_a_rank_whose_peer_is_gone_tears_down_in_order_and_exits_4_without_"
            "interpreter_shutdown",
        ),
    ),
    M(
        "train-bf16-on-a-v100",
        "megamemo/train/engine.py",
        "if (major, minor) < BF16_MIN_CAPABILITY:",
        "if False:",
        ("tests/runtime/test_bf16_capability.py::test_check_precision_refuses_bf16_below_compute_capability_8",),
    ),
    M(
        "train-warmup-off-by-one",
        "megamemo/train/engine.py",
        "return (step + 1) / warmup",
        "return step / warmup",
        ("tests/train/test_train_units.py::test_lr_schedule_matches_torch_cosine_and_warms_up",),
    ),
    M(
        "metrics-bits-per-byte-of-the-train-split-always",
        "megamemo/train/metrics.py",
        "ratio = self.bytes_per_token.get(split or self.train_split)",
        "ratio = self.bytes_per_token.get(self.train_split)",
        (f"{SUBWORD}::test_bits_per_byte_by_hand",),
    ),
    M(
        "forms-a-failed-form-is-timed-anyway",
        "megamemo/train/forms.py",
        'seconds.append(t if ok and t is not None else float("inf"))',
        "seconds.append(t if t is not None else 0.0)",
        ("tests/train/test_forms.py::test_a_form_that_fails_is_skipped_and_never_chosen_however_fast",),
    ),
    M(
        "forms-eager-whatever-the-timings",
        "megamemo/train/forms.py",
        "best = min(range(len(forms)), key=lambda k: (seconds[k], k))",
        "best = 0",
        ("tests/train/test_forms.py::test_the_fastest_form_that_agrees_is_chosen",),
    ),
    M(
        "forms-flex-on-a-v100",
        "megamemo/train/forms.py",
        "elif major < 8:",
        "elif major < 7:",
        ("tests/train/test_forms.py::test_flex_is_never_a_candidate_below_sm80_or_under_determinism",),
    ),
    M(
        "forms-compile-off-ignored",
        "megamemo/train/forms.py",
        "if not resolve_compile(cfg.train.compile, device):",
        "if False:",
        ("tests/train/test_forms.py::test_compiled_candidates_follow_train_compile",),
    ),
    M(
        "forms-agreed-by-this-rank-alone",
        "megamemo/train/forms.py",
        "seconds = _all_ranks(seconds, device)",
        "pass",
        ("tests/kernels/test_flex_attention.py::test_a_form_trains_only_when_every_ranks_start_up_check_agrees",),
    ),
    M(
        "forms-the-fastest-rank-decides",
        "megamemo/train/forms.py",
        "dist.all_reduce(t, op=dist.ReduceOp.MAX)",
        "dist.all_reduce(t, op=dist.ReduceOp.MIN)",
        ("tests/kernels/test_flex_attention.py::test_a_form_trains_only_when_every_ranks_start_up_check_agrees",),
    ),
    M(
        "sync-planted-in-the-micro-steps",
        "megamemo/train/loop.py",
        "loss_sum += nll.detach().sum(dtype=torch.float64)",
        'loss_sum += nll.detach().sum(dtype=torch.float64); __import__("warnings").warn("called a synchronizing '
        'CUDA operation")',  # on the CPU, what set_sync_debug_mode("warn") says of a sync
        (f"{SYNCS}::test_a_cpu_step_under_the_recorder_reports_no_sync",),
    ),
    # ---- megamemo/eval ---------------------------------------------------------------------------------------
    M(
        "eval-tgt-len-flag-ignored",
        "megamemo/eval/evaluate.py",
        '"tgt_len": a.tgt_len or c.tgt_len,',
        '"tgt_len": c.tgt_len,',
        ("tests/eval/test_eval_loop.py::test_other_lengths_and_options",),
    ),
    M(
        "scoring-bytes-of-the-inputs",
        "megamemo/model/scoring.py",
        "n_bytes += int(token_bytes[tgt.cpu()].sum())",
        "n_bytes += int(token_bytes[inp.cpu()].sum())",
        (f"{SUBWORD}::test_bits_per_byte_by_hand",),
    ),
    M(
        "generate-nucleus-drops-the-crossing-token",
        "megamemo/model/generation.py",
        "keep_sorted = before < top_p  # the token that crosses top_p is kept; the first always is",
        "keep_sorted = before + sorted_p <= top_p",
        ("tests/eval/test_generate.py::test_nucleus_keeps_the_smallest_set_reaching_top_p",),
    ),
    M(
        "eval-lengths-unchecked",
        "megamemo/eval/evaluate.py",
        'model.cfg.check_lengths(**{"--tgt-len": a.tgt_len, "--mem-len": a.mem_len, "--clamp-len": a.clamp_len})',
        "pass",
        ("tests/eval/test_eval_loop.py::test_lengths_are_held_to_the_training_configs_rules",),
    ),
    # ---- megamemo/plan ---------------------------------------------------------------------------------------
    M(
        "steptime-tp-comm-not-in-the-bubble",
        "megamemo/plan/steptime.py",
        '"pp_bubble": bubble + (tp_comm * (pp - 1) if pp > 1 else 0.0),',
        '"pp_bubble": bubble,',
        (f"{STEPTIME}::test_the_tp_all_reduces_of_an_idle_slot_are_in_the_bubble",),
    ),
    M(
        "steptime-stage-boundary-inside-a-node",
        "megamemo/plan/steptime.py",
        "spans = world > gpus_per_node",
        "spans = False",
        (f"{STEPTIME}::test_pipeline_stages_on_two_nodes_send_over_the_slower_link",),
    ),
    M(
        "steptime-gpu-host-overhead-dropped",
        "megamemo/plan/steptime.py",
        "overhead = max(0.0, wall - compute - elementwise)",
        "overhead = 0.0",
        (f"{STEPTIME}::test_a_gpu_host_that_launches_slower_than_the_kernels_run_is_the_overhead",),
    ),
    M(
        "opcost-unaligned-gemms-at-full-speed",
        "megamemo/plan/opcost.py",
        "gemm[i] = max(seg.flops[i] / rate, by_bw[i]) * (1.0 if seg.aligned[i] else dev.unaligned)",
        "gemm[i] = max(seg.flops[i] / rate, by_bw[i])",
        ("tests/plan/test_opcost.py",),
    ),
    M(
        "plan-fused-priced-as-eager",
        "megamemo/plan/optrace.py",
        'if cfg.attention == "fused":  # the Triton kernels cannot run on meta tensors: their stand-ins record them',
        "if False:",
        ("tests/plan/test_optrace.py::test_fused_attention_is_priced_without_score_round_trips",),
    ),
    M(
        "plan-fused-backward-priced-as-flash-attention",
        "megamemo/plan/fused_trace.py",
        "FWD_UNITS, BWD_UNITS = 4, 19",
        "FWD_UNITS, BWD_UNITS = 4, 10",
        ("tests/plan/test_optrace.py::test_fused_attention_is_priced_without_score_round_trips",),
    ),
    M(
        "plan-fused-causal-tiles-miss-the-diagonal",
        "megamemo/plan/fused_trace.py",
        "return _tiles_visible(L, klen, lambda i: np.zeros_like(i), lambda i: np.minimum(M + i, klen - 1))",
        "return _tiles_visible(L, klen, lambda i: np.zeros_like(i), lambda i: np.minimum(M + i - 1, klen - 1))",
        ("tests/plan/test_optrace.py::test_fused_tiles_by_hand",),
    ),
    M(
        "analyze-segments-flag-not-passed-through",
        "megamemo/eval/analyze.py",
        "found = analyze(model, reader, tgt_len=L, mem_len=M, segments=r.segments, device=r.device)",
        "found = analyze(model, reader, tgt_len=L, mem_len=M, segments=50, device=r.device)",
        ("tests/eval/test_analyze.py::test_cli_writes_plots_and_json",),
    ),
    # ---- megamemo/export -------------------------------------------------------------------------------------
    M(
        "harness-is-greedy-looks-at-the-first-token",
        "megamemo/export/harness.py",
        "out.append((-float(nll.sum()), bool(hit.all())))",
        "out.append((-float(nll.sum()), bool(hit[0])))",
        ("tests/export/test_harness.py::test_loglikelihood_and_generate_until_agree_with_megamemo",),
    ),
    M(
        "hf-byte-table-shift-starts-at-1",
        "megamemo/export/hf.py",
        "out, shift = [], 0",
        "out, shift = [], 1",
        ("tests/export/test_export_hf.py::test_byte_tokenizer_maps_every_byte_to_its_id",),
    ),
    M(
        "harness-lm-eval-device-passed-twice",
        "megamemo/export/harness.py",
        "extra = {k: v for k, v in (lm_eval_config or {}).items() if v is not None and k not in model_args}",
        "extra = {k: v for k, v in (lm_eval_config or {}).items() if v is not None}",
        ("tests/export/test_harness.py::test_the_documented_lm_eval_command_builds_the_model_with_lm_evals_device",),
    ),
    M(
        "hf-start-token-matched-in-text",
        "megamemo/export/hf.py",
        "specials.update(start, split_special_tokens=bool(start))",
        "specials.update(start)",
        ("tests/export/test_export_hf.py::test_exported_tokenizers_carry_the_start_token_as_bos_and_eos",),
    ),
    # ---- megamemo/commands -----------------------------------------------------------------------------------
    M(
        "commands-train-drops-the-set-overrides",
        "megamemo/commands/train.py",
        "sets = list(args.set)",
        "sets = []",
        ("tests/commands/test_cli.py::test_trains_flags_become_config_overrides",),
    ),
    M(
        "commands-device-decided-when-the-parser-is-built",
        "megamemo/commands/flags.py",
        '"device": dict(default="auto", '
        'help="torch device: auto (cuda when torch sees one, else cpu), cpu, cuda, cuda:N"),',
        '"device": dict(default=__import__("megamemo.runtime.device").runtime.device.torch_device("auto")),',
        ("tests/commands/test_cli.py::test_the_shared_flags_are_one_definition_the_same_on_every_machine",),
    ),
    # ---- megamemo (the dispatcher) ---------------------------------------------------------------------------
    M(
        "cli-exit-code-lost",
        "megamemo/cli.py",
        "return int(rc or 0)",
        "return 0",
        ("tests/commands/test_cli.py::test_a_subcommands_exit_code_is_the_commands",),
    ),
    M(
        "cli-overrides-the-users-dynamo-choice",
        "megamemo/cli.py",
        'if "TORCHDYNAMO_DISABLE" not in os.environ:',
        "if True:",
        ("tests/commands/test_cli.py::test_the_users_torchdynamo_choice_is_kept",),
    ),
    M(
        "cli-bug-reported-as-a-user-error",
        "megamemo/cli.py",
        "except user_errors as e:",
        "except Exception as e:",
        ("tests/commands/test_cli_errors.py::test_a_bug_in_a_command_exits_1_with_its_traceback",),
    ),
    M(
        "cli-trainings-crash-made-a-user-error",
        "megamemo/cli.py",
        'user_errors = () if name == "train" else USER_ERRORS',
        "user_errors = USER_ERRORS",
        ("tests/commands/test_cli_errors.py::test_trainings_exceptions_keep_their_own_exit_codes",),
    ),
    M(
        "flags-optional-bool-field-loses-its-no-form",
        "megamemo/commands/flags.py",
        'return dict(action="store_true") if hint is bool else dict(action=argparse.BooleanOptionalAction)',
        'return dict(action="store_true")',
        ("tests/commands/test_cli_errors.py::test_a_fields_flag_has_its_type_default_and_comment",),
    ),
    M(
        "slurm-triton-cache-left-in-the-shared-home",
        "launch/slurm/node_env.sh",
        'export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$base/triton}"',
        ":",
        (f"{CLUSTER_ENV}::test_the_compile_caches_are_node_local_unless_set",),
    ),
    M(
        "slurm-ifname-the-loopback-on-the-master-node",
        "launch/slurm/node_env.sh",
        'if [ "$dev" = lo ]; then                 # this node\'s own address: the interface that holds it',
        "if false; then",
        (f"{CLUSTER_ENV}::test_the_socket_interfaces_are_the_route_to_master_addr",),
    ),
    M(
        "slurm-ifname-replaces-the-users",
        "launch/slurm/node_env.sh",
        'if [ -n "${!name:-}" ]; then',
        "if false; then",
        (f"{CLUSTER_ENV}::test_a_set_interface_is_kept_and_no_route_leaves_them_unset",),
    ),
    M(
        "slurm-ifname-from-a-host-name-unresolved",
        "launch/slurm/node_env.sh",
        'addr="$(getent ahostsv4 "$addr" 2>/dev/null | awk \'NR == 1 {print $1}\')"',
        ":",
        (f"{CLUSTER_ENV}::test_the_socket_interfaces_are_the_route_to_master_addr",),
    ),
    # ---- tests' own instruments ---------------------------------------------------------------------------------
    M(
        "sync-sites-warnings-frames-taken-for-the-sync",
        "tests/helpers/sync_sites.py",
        "while stack and os.path.realpath(stack[-1].filename) in skip:",
        "while False:",
        (
            f"{SYNCS}::test_a_warning_raised_inside_megamemo_is_megamemos_not_the_warnings_modules",
            f"{SYNCS}::test_attribution_by_the_innermost_frame",
        ),
    ),
    M(
        "sync-sites-unneeded-own-syncs-allowed",
        "tests/helpers/sync_sites.py",
        'out = [f"an unneeded host sync at {s}" for s in sorted(set(own) - NEEDED_SYNCS)]',
        "out = []",
        (f"{SYNCS}::test_a_warning_raised_inside_megamemo_is_megamemos_not_the_warnings_modules",),
    ),
    # ---- scripts/gpu_check (the device check, rehearsed on the CPU) -----------------------------------------
    M(
        "gpu-check-plan-past-nine-minutes",
        "scripts/gpu_check.py",
        '"train": 190,',
        '"train": 250,',
        (f"{GPU_CHECK}::test_the_plan_of_one_gpu_fits_nine_minutes_and_runs_nothing",),
    ),
    M(
        "gpu-check-killed-section-loses-its-rows",
        "scripts/gpu_check.py",
        'result, status = {**S.salvage(ctx, name), "error": str(e)}, "timeout"',
        'result, status = {"error": str(e)}, "timeout"',
        (f"{GPU_CHECK}::test_a_section_killed_past_its_budget_keeps_the_rows_it_had_written",),
    ),
    M(
        "gpu-check-killed-tests-lose-their-results",
        "scripts/gpu_check_sections.py",
        "return _summary(test_rows(log.read_text())) if log.exists() else {}",
        "return {}",
        (f"{GPU_CHECK}::test_a_section_killed_past_its_budget_keeps_the_rows_it_had_written",),
    ),
    M(
        "gpu-step-rows-written-only-at-the-end",
        "bench/gpu_step.py",
        "_emit(a, row, common)  # before the next form runs: a kill keeps it",
        "pass",
        (f"{GPU_CHECK}::test_the_bench_writes_each_row_before_the_next_form_runs",),
    ),
    M(
        "gpu-check-eval-at-the-checkpoints-dtype",
        "scripts/gpu_check_train.py",
        'args += ["--dtype", dtype, "--attention", attention, "--device", device, "--json", out]',
        'args += ["--dtype", "checkpoint", "--attention", attention, "--device", device, "--json", out]',
        (f"{GPU_CHECK}::test_eval_is_compared_at_the_validations_dtype_and_attention_form",),
    ),
    M(
        "gpu-check-eval-in-auto-attention",
        "scripts/gpu_check_train.py",
        'args += ["--dtype", dtype, "--attention", attention, "--device", device, "--json", out]',
        'args += ["--dtype", dtype, "--attention", "auto", "--device", device, "--json", out]',
        (f"{GPU_CHECK}::test_eval_is_compared_at_the_validations_dtype_and_attention_form",),
    ),
    M(
        "gpu-check-eval-tolerance-of-a-dtype-apart",
        "scripts/gpu_check_train.py",
        "EVAL_RTOL = 1e-4  # eval against the run's validation, same dtype and form: only the order of sums differs",
        "EVAL_RTOL = 1e-2",
        (f"{GPU_CHECK}::test_eval_is_compared_at_the_validations_dtype_and_attention_form",),
    ),
    M(
        "gpu-step-auto-forms-never-compiled",
        "bench/step_extras.py",
        "if not compiled:",
        "if True:",
        (f"{GPU_CHECK}::test_the_full_depth_step_times_the_forms_auto_would_choose_between",),
    ),
    M(
        "readme-gpu-claim-without-its-device-and-commit",
        "README.md",
        "| LaMemo, Transformer-XL, RPE equal to the reference code (NLL, memory, gradients) | tested | "
        "the golden cases on "
        "CUDA: passed (H100, 11a83f6, eager) |",
        "| LaMemo, Transformer-XL, RPE equal to the reference code (NLL, memory, gradients) | tested | "
        "the golden cases on "
        "CUDA: passed |",
        (f"{GPU_CHECK}::test_every_gpu_claim_of_the_readme_names_its_device_and_code",),
    ),
    # ---- numerics: replicas, spikes, replay (issue 47) ---------------------------------------------------------
    M(
        "numerics-owner-not-the-reference-of-its-partition",
        "megamemo/train/numerics.py",
        'ref = [owner] if owner is not None and owner["own_ok"] else None',
        "ref = None",
        (f"{NUMERICS}::test_the_verdict_names_the_replica_at_fault",),
    ),
    M(
        "numerics-fingerprint-blind-to-position",
        "megamemo/train/numerics.py",
        "w = torch.arange(lo + 1, lo + 1 + part.numel(), dtype=torch.int64, device=part.device).remainder(_P)",
        "w = torch.ones_like(part)",
        (f"{NUMERICS}::test_a_fingerprint_sees_any_one_flipped_bit_and_nothing_else",),
    ),
    M(
        "numerics-mismatch-exits-as-a-crash",
        "megamemo/train/run.py",
        "code = 1 if isinstance(e, DivergedError) else EXIT_NODE_SUSPECT if isinstance(e, ReplicaMismatch) else 2",
        "code = 1 if isinstance(e, (DivergedError, ReplicaMismatch)) else 2",
        (f"{NUMERICS}::test_a_bit_flipped_in_one_replica_is_caught_named_and_the_job_resumes_bit_exact",),
    ),
    M(
        "numerics-suspects-not-read-from-the-heartbeats",
        "megamemo/runtime/interruptions.py",
        'found = (b.get("replicas") or {}).get("suspects")',
        "found = None",
        (f"{NUMERICS}::test_a_replica_mismatch_is_recorded_as_node_suspect_and_retried",),
    ),
    M(
        "faults-flip-on-every-rank",
        "megamemo/checkpoint/faults.py",
        "if self.flip is None or self.flip[:3] != (what, step, self.rank):",
        "if self.flip is None or self.flip[:2] != (what, step):",
        (f"{NUMERICS}::test_a_bit_flipped_in_one_replica_is_caught_named_and_the_job_resumes_bit_exact",),
    ),
    M(
        "rollback-skips-nothing",
        "megamemo/train/loop.py",
        "for _ in range(self.skips.get(step, 0)):  # a rollback's skipped batches (train/rollback.py)",
        "for _ in range(0):",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "rollback-keeps-the-undone-steps-records",
        "megamemo/train/rollback.py",
        "trainer.metrics.rolled_back(trainer.counters.step, step)",
        "pass",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "rollback-to-the-oldest-checkpoint",
        "megamemo/train/rollback.py",
        "return done[-1] if done else None",
        "return done[0] if done else None",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "replay-exact-under-another-layout",
        "megamemo/train/replay.py",
        'tol, why = (None, "") if p.same_layout else tolerance(p, len(steps))',
        'tol, why = (None, "")',
        (f"{NUMERICS}::test_replay_of_a_dp2_keyed_dropout_run_in_one_process_is_within_its_tolerance",),
    ),
    M(
        "replay-compares-the-loss-only",
        "megamemo/train/replay.py",
        'for key in ("loss", "grad_norm", "lr"):  # the LR: the schedule\'s, seen at the replay\'s last step too',
        'for key in ("loss", "lr"):',
        (f"{NUMERICS}::test_replay_is_identical_under_the_runs_layout_and_finds_a_tampered_step",),
    ),
    M(
        "replay-lr-schedule-over-the-replays-steps",
        "megamemo/train/replay.py",
        '"optim.decay_steps": p.config["optim"].get("decay_steps") or p.config["train"]["max_steps"],  # the LR',
        '"optim.decay_steps": p.config["optim"].get("decay_steps"),',
        (f"{NUMERICS}::test_replay_past_warmup_follows_the_runs_lr_schedule",),
    ),
    M(
        "rollback-forgets-the-undone-attempt",
        "megamemo/train/metrics.py",
        'undone = [r for r in trim_jsonl(self.path, step) if r.get("kind") in ("train", "skip")]',
        "undone = [r for r in trim_jsonl(self.path, step) if False]",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "replay-of-a-rolled-back-attempt-skips-its-spike",
        "megamemo/train/replay.py",
        "return recorded, spikes[:i]",
        "return recorded, spikes",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "replay-drops-the-datas-fault",
        "megamemo/train/replay.py",
        'DATA_FAULT = "MEGAMEMO_FAULT_BAD_BATCH"  # an injected fault of the data (checkpoint/faults.py)',
        "DATA_FAULT = None",
        (f"{NUMERICS}::test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit",),
    ),
    M(
        "suspect-a-differing-replay-taken-for-a-reproduced-one",
        "megamemo/runtime/suspect.py",
        'if verdict.startswith(("replay: identical", "replay: within")):',
        'if verdict.startswith(("replay: identical", "replay: within", "replay: differs")):',
        (f"{NUMERICS}::test_the_supervisors_decision_by_replay_from_its_verdict",),
    ),
    M(
        "suspect-needs-megamemo-importable",
        "megamemo/runtime/suspect.py",
        "import json",
        "import json, megamemo.checkpoint.layout",
        ("tests/runtime/test_interruptions.py::test_the_replay_decision_runs_where_megamemo_is_not_importable",),
    ),
    M(
        "suspect-replay-in-one-process-whatever-the-layout",
        "megamemo/runtime/suspect.py",
        'return [a for k in ("dp", "tp", "pp") for a in (f"--{k}", str(int(layout.get(k, 1))))]',
        "return []",
        (f"{NUMERICS}::test_a_bit_flipped_in_one_replica_is_caught_named_and_the_job_resumes_bit_exact",),
    ),
    M(
        "launcher-restarts-after-a-stop-during-the-record",
        "megamemo/runtime/launcher.py",
        "if self.stopping:  # a stop signal while the failure was recorded (a replay takes a while)",
        "if False:",
        (f"{NUMERICS}::test_a_stop_signal_during_the_failures_replay_is_not_lost_to_a_restart",),
    ),
    # ---- launch (the Slurm batch scripts' shell) -------------------------------------------------------------
    M(
        "slurm-node-suspect-excludes-no-node",
        "launch/slurm/failure.sh",
        'if [ "$kind" = node ] && [ -n "$c_suspects" ]; then     # exit 5: the replica check\'s suspects',
        "if false; then",
        (f"{SBATCH}::test_a_node_suspect_stop_excludes_the_node_of_the_rank_the_replica_check_named",),
    ),
    M(
        "slurm-node-suspect-excluded-whatever-the-replay-says",
        "launch/slurm/failure.sh",
        'if [ "$replay_decision" = resume ]; then',
        "if false; then",
        (f"{SBATCH}::test_a_node_suspect_stop_is_replayed_first_when_asked_and_decided_by_the_verdict",),
    ),
    M(
        "slurm-one-failure-fewer-than-max-failures",
        "launch/slurm/failure.sh",
        "left=$(( ${MEGAMEMO_MAX_FAILURES:-10} - failures + 1 ))",
        "left=$(( ${MEGAMEMO_MAX_FAILURES:-10} - failures ))",
        (f"{SBATCH}::test_a_failure_at_the_failure_cap_is_still_requeued",),
    ),
    M(
        "slurm-drained-and-draining-nodes-taken-for-healthy",
        "launch/slurm/failure.sh",
        """case "$1" in *DOWN*|*DRAIN*|*FAIL*|*NOT_RESPONDING*|*'*'*|*POWER*) return 0 ;; esac""",
        """case "$1" in *DOWN*|*DRAINED*|*FAIL*|*NOT_RESPONDING*|*'*'*|*POWER*) return 0 ;; esac""",
        (
            f"{SBATCH}::test_drained_draining_down_failed_and_unresponsive_nodes_are_at_fault_busy_ones_are_not",
            f"{SBATCH}::test_a_node_at_fault_is_excluded_before_the_requeue[draining]",
        ),
    ),
    # ---- issue 50: vocabularies, the references, the GPU catalogue ---------------------------------------------
    M(
        "vocab-unused-ids-never-warned",
        "megamemo/train/data.py",
        "if v >= n:",
        "if v >= 0:",
        (
            "tests/train/test_vocab_padding.py::test_an_explicit_n_token_above_the_datas_vocabulary_is_one_warning_naming_the_"
            "unused_ids",
        ),
    ),
    M(
        "subword-bpe-saturation-unsaid",
        "megamemo/data/subword.py",
        "if tok.vocab_size < arg:  # a warning: said under --quiet too",
        "if False:",
        (f"{SUBWORD}::test_a_bpe_that_saturates_below_its_size_is_said_in_one_line",),
    ),
    M(
        "vocab-plan-assumption-overrides-the-manifest",
        "megamemo/train/vocab.py",
        'if fallback is not None and not (d and (is_remote(d) or (Path(d) / "manifest.json").exists())):',
        "if fallback is not None:",
        ("tests/train/test_train_units.py::test_large_configs_size_their_vocabulary_from_the_data",),
    ),
    M(
        "plan-auto-vocabulary-not-padded-per-layout",
        "megamemo/plan/recommend.py",
        "if not cfg.n_token_auto:",
        "if True:",
        ("tests/plan/test_plan.py::test_an_auto_vocabulary_is_planned_padded_for_each_layouts_tp",),
    ),
    M(
        "plan-rank-model-keeps-the-whole-vocabularys-n-vocab",
        "megamemo/plan/optrace.py",
        "m, n_layer=2, n_head=m.n_head // tp, d_inner=m.d_inner // tp, n_token=m.n_token // tp, n_vocab=None",
        "m, n_layer=2, n_head=m.n_head // tp, d_inner=m.d_inner // tp, n_token=m.n_token // tp",
        ("tests/plan/test_plan.py::test_plan_command_on_the_documented_clusters",),
    ),
    M(
        "docs-reference-keeps-a-comments-first-sentence-only",
        "scripts/docs_reference.py",
        "_plain(c),",
        '_plain(c.split(". ")[0]),',
        ("tests/docs/test_docs_reference.py::test_comments_are_kept_whole",),
    ),
    M(
        "docs-reference-check-passes-keys-without-text",
        "scripts/docs_reference.py",
        "return 1 if stale or bare else 0",
        "return 1 if stale else 0",
        ("tests/docs/test_docs_reference.py::test_a_key_without_text_fails_the_check",),
    ),
    M(
        "eval-no-same-length-shows-argparses-default",
        "megamemo/commands/flags.py",
        'return dict(action="store_true") if hint is bool else dict(action=argparse.BooleanOptionalAction)',
        'return dict(action="store_true") if hint is bool else dict(action=argparse.BooleanOptionalAction, '
        "default=False)",
        ("tests/docs/test_docs_reference.py::test_the_cache_dir_and_same_length_rows_say_what_they_are",),
    ),
    M(
        "docs-errors-shard-error-shown-as-its-path",
        "scripts/docs_errors.py",
        "if kind in TWO_PART and len(args) >= 2:",
        "if False:",
        (
            "tests/docs/test_docs_reference.py::test_every_error_entry_shows_its_message_text",
            "tests/docs/test_docs_reference.py::test_the_message_of_a_variable_a_shard_error_and_a_caught_error",
        ),
    ),
    M(
        "docs-errors-a-variable-shown-by-name",
        "scripts/docs_errors.py",
        "if isinstance(node, ast.Name) and depth < 3:",
        "if False:",
        ("tests/docs/test_docs_reference.py::test_every_error_entry_shows_its_message_text",),
    ),
    M(
        "docs-errors-prepare-left-out",
        "scripts/docs_errors.py",
        "if rel in PREPARE_FILES and name in PREPARE_ERRORS:",
        "if False:",
        ("tests/docs/test_docs_reference.py::test_prepares_errors_are_in_the_catalogue",),
    ),
    M(
        "gpus-b200-sparse-bf16-figure",
        "megamemo/runtime/gpus.py",
        '{"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0},',
        '{"fp32": 75.0, "tf32": 1100.0, "bf16": 4500.0, "fp16": 4500.0},',
        ("tests/plan/test_plan.py::test_the_gpus_users_have_can_be_planned_with_their_datasheet_figures",),
    ),
    M(
        "gpus-l40s-matches-every-l40",
        "megamemo/runtime/gpus.py",
        'r"L40S",',
        'r"L40",',
        ("tests/plan/test_plan.py::test_the_gpus_users_have_can_be_planned_with_their_datasheet_figures",),
    ),
    M(
        "plan-flag-renamed-under-the-docs",
        "megamemo/plan/report.py",
        "    gpus_per_node: int  # devices (or CPU processes) per node",
        "    gpus_per_host: int  # devices (or CPU processes) per node",
        ("tests/docs/test_docs_commands.py::test_every_quick_documented_command_runs_as_written",),
    ),
]


def _line_index(lines: list[str], original: str) -> list[int]:
    return [i for i, line in enumerate(lines) if line.strip() == original.strip()]


def problems(m: Mutation, root: Path = REPO) -> list[str]:
    """What is wrong with a mutation's entry (its line not found exactly once, no tests, a test file missing)."""
    out = []
    path = root / m.file
    if not path.is_file():
        return [f"{m.name}: {m.file} does not exist"]
    found = _line_index(path.read_text().splitlines(), m.original)
    if len(found) != 1:
        out.append(f"{m.name}: the original line occurs {len(found)} times in {m.file}: {m.original!r}")
    if m.mutated.strip() == m.original.strip():
        out.append(f"{m.name}: the mutated line is the original")
    if not m.tests:
        out.append(f"{m.name}: no tests")
    for t in m.tests:
        if not (root / t.split("::")[0]).is_file():
            out.append(f"{m.name}: test file {t.split('::')[0]} does not exist")
    return out


def apply(m: Mutation, root: Path) -> str:
    """Mutate the copy at `root`; returns the file's original text (to restore)."""
    path = root / m.file
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    (i,) = _line_index([ln.rstrip("\n") for ln in lines], m.original)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + m.mutated.strip() + "\n"
    path.write_text("".join(lines))
    return text


def copy_tree(dst: Path) -> None:
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_one(m: Mutation, root: Path, timeout: float) -> tuple[str, float, str]:
    """('killed' | 'survived' | 'error', seconds, the tail of pytest's output)."""
    original = apply(m, root)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-n",
                "0",
                "-x",
                "-q",
                "--timeout",
                str(int(timeout)),
                *m.tests,
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout + 60,
        )
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timed out"
    finally:
        (root / m.file).write_text(original)
    seconds = time.monotonic() - t0
    verdict = "survived" if rc == 0 else "error" if rc in (4, 5) else "killed"
    return verdict, seconds, "\n".join(out.strip().splitlines()[-5:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="run only these mutations (default: all)")
    p.add_argument("--list", action="store_true", help="print the mutations, one a line")
    p.add_argument("--timeout", type=float, default=600, help="seconds a mutation's tests may take")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy of the tree")
    a = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not a.names or m.name in a.names]
    unknown = sorted(set(a.names) - {m.name for m in MUTATIONS})
    if unknown:
        print(f"unknown mutations: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if a.list:
        for m in chosen:
            print(f"{m.name}  {m.file}  {' '.join(m.tests)}")
        return 0
    bad = [x for m in chosen for x in problems(m)]
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="megamemo-mutants-"))
    results = []
    try:
        copy_tree(root)
        for k, m in enumerate(chosen, 1):
            verdict, seconds, tail = run_one(m, root, a.timeout)
            results.append((m, verdict))
            print(f"[{k}/{len(chosen)}] {verdict:<8} {seconds:6.1f}s  {m.name}  ({m.file})", flush=True)
            if verdict != "killed":
                print("    " + tail.replace("\n", "\n    "), flush=True)
    finally:
        if a.keep:
            print(f"the copy: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    killed = sum(v == "killed" for _, v in results)
    others = [f"{m.name} ({v})" for m, v in results if v != "killed"]
    print(
        f"killed {killed} / {len(results)} mutations in {time.monotonic() - t0:.0f} s"
        + (f"; not killed: {', '.join(others)}" if others else "")
    )
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
