"""`megamemo train` runs that must compute the same thing: data parallelism under every ZeRO stage against one
process, and bf16 against fp32. Real processes on the enwik8 prefix (the helpers and fixtures of
tests/train/test_train_runs.py); short runs, checkpointed only for the step-6 weights' drift."""

from __future__ import annotations

import pytest
from helpers.bounds import drift_bound, weight_drift
from helpers.runs_cache import KEYED, TWO_RANKS_ACCUM, logs
from test_train_runs import ONE_PROCESS_EXACT, checkpoint_model, eval_records, losses, run

from megamemo.checkpoint.store import newest_complete

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

STEPS = 6
# fp32, keyed dropout 0.1 / dropatt 0.1 (runs_cache.KEYED), no checkpoint written (probe and end-of-run save off);
# 4 streams of 16 tokens
EXACT = [
    *KEYED,
    "--max-steps",
    str(STEPS),
    "--save-every",
    "0",
    "--set",
    "checkpoint.probe=false",
    "--set",
    "checkpoint.save_at_end=false",
]


def drift_at_step6(run_a, run_b):
    """(rho: the largest relative weight difference of the two runs' step-6 checkpoints, the model's config);
    rho < 1e-3: rounding, not a run gone elsewhere."""
    a = checkpoint_model(newest_complete(run_a / "checkpoints"))
    rho = weight_drift(a.state_dict(), checkpoint_model(newest_complete(run_b / "checkpoints")).state_dict())
    assert rho < 1e-3, rho
    return rho, a.cfg


