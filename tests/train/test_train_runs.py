"""`megamemo train` end to end, with real processes on the enwik8 prefix (fp32/bf16 on CPU, gloo):
DP=2 equals DP=1 with the same global batch; kill -9 of one rank then restart equals an uninterrupted run bit
for bit; SIGUSR1 saves a complete checkpoint and exits 0; errors name the bad field / directory / checkpoint.

Ranks are started directly (RANK/WORLD_SIZE/MASTER_* in the environment, as torchrun would set them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.bounds import drift_bound, forward_bound, weight_drift
from helpers.fixture_data import ENWIK8
from helpers.runs_cache import (  # noqa: F401
    ONE_PROCESS_EXACT,
    REPO,
    TINY,
    TWO_RANKS_12_STEPS,
    TWO_RANKS_ACCUM,
    launch,
    logs,
    losses,
    run,
    wait,
)

from megamemo.checkpoint.store import MARKER, list_checkpoints, newest_complete, verify
from megamemo.runtime.dist import free_port

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

# `shards` (the enwik8 fixture's shards), `tiny_cfg` (TINY) and `reference_runs` are session fixtures
# (tests/conftest.py): prepared and trained once, shared by every module that uses them.


def committed_steps(run_dir: Path) -> list[int]:
    return [s for s, _, c in list_checkpoints(run_dir / "checkpoints") if c]


def assert_no_corrupt_checkpoint(run_dir: Path) -> list[int]:
    """Every committed checkpoint has all its files at their recorded sizes and sha256, and its marker names its own
    step; -> the steps checked."""
    checked = []
    for step, path, committed in list_checkpoints(run_dir / "checkpoints"):
        if committed:
            info = verify(path)
            assert info["step"] == step and info["files"], (path, info)
            checked.append(step)
    return checked


def checkpoint_memory(step_dir: Path):
    """The memory of every global stream [M, B, ...] in a committed checkpoint (its ranks' pieces joined)."""
    from megamemo.interop.load import Checkpoint

    return Checkpoint(step_dir).memory()


def checkpoint_model(step_dir: Path):
    """The single-device model holding a committed checkpoint's weights."""
    from megamemo.interop.load import load_model

    return load_model(step_dir)[0]


# ---- DP=2 == DP=1 --------------------------------------------------------------------------------------------
def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def direct_eval(tiny_cfg: Path, shards: Path, step_dir: Path, tgt_len: int, mem_len: int, batch: int, segments: int):
    """Validation NLL of a checkpoint's weights computed here with the plain model and reader."""
    from megamemo.data import StreamReader

    model = checkpoint_model(step_dir)
    total, count, mem = 0.0, 0, None
    with torch.no_grad():
        for i, (inp, tgt) in enumerate(StreamReader(shards, "valid", batch, tgt_len, epochs=1)):
            if i == segments:
                break
            nll, mem = model(inp, tgt, mem, mem_len=mem_len)
            total += nll.double().sum().item()
            count += nll.numel()
    return total / count


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_dp2_with_accumulation_equals_one_process(tiny_cfg, shards, reference_runs):
    # validation at the end with its own lengths: 8-token segments, 24 tokens of memory (ONE_PROCESS_EXACT)
    # 2 ranks x 2 micro-batches of 1 stream each: 4 separate memories, same global batch of 4 streams (the session's
    # run, which test_train_equivalence.py compares ZeRO 2's overlapped reduction with)
    one = reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT)
    two = reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_ACCUM)
    l1, l2 = losses(one), losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, 7))
    # the layouts' fp32 gradient sums run in other orders, so the weights drift apart by rounding: rho, the largest
    # relative drift of a weight at step 6 (tests/helpers/bounds.py), grows with the steps, so it bounds each step's;
    # what
    # the weights compute moves by drift_bound ((n_layer + 1) rho |value| plus two orders of the forward pass)
    w1 = checkpoint_model(one / "checkpoints" / "step_00000006")
    rho = weight_drift(w1.state_dict(), checkpoint_model(two / "checkpoints" / "step_00000006").state_dict())
    assert rho < 1e-3, rho  # rounding, not a run gone elsewhere
    for s in l1:
        assert abs(l2[s] - l1[s]) <= drift_bound(w1.cfg, rho, l1[s]), (s, l1[s], l2[s], rho)
    assert l1[6] < l1[1]
    # the memory after the last step, from the 2 x 2 micro-batches' pieces, is the one-process memory
    m1 = checkpoint_memory(one / "checkpoints" / "step_00000006")
    m2 = checkpoint_memory(two / "checkpoints" / "step_00000006")
    assert m1.batch_size == m2.batch_size == 4 and sorted(m1.tensors) == sorted(m2.tensors)
    for name, full in m1.tensors.items():
        torch.testing.assert_close(m2[name], full, rtol=0, atol=drift_bound(w1.cfg, rho, float(full.abs().max())))
    # the weights both DP ranks hold are written by one of them each, spread over both (pieces.spread_writers)
    index = json.loads((two / "checkpoints" / "step_00000006" / "index.json").read_text())["files"]
    weights = [{d["name"] for d in pieces.values() if d["name"].startswith("model/")} for pieces in index.values()]
    assert len(weights) == 2 and all(weights) and not weights[0] & weights[1], weights
    # periodic validation: the logged loss is the plain model's NLL on the first 6 segments of the valid split
    (e1,), (e2,) = eval_records(one), eval_records(two)
    assert (e1["step"], e1["tgt_len"], e1["mem_len"], e1["tokens"]) == (6, 8, 24, 6 * 8 * 4)
    want = direct_eval(tiny_cfg, shards, one / "checkpoints" / "step_00000006", 8, 24, 4, 6)
    # the same weights: two orders of the forward pass over 8 + 24 keys, per token relative to its (positive) NLL
    # and so to the mean; the two-rank run's weights drifted by rho besides
    assert e1["loss"] == pytest.approx(want, rel=forward_bound(w1.cfg, 1.0, klen=32), abs=0)
    assert e2["loss"] == pytest.approx(want, rel=drift_bound(w1.cfg, rho, 1.0), abs=0) and e2["tokens"] == e1["tokens"]


