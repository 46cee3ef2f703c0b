"""`megamemo train` under tensor (TP=2), pipeline (PP=2) and both (TP=2 x PP=2) parallelism, with real processes: the
same per-step losses as one process (with gradient accumulation: a memory per micro-batch), the same memory once the
ranks' shards are put together, and bit-exact resume after a rank is killed while saving. Dropout 0.1 and dropatt 0.1
with keyed masks (helpers/runs_cache.py KEYED): every layout drops what the one process drops (with stream masks it
would not: each TP rank and each pipeline stage draws from streams of its own)."""

from __future__ import annotations

import json
import re
import signal

import pytest
from helpers.bounds import drift_bound
from helpers.runs_cache import KEYED
from test_train_runs import (
    assert_no_corrupt_checkpoint,
    checkpoint_memory,
    checkpoint_model,
    committed_steps,
    launch,
    logs,
    losses,
    run,
    wait,
)

from megamemo.checkpoint.store import newest_complete
from megamemo.model import ModelConfig

# starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset); run again at another
# instruction set (scripts/test_other_isa.sh)
pytestmark = [pytest.mark.multiproc, pytest.mark.numerics]

EXACT = [
    *KEYED,
    "--set",
    "train.grad_accum=2",
    # periodic validation at its own lengths (memory 16 + 16 - 8 = 24 rows), through the stages under PP
    "--set",
    "eval.every=4",
    "--set",
    "eval.tgt_len=8",
    "--set",
    "eval.max_segments=5",
    "--set",
    "eval.batch_size=4",
]


def eval_losses(run_dir) -> dict[int, tuple[float, int]]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["tokens"]) for r in recs if r["kind"] == "eval"}