@pytest.fixture
def one_process(tiny_cfg, shards, reference_runs) -> dict[int, float]:
    """The DP=1 fp32 run every comparison here is made against (ZeRO-1 on one rank partitions nothing): the
    session's one-process reference (helpers/runs_cache.py ONE_PROCESS_EXACT: these settings, plus the checkpoints and
    the validation at step 6 that other modules need, which change no training loss)."""
    got = losses(reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT))
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_zero2_overlapping_the_reduction_equals_zero1(tiny_cfg, shards, reference_runs, tmp_path):
    """Two ranks x 2 micro-batches of 1 stream, fp32, keyed dropout: ZeRO 2 reducing every micro-batch's gradients
    during its backward pass (parallel.overlap_comm) in buckets of 4,096 elements - the model's 27,424 parameters in
    several buckets, its 8,192-element embedding larger than one - against the session's ZeRO 1 run of the same
    layout (helpers/runs_cache.py TWO_RANKS_ACCUM), which reduces once a step after the last backward in one bucket:
    the per-step losses within what the weights' drift explains (fp32: only the order of the gradient sums
    differs), and the validation loss of the step-6 weights too. The start-up lines say what DeepSpeed's optimizer was
    built with (read from
    it: Engine.reduction), so the comparison is between the two reductions, not two of the same."""
    ref = reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_ACCUM)
    run_dir = tmp_path / "zero2-overlap"
    run(
        2,
        tiny_cfg,
        shards,
        run_dir,
        *TWO_RANKS_ACCUM,
        "--set",
        "parallel.zero_stage=2",
        "--set",
        "parallel.overlap_comm=true",
        "--set",
        "parallel.reduce_bucket_size=4096",
    )
    assert "ZeRO 1 (after the backward, buckets of 500,000,000) |" in logs(ref)
    assert "ZeRO 2 (overlapped with the backward, buckets of 4,096) |" in logs(run_dir)
    want, got = losses(ref), losses(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    # the weights drift apart by rounding: rho at step 6 (tests/helpers/bounds.py; it grows with the steps, so it bounds
    # each step's) moves what they compute by at most drift_bound, a validation loss too (per token relative, so
    # relative to the mean)
    rho, cfg = drift_at_step6(ref, run_dir)
    for step in want:
        assert abs(got[step] - want[step]) <= drift_bound(cfg, rho, want[step]), (step, got[step], want[step], rho)
    assert want[6] < want[1] - 0.05  # it trained: a comparison of moving numbers
    (e_ref,), (e_got,) = eval_records(ref), eval_records(run_dir)
    assert e_got["step"] == e_ref["step"] == 6
    assert abs(e_got["loss"] - e_ref["loss"]) <= drift_bound(cfg, rho, e_ref["loss"]), (e_got, e_ref, rho)


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_dp2_equals_one_process_under_every_zero_stage(zero, one_process, tiny_cfg, shards, reference_runs, tmp_path):
    """Two ranks of 2 streams each, ZeRO-0 (plain all-reduce), ZeRO-1 (optimizer state split) or ZeRO-2 (gradients
    split too), dropout 0.1 and dropatt 0.1 with keyed masks: the per-step losses are the one-process run's within
    what the weights' drift explains (fp32: only the order of the gradient sums differs; the ranks drop what the
    one process drops)."""
    run_dir = tmp_path / f"zero{zero}"
    run(
        2,
        tiny_cfg,
        shards,
        run_dir,
        *EXACT,
        "--set",
        f"parallel.zero_stage={zero}",
        "--set",
        "checkpoint.save_at_end=true",
    )  # the step-6 weights, for their drift (no loss changes)
    got = losses(run_dir)
    assert sorted(got) == sorted(one_process)
    # the weights drift apart by rounding: rho at step 6 (tests/helpers/bounds.py) bounds each step's loss by
    # drift_bound
    rho, cfg = drift_at_step6(reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT), run_dir)
    for step, want in one_process.items():
        assert abs(got[step] - want) <= drift_bound(cfg, rho, want), (zero, step, got[step], want, rho)
    assert one_process[STEPS] < one_process[1] - 0.05  # it trained: a comparison of moving numbers


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_bf16_run_tracks_the_fp32_run(one_process, tiny_cfg, shards, tmp_path):
    """One process, bf16 (DeepSpeed's: bf16 weights and activations, fp32 master weights and Adam state) against
    the fp32 run, per step: within 0.005 nats. Both drop the same elements (keyed masks do not depend on the dtype).

    The bound, derived. bf16 keeps 8 significant bits (U = 2^-8). A step's loss is the mean NLL of 64 tokens,
    NLL = logsumexp(logits) - logit_target with the log-softmax in fp32, so a relative error d on the logits moves
    a token's NLL by at most 2 d max|logit|, with d <= 4 U (tests/model/test_model_numerics.py: the logits' own rounding
    and the last layer's, post-LN keeping earlier errors from compounding). At this model's init (0.02, d_model
    32) a logit is h.w with |h| ~ sqrt(32) after the layer norm (times sqrt(1/0.9) after the final dropout: a tenth
    zeroed, the rest scaled by 1/0.9) and w ~ N(0, 0.02^2) per entry: ~N(0, 0.116^2), so max|logit| <= 0.52 over the
    64 x 256 logits (4.5 sigma) and a token moves by at most 8 U x 0.52 = 0.017. Those are independent roundings,
    each within +-0.017 (a spread of at most 0.017 / sqrt(3)), so the mean of 64 has a spread of at most 0.0012: 4
    of those is 0.005. The weights the runs reach differ by less than that matters
    over 6 steps: Adam's updates are normalised (lr m / sqrt(v)), so a gradient's relative bf16 error of a few U
    moves an update by a few U of lr = 2e-3 (< 1e-4 per weight in all). The fp32 losses fall by 0.17 over the run,
    far more than the bound: the runs must agree more closely than training moves them."""
    run_dir = tmp_path / "bf16"
    run(1, tiny_cfg, shards, run_dir, *EXACT, "--set", "precision.dtype=bf16")
    got = losses(run_dir)
    assert sorted(got) == sorted(one_process)
    diffs = {s: abs(got[s] - one_process[s]) for s in one_process}
    assert max(diffs.values()) <= 0.005, (diffs, got, one_process)
    assert one_process[1] - one_process[STEPS] > 0.1
    assert any(d > 0 for d in diffs.values())  # bf16 did round: not two fp32 runs compared