# ---- crash and exact resume ------------------------------------------------------------------------------------
@pytest.fixture
def fp32_reference(tiny_cfg, shards, reference_runs) -> Path:
    """2 ranks of TINY, 12 steps (checkpoints at 3, 6, 9, 12): the session's run, shared with test_reliability.py."""
    return reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_12_STEPS)


def test_rank_killed_while_saving_resumes_bit_exact(tiny_cfg, shards, fp32_reference, tmp_path):
    run_dir = tmp_path / "crash"
    # rank 1 SIGKILLs itself after writing its part of the step-6 checkpoint, before the commit
    rcs = wait(
        launch(2, tiny_cfg, shards, run_dir, *TWO_RANKS_12_STEPS, env_extra={"MEGAMEMO_FAULT_KILL_IN_SAVE": "6:1"})
    )
    assert rcs[1] == -signal.SIGKILL and rcs[0] != 0, logs(run_dir)[-3000:]
    assert committed_steps(run_dir) == [3]
    assert (run_dir / "checkpoints" / "step_00000006").is_dir()  # half-written, never committed
    assert not (run_dir / "checkpoints" / "step_00000006" / MARKER).exists()
    assert newest_complete(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_00000003"

    run(2, tiny_cfg, shards, run_dir, *TWO_RANKS_12_STEPS)  # the same command again
    assert "resumed from" in logs(run_dir) and "step_00000003" in logs(run_dir)
    assert "removed " + str(run_dir / "checkpoints" / "step_00000006") in logs(run_dir)
    ref, got = losses(fp32_reference), losses(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    assert got == ref  # bit for bit, steps 4..12 included
    assert committed_steps(run_dir) == [3, 6, 9, 12]
    assert_no_corrupt_checkpoint(run_dir)


def test_kill9_mid_run_bf16_resumes_bit_exact(tiny_cfg, shards, tmp_path):
    args = ["--set", "precision.dtype=bf16", "--set", "parallel.zero_stage=2", "--max-steps", "30", "--save-every", "2"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "crash"
    run(2, tiny_cfg, shards, ref_dir, *args)

    procs = launch(2, tiny_cfg, shards, run_dir, *args)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and any(
            json.loads(ln).get("step", 0) >= 7 for ln in metrics.read_text().splitlines() if ln.endswith("}")
        ):
            break
        assert procs[0].poll() is None, logs(run_dir)[-3000:]
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)  # kill -9 one rank, mid-run
    rcs = wait(procs, 120)
    assert rcs[1] == -signal.SIGKILL and rcs[0] != 0
    assert_no_corrupt_checkpoint(run_dir)
    resume_step = committed_steps(run_dir)[-1]
    assert 2 <= resume_step < 30

    run(2, tiny_cfg, shards, run_dir, *args)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resume_step:08d}'}" in logs(run_dir)
    ref, got = losses(ref_dir), losses(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 31))
    assert got == ref  # bit for bit
    assert_no_corrupt_checkpoint(run_dir)