@pytest.fixture(scope="module")
def single(tiny_cfg, shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    run(1, tiny_cfg, shards, run_dir, *EXACT)
    return run_dir


FP32_U = 2.0**-24  # fp32's unit roundoff


def weight_drift(run_a, run_b) -> tuple[float, ModelConfig]:
    """(the largest relative difference max|a - b| / max|a| of a floating-point weight between the two runs' newest
    checkpoints, the model's config)."""
    a = checkpoint_model(newest_complete(run_a / "checkpoints"))
    b = checkpoint_model(newest_complete(run_b / "checkpoints")).state_dict()
    rho = max(
        float((w - b[k]).abs().max()) / max(float(w.abs().max()), 1e-30)
        for k, w in a.state_dict().items()
        if w.is_floating_point()
    )
    return rho, a.cfg


def check_equals_single(run_dir, single, what):
    ref, got = losses(single), losses(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    # the losses (and validation losses, per token relative so relative to the mean) as the memory below: what the
    # weights' drift rho at the last step explains (it grows with the steps), plus two orders of the forward pass's
    # sums (tests/helpers/bounds.py drift_bound)
    rho, cfg = weight_drift(single, run_dir)
    n_layer = cfg.n_layer
    assert rho < 1e-3, (what, rho)  # rounding, not a run gone elsewhere
    assert all(abs(got[s] - ref[s]) <= drift_bound(cfg, rho, ref[s]) for s in ref), (what, got, ref, rho)
    ref_eval, got_eval = eval_losses(single), eval_losses(run_dir)
    assert sorted(got_eval) == sorted(ref_eval) == [4, 8], (what, got_eval)
    for s in ref_eval:
        assert got_eval[s][1] == ref_eval[s][1] == 5 * 8 * 4, (what, s, got_eval, ref_eval)  # every token once
        assert abs(got_eval[s][0] - ref_eval[s][0]) <= drift_bound(cfg, rho, ref_eval[s][0]), (what, s, rho)
    # the memory after the last step, from every rank's pieces (TP head shards, PP stages), is the one-process one
    # up to what the weights' own drift explains. The layouts' fp32 gradient sums run in other orders, so after 8
    # Adam steps the weights differ by rounding (most in rarely seen embedding rows: Adam normalises a near-zero
    # gradient's noise to a full step). The memory is a function of the weights: to first order each of the model's
    # n_layer + 1 stages (the embedding, then each layer) moves its output by at most the largest relative drift
    # rho of a weight, so a memory tensor t may differ by (n_layer + 1) * rho * max|t|, plus 4 fp32 roundings of
    # max|t|. LaMemo's emb FIFO is exactly the embedding rows times sqrt(d_model) / (1 - dropout): its drift is the
    # embedding's, which is what moves between CPUs (2.0e-6 of weight drift on a Xeon, 5.1e-6 at another ISA).
    # A memory put together wrongly (a shard's heads or a stage's layers out of place) differs by O(max|t|).
    want = checkpoint_memory(newest_complete(single / "checkpoints"))
    have = checkpoint_memory(newest_complete(run_dir / "checkpoints"))
    assert sorted(have.tensors) == sorted(want.tensors) and have.batch_size == want.batch_size == 4
    for name, t in want.tensors.items():
        scale = float(t.abs().max())
        tol = (n_layer + 1) * rho * scale + 4 * FP32_U * scale
        diff = float((have[name] - t).abs().max())
        assert diff <= tol, (what, name, diff, tol, rho)
    return got


def test_tp2_x_pp2_on_four_ranks_equals_one_process(tiny_cfg, shards, single, tmp_path):
    """With activation checkpointing (DeepSpeed's pipeline recomputing each layer, train.activation_checkpointing):
    recomputation changes nothing the run computes (the layouts without it: the test below)."""
    run_dir = tmp_path / "run"
    run(
        4,
        tiny_cfg,
        shards,
        run_dir,
        "--tp",
        "2",
        "--pp",
        "2",
        *EXACT,
        "--set",
        "train.activation_checkpointing=true",
        timeout=300,
    )
    check_equals_single(run_dir, single, "tp2 x pp2")


def test_tp2_with_compiled_attention_regions_equals_one_process(tiny_cfg, shards, single, tmp_path):
    """train.compile on under TP 2: the attention between the collectives compiled (aot_eager: dynamo's graphs run
    by autograd's eager kernels, so what is checked is the capture, not inductor's code generation, which the
    single-device compile tests cover) equals one eager process."""
    run_dir = tmp_path / "run"
    run(
        2,
        tiny_cfg,
        shards,
        run_dir,
        "--tp",
        "2",
        *EXACT,
        "--set",
        "train.compile=on",
        "--set",
        "train.compile_backend=aot_eager",
        timeout=300,
    )
    text = logs(run_dir)
    assert "[train] compile: attention regions under tensor parallelism (parallel.tp=2)" in text
    # the causal attention without and with memory, the look-ahead: 3 graphs, within the <= 3 recompiles rule
    graphs = [int(g) for g in re.findall(r"(\d+) graphs compiled \((\d+) recompiles\)", text) for g in g[:1]]
    assert graphs and all(1 <= g <= 4 for g in graphs), text[-2000:]
    check_equals_single(run_dir, single, "tp2 compiled regions")


@pytest.mark.parametrize("layout", ["--tp", "--pp"])
def test_parallel_layout_equals_one_process_then_resumes_bit_exact(layout, tiny_cfg, shards, single, tmp_path):
    """TP 2 recomputes its layers (train.activation_checkpointing: torch's checkpoint per layer), which stream masks
    cannot do under TP (a config error) and keyed masks do: the one process keeps its activations."""
    args = [layout, "2", *EXACT] + (["--set", "train.activation_checkpointing=true"] if layout == "--tp" else [])
    run_dir = tmp_path / "run"
    run(2, tiny_cfg, shards, run_dir, *args)
    got = check_equals_single(run_dir, single, layout)

    # a rank killed while writing the step-6 checkpoint; the same command again resumes from step 3
    crash = tmp_path / "crash"
    rcs = wait(launch(2, tiny_cfg, shards, crash, *args, env_extra={"MEGAMEMO_FAULT_KILL_IN_SAVE": "6:1"}))
    assert rcs[1] == -signal.SIGKILL, logs(crash)[-3000:]
    assert committed_steps(crash) == [3]
    run(2, tiny_cfg, shards, crash, *args)
    assert "resumed from" in logs(crash)
    assert losses(crash) == got  # bit for bit after the resume
    assert_no_corrupt_checkpoint(crash)


def test_pipeline_stages_compile_and_equal_one_process(tiny_cfg, shards, tmp_path):
    """train.compile under a pipeline: each stage's decoder layers are compiled (aot_eager: dynamo's capture and
    AOT autograd, without generating code, to keep the suite short) and the run equals one process. Dropout off:
    tracing the keyed masks' Philox rounds through dynamo costs 40 s here, and a compiled layer's masks are
    tests/kernels/test_keyed_dropout.py's test; with dropout off the one-process run is the eager reference."""
    args = [*EXACT, "--set", "model.dropout=0", "--set", "model.dropatt=0"]
    single = tmp_path / "single"
    run(1, tiny_cfg, shards, single, *args)
    run_dir = tmp_path / "run"
    run(
        2,
        tiny_cfg,
        shards,
        run_dir,
        "--pp",
        "2",
        *args,
        "--set",
        "train.compile=on",
        "--set",
        "train.compile_backend=aot_eager",
        timeout=300,
    )
    assert "| compiled layers |" in logs(run_dir) and "graphs compiled" in logs(run_dir), logs(run_dir)[-2000:]
    check_equals_single(run_dir, single, "pp2 compiled")