# ---- SIGUSR1 ---------------------------------------------------------------------------------------------------
def test_sigusr1_saves_a_complete_checkpoint_and_exits_cleanly(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "sig"
    procs = launch(
        2, tiny_cfg, shards, run_dir, "--max-steps", "100000", "--save-every", "0", "--set", "log.tensorboard=true"
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
        assert time.time() < deadline and procs[0].poll() is None, logs(run_dir)[-3000:]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGUSR1)  # one rank only: the ranks agree through the step's all-reduce
    assert wait(procs, 120) == [0, 0], logs(run_dir)[-3000:]
    last = max(losses(run_dir))
    assert committed_steps(run_dir) == [last]
    assert verify(run_dir / "checkpoints" / f"step_{last:08d}")["step"] == last  # every file as recorded
    assert f"stopped at step {last}" in logs(run_dir)
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "config.yaml").read_text().count("max_steps: 100000") == 1


# ---- errors ----------------------------------------------------------------------------------------------------
def test_bad_config_field_and_missing_data_are_named(tiny_cfg, shards, tmp_path, capsys):
    from megamemo.commands.train import main

    assert main(["--config", str(tiny_cfg), "--data", str(shards), "--set", "optim.lrate=1"]) == 2
    assert "optim.lrate: unknown field" in capsys.readouterr().err
    assert main(["--config", str(tiny_cfg), "--data", str(shards), "--set", "train.max_steps=ten"]) == 2
    assert "train.max_steps: expected int" in capsys.readouterr().err
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():  # this CPU: fp16 refused up front, by name
        assert main(["--config", str(tiny_cfg), "--data", str(shards), "--set", "precision.dtype=fp16"]) == 2
        assert "precision.dtype: fp16 is not supported" in capsys.readouterr().err
    missing = tmp_path / "no-such-shards"
    assert main(["--config", str(tiny_cfg), "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "data.dir" in err and str(missing) in err


def test_checkpoint_from_a_different_model_is_refused(tiny_cfg, shards, fp32_reference, tmp_path):
    import shutil

    run_dir = tmp_path / "other"
    shutil.copytree(fp32_reference, run_dir)
    procs = launch(
        2, tiny_cfg, shards, run_dir, "--set", "model.d_inner=48", "--max-steps", "12", fresh=True
    )  # an error's way out includes the interpreter's shutdown
    assert wait(procs) == [2, 2]
    out = logs(run_dir)
    assert out.count("megamemo train: error:") == 1 and "terminate called" not in out, out[-3000:]
    assert "different model config" in out and "model.d_inner: checkpoint 64 vs config 48" in out
    assert "step_00000012" in out


# ---- fp16 overflow ---------------------------------------------------------------------------------------------
FP16_SCRIPT = r"""
import json, sys
from deepspeed.accelerator import get_accelerator
type(get_accelerator()).is_fp16_supported = lambda self: True     # this CPU has no fp16 support in DeepSpeed's eyes
import torch
from megamemo.train.config import load
from megamemo.train.build import build

cfg_path, shards, run_dir = sys.argv[1:4]
cfg = load(cfg_path, [f"data.dir={shards}", f"train.run_dir={run_dir}", "precision.dtype=fp16",
                      "precision.hysteresis=1", "precision.initial_scale_power=10", "model.dropout=0.0",
                      "train.max_steps=6", "checkpoint.save_every=0", "checkpoint.save_at_end=false"])
trainer, _ = build(cfg)
attempt = {"n": 0}
def poison(grad):                      # the 3rd backward pass gets an inf gradient
    return grad * float("inf") if attempt["n"] == 3 else grad
next(trainer.engine.module.parameters()).register_hook(poison)
snap = lambda: {f"{k}/{n}": t.clone() for k, m in enumerate(trainer.memory.mems) for n, t in m.tensors.items()}
rows = []
while trainer.step < cfg.train.max_steps:
    attempt["n"] += 1
    before, cursor = snap(), dict(trainer.cursor.state)
    r = trainer.train_step()
    after = snap()
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    rows.append({"applied": r.applied, "loss": r.loss, "step": trainer.step, "scale": trainer.engine.loss_scale(),
                 "memory_unchanged": same, "cursor_unchanged": cursor == trainer.cursor.state,
                 "skipped": trainer.engine.skipped_steps, "device": str(trainer.engine.device)})
trainer.metrics.close()
print("ROWS" + json.dumps(rows))
"""


def fp16_overflow_run(tiny_cfg, shards, run_dir, **env_extra) -> list[dict]:
    """FP16_SCRIPT in one process: a poisoned 3rd backward must skip its step and advance nothing (checked here);
    returns the per-attempt rows."""
    script = run_dir.parent / "fp16.py"
    script.write_text(FP16_SCRIPT)
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_cfg), str(shards), str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads(out.stdout.split("ROWS", 1)[1])
    assert [r["applied"] for r in rows] == [True, True, False, True, True, True, True]
    bad, retry = rows[2], rows[3]
    assert bad["scale"] == rows[1]["scale"] / 2 and bad["skipped"] == 1 and bad["step"] == 2
    assert bad["memory_unchanged"] and bad["cursor_unchanged"]  # nothing advanced on the skipped step
    assert not rows[1]["memory_unchanged"] and not rows[1]["cursor_unchanged"]
    assert retry["loss"] == bad["loss"]  # the retry saw the same batch with the same memory
    assert retry["step"] == 3 and rows[-1]["step"] == 6
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in recs if r["kind"] == "skip"]
    assert len(skips) == 1 and skips[0]["step"] == 3 and skips[0]["loss_scale"] == bad["scale"]
    assert "overflow: step skipped" in out.stdout
    return rows


def test_fp16_overflow_skips_the_step_and_keeps_memory(tiny_cfg, shards, tmp_path):
    rows = fp16_overflow_run(tiny_cfg, shards, tmp_path / "fp16")
    assert rows[0]["device"] == "cpu"


# ---- epoch boundary --------------------------------------------------------------------------------------------
def test_new_epoch_starts_from_empty_memory(tiny_cfg, tmp_path):
    """A 360-token train split: 6 steps per epoch (the last one 9 rows). Step 7 is epoch 1's first batch (rolled
    elsewhere): it must be scored with empty memory, as the reference's per-epoch train() does."""
    from megamemo.data import StreamReader
    from megamemo.data.cli import prepare_main
    from megamemo.train.config import load

    raw = tmp_path / "small.txt"
    raw.write_bytes(ENWIK8.read_bytes()[:400])
    small = tmp_path / "small"
    assert prepare_main(["text", "--raw", str(raw), "--out", str(small), "--quiet"]) == 0
    run_dir = tmp_path / "epochs"
    run(1, tiny_cfg, small, run_dir, "--set", "model.dropout=0.0", "--max-steps", "8", "--save-every", "6")
    got = losses(run_dir)

    cfg = load(tiny_cfg)
    reader = StreamReader(small, "train", 4, 16, roll=True, seed=cfg.data.seed, epochs=None)
    assert reader.steps_per_epoch == 6
    step6 = run_dir / "checkpoints" / "step_00000006"
    model = checkpoint_model(step6)
    inp, tgt = reader.get_batch(1, 0)
    with torch.no_grad():
        fresh = model(inp, tgt, None)[0].double().mean().item()
        mem = checkpoint_memory(step6)
        assert mem.length == 16
        stale = model(inp, tgt, mem)[0].double().mean().item()
    # the same weights, one process: two orders of the forward pass's sums, per token relative to its (positive)
    # NLL and so to the mean (tests/helpers/bounds.py); the stale memory moves it beyond that
    rel = forward_bound(model.cfg, 1.0)
    assert got[7] == pytest.approx(fresh, rel=rel, abs=0) and abs(stale - fresh) > rel * fresh
