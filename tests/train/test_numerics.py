"""Runs that survive their own numerics (issue 47; megamemo/train/numerics.py, rollback.py, replay.py):
* fingerprints see any one flipped bit; the verdict over every rank's names the replica at fault: partition p's
  owner under ZeRO 1/2 (its fp32 master made it), the majority under ZeRO 0, both of a pair that cannot tell;
* a replica mismatch is recorded as node-suspect, naming the rank and its host, and retried;
* the supervisor's decision by replay (runtime/suspect.py, MEGAMEMO_REPLAY_SUSPECT=1): a verdict in, a decision
  out; the replay's process read, or killed with its children past its timeout;
* the spike rules; their config errors name the key;
* 2 ranks: a bit flipped in rank 1's weights at a check is caught, named, replayed by the launcher before its
  restart (MEGAMEMO_REPLAY_SUSPECT=1: "resume"), and the job resumes from the checkpoint before it with the losses
  of an uninterrupted run, bit for bit;
* 2 ranks: a bad batch's spike is rolled back past its data, recorded (interruptions.jsonl, goodput), and a second
  run with the same injection has the same losses bit for bit; the undone attempt's records are kept, and the
  spike, replayed as it first happened (`--rolled-back`), is identical with the bad batch and differs without;
* megamemo replay: identical under the run's own layout (its LR schedule resumed past warmup), within its stated
  tolerance for a DP 2 run with keyed dropout replayed in one process, differs at the step whose recorded loss was
  tampered with;
* the replica check's cost on the CPU at the default interval."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import local_launch
from helpers.runs_cache import ONE_PROCESS_EXACT, REPO, TWO_RANKS_12_STEPS, TWO_RANKS_ACCUM, losses, run

from megamemo.config.run import ConfigError
from megamemo.runtime import goodput, interruptions
from megamemo.runtime.interruptions import EXIT_NODE_SUSPECT, Exit
from megamemo.train.numerics import SpikeWatch, fingerprint, verdict

multiproc = pytest.mark.multiproc


# ---- fingerprints and the verdict ----------------------------------------------------------------------------------
def test_a_fingerprint_sees_any_one_flipped_bit_and_nothing_else():
    t = torch.randn(257, 3)
    base = fingerprint([t, torch.arange(5.0)])
    assert base == fingerprint([t.clone(), torch.arange(5.0)])
    for index in (0, 100, 770):
        for bit in (0, 13, 22, 30, 31):
            u = t.clone()
            u.view(-1)[index : index + 1].view(torch.int32).bitwise_xor_(1 << bit if bit < 31 else -(2**31))
            assert fingerprint([u, torch.arange(5.0)]) != base, (index, bit)
    swapped = t.clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprint([swapped.view(257, 3), torch.arange(5.0)]) != base  # where a value sits counts too


def _zero(rank, parts, owns, own_ok=True, scalars=7, group=(0, 0)):
    return {
        "rank": rank,
        "node": f"n{rank}",
        "group": list(group),
        "scalars": scalars,
        "partitions": parts,
        "owns": owns,
        "own_ok": own_ok,
    }


def test_the_verdict_names_the_replica_at_fault():
    assert verdict([_zero(0, [1, 2], 0), _zero(1, [1, 2], 1)]) == ([], "")
    # rank 1's copy of rank 0's partition differs: rank 0 owns it (its master made it), so rank 1 is at fault
    suspects, why = verdict([_zero(0, [1, 2], 0), _zero(1, [9, 2], 1)])
    assert [s["rank"] for s in suspects] == [1] and "partition 0 differ from rank 0's" in why
    # the owner's own copy no longer matches its master: the owner is at fault, the others are the reference
    suspects, _ = verdict([_zero(0, [9, 2], 0, own_ok=False), _zero(1, [1, 2], 1)])
    assert [s["rank"] for s in suspects] == [0]
    # ZeRO 0: the majority of three; a pair that disagrees names both; replicas of other TP ranks apart
    whole = [
        {"rank": r, "node": "n", "group": [r % 2, 0], "scalars": 1, "state": v}
        for r, v in enumerate([5, 6, 5, 6, 5, 6])
    ]
    assert verdict(whole)[0] == []
    whole[4]["state"] = 8
    assert [s["rank"] for s in verdict(whole)[0]] == [4]
    pair = [{"rank": r, "node": "n", "group": [0, 0], "scalars": 1, "state": r} for r in range(2)]
    assert [s["rank"] for s in verdict(pair)[0]] == [0, 1]
    # Adam's step, the LR or the loss scale
    suspects, why = verdict([_zero(0, [1, 2], 0), _zero(1, [1, 2], 1), _zero(2, [1, 2], 2, scalars=8)][:3])
    assert [s["rank"] for s in suspects] == [2] and "LR" in why


def test_a_replica_mismatch_is_recorded_as_node_suspect_and_retried(tmp_path):
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    note = {"suspects": [{"rank": 1, "node": "node7"}], "step": 6, "line": "..."}
    for r in range(2):
        (beats / f"rank{r}.json").write_text(
            json.dumps({"rank": r, "node": f"node{r + 6}", "beat": time.time(), "step": 6, "replicas": note})
        )
    exits = [Exit(0, EXIT_NODE_SUSPECT, 10.0, "node6"), Exit(1, EXIT_NODE_SUSPECT, 10.1, "node7")]
    rec = interruptions.record(tmp_path, exits, started=time.time() - 5)
    assert (rec["kind"], rec["rank"], rec["node"], rec["exit_code"]) == ("node", 1, "node7", EXIT_NODE_SUSPECT)
    assert rec["node_fault"] == "replica mismatch: rank 1 (node7)"
    assert interruptions.decide(rec, [rec, rec], restarts_left=1) == (True, "")  # never "deterministic"


# ---- the supervisor's decision by replay (runtime/suspect.py) --------------------------------------------------------
def test_the_supervisors_decision_by_replay_from_its_verdict(tmp_path):
    from megamemo.runtime import suspect

    same, within = "replay: identical", "replay: within 1.1e-05 relative = 3 steps x 64 tokens x u 6.0e-08"
    differs = "replay: differs at step 6: loss 5.3 replayed, 5.2 recorded (relative difference 1.92e-02)"
    assert [suspect.decide("node", v, 6)[0] for v in (same, within, differs, "timed out after 600 s", "")] == [
        "resume",
        "resume",
        "exclude",
        "default",
        "default",
    ]
    assert [suspect.decide("spike", v, 8)[0] for v in (same, differs)] == ["rollback", "exclude"]
    rec = {"kind": "node", "step": 6}
    assert suspect.enabled(rec, {"MEGAMEMO_REPLAY_SUSPECT": "1"})
    assert not suspect.enabled(rec, {}) and not suspect.enabled(rec, {"MEGAMEMO_REPLAY_SUSPECT": "0"})
    assert not suspect.enabled({"kind": "crash", "step": 6}, {"MEGAMEMO_REPLAY_SUSPECT": "1"})  # a crash: no replay
    # the replay's process: its last verdict line read, a failure's last line of error, a timeout
    fake = tmp_path / "fake"
    for script, expected in (
        (f'echo "[replay] steps 4..6"; echo "{differs}"; exit 1', differs),
        (
            'echo "megamemo replay: error: --step 6: no checkpoint" >&2; exit 2',
            "megamemo replay: error: --step 6: no checkpoint",
        ),
        ("sleep 30 & sleep 30", "timed out after 1 s"),
    ):  # a child of its own too
        fake.write_text(f"#!/bin/bash\n{script}\n")
        fake.chmod(0o755)
        env = {"MEGAMEMO_REPLAY_CMD": str(fake), "MEGAMEMO_REPLAY_TIMEOUT_S": "1", "PATH": os.environ["PATH"]}
        out = suspect.replay(tmp_path, rec, environ=env)
        assert (out["verdict"], out["decision"]) == (expected, suspect.decide("node", expected, 6)[0]), out
        assert out["seconds"] < 15, out  # the timed-out one's children killed with it, not waited for


def test_a_stop_signal_during_the_failures_replay_is_not_lost_to_a_restart(monkeypatch):
    """The launcher records a failure (and replays it, which takes a while) between its workers' end and their
    restart: a stop signal that arrives meanwhile ends the job instead of starting it again (the signal would have
    gone to the dead workers, and the new ones would train on)."""
    from megamemo.runtime.launcher import Launcher

    launcher = Launcher(2, ["true"], log=lambda m: None, max_restarts=3)
    starts = []
    monkeypatch.setattr(launcher, "start", lambda: starts.append(1))
    monkeypatch.setattr(launcher, "wait", lambda: EXIT_NODE_SUSPECT)

    def record():
        launcher.on_signal(signal.SIGTERM, None)  # during the replay
        return True, "", None

    monkeypatch.setattr(launcher, "record", record)
    assert launcher.supervise() == EXIT_NODE_SUSPECT and len(starts) == 1


# ---- spikes ------------------------------------------------------------------------------------------------------
class _Rule:
    def __init__(self, rule, window=4, threshold=None):
        self.rule, self.window, self.threshold = rule, window, threshold

    def limit(self):
        return self.threshold if self.threshold is not None else (6.0 if self.rule == "zscore" else 2.0)


class _Counters:
    spike_window: list = []


def _watch(rule, losses_, **kw):
    c = _Counters()
    c.spike_window = []
    w = SpikeWatch(_Rule(rule, **kw), c)
    for x in losses_:
        w.add(x)
    return w


def test_the_spike_rules():
    flat = [3.0, 3.1, 2.9, 3.0]
    assert _watch("zscore", flat[:3]).judge(100.0) is None  # the window is not full yet
    assert _watch("zscore", flat).judge(3.2) is None
    assert "standard deviations" in _watch("zscore", flat).judge(3.6)  # (3.6 - 3) / 0.0707 = 8.5 > 6
    assert _watch("zscore", flat, threshold=9).judge(3.6) is None
    assert _watch("ratio", flat).judge(5.9) is None and "x the median" in _watch("ratio", flat).judge(6.1)
    assert "not finite" in _watch("ratio", []).judge(float("nan"))
    assert _watch("off", flat).judge(float("nan")) is None
    w = _watch("zscore", [1, 2, 3, 4, 5, 6])
    assert w.window == [3, 4, 5, 6]  # the last `window` losses


@pytest.mark.parametrize(
    "value, key",
    [
        ("{rule: median}", "train.spike.rule"),
        ("{window: 1}", "train.spike.window"),
        ("{rule: ratio, threshold: 0.5}", "train.spike.threshold"),
        ("{action: skip}", "train.spike.action"),
        ("{colour: red}", "train.spike.colour"),
    ],
)
def test_a_bad_spike_setting_is_one_error_naming_its_key(value, key):
    from megamemo.train.config import load

    with pytest.raises(ConfigError, match=f"^{key}: "):
        load(None, ["model.n_layer=2", f"train.spike={value}"])


# ---- with training processes ----------------------------------------------------------------------------------------
@pytest.fixture
def reference(tiny_cfg, shards, reference_runs):
    return losses(reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_12_STEPS))


@multiproc
def test_a_bit_flipped_in_one_replica_is_caught_named_and_the_job_resumes_bit_exact(
    tiny_cfg, shards, reference, tmp_path
):
    run_dir = tmp_path / "run"
    # synchronous saves: the step-3 checkpoint is committed before step 4 (an asynchronous commit can still be under
    # way at the step-6 failure on a loaded machine, and the restart would then start afresh)
    # MEGAMEMO_REPLAY_SUSPECT=1: before the restart the launcher replays steps 4..6 in two other processes (the
    # step-3 checkpoint's layout): the flip came after step 6's last recorded number, so they reproduce -> "resume",
    # written into the failure's record (without it: no replay, test_launch_sbatch_args.py's node-suspect test)
    p = local_launch.start(
        tiny_cfg,
        shards,
        run_dir,
        "--max-steps",
        "12",
        "--set",
        "checkpoint.async_save=false",
        n=2,
        restarts=1,
        env={
            "MEGAMEMO_FAULT_FLIP": "weights:6:1@0",  # the step-6 check, start 1
            "MEGAMEMO_REPLAY_SUSPECT": "1",
        },
    )
    assert local_launch.finish(p, 300) == 0, local_launch.text(run_dir)[-3000:]
    out = local_launch.text(run_dir)
    assert "megamemo train: error: replica check after step 6: rank 1 (" in out, out[-3000:]
    [rec] = interruptions.history(run_dir)
    assert (rec["kind"], rec["rank"], rec["step"], rec["committed"], rec["exit_code"]) == ("node", 1, 6, 3, 5)
    assert (rec["replay"]["verdict"], rec["replay"]["decision"]) == ("replay: identical", "resume"), rec
    assert "--step 6 --dp 2 --tp 1 --pp 1" in out and "[replay] replay: identical -> resume" in out, out[-3000:]
    assert rec["node"] == os.uname().nodename and rec["node_fault"].startswith("replica mismatch: rank 1")
    assert f"resumed from {run_dir}/checkpoints/step_00000003" in out
    assert losses(run_dir) == reference
    saved = json.loads((run_dir / "checkpoints/step_00000012/rank_00001.json").read_text())["replicas"]
    assert saved["agreed"] and saved["ranks"]["0"]["partitions"] == saved["ranks"]["1"]["partitions"]
    # its cost: under 1% of the steps' time at configs/tiny-cpu.yaml's interval (a checkpoint every 100 steps)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mean = sum(r["seconds"] for r in steps if r["kind"] == "train") / 12
    assert saved["seconds"] < 0.01 * 100 * mean, (saved["seconds"], mean)


SPIKE = (
    "--max-steps",
    "12",
    "--set",
    "checkpoint.probe=false",
    "--set",
    "train.spike={rule: zscore, window: 4, threshold: 3, skip_batches: 2, max_rollbacks: 1}",
)


@multiproc
def test_a_spike_is_rolled_back_past_its_data_recorded_and_replays_bit_for_bit(tiny_cfg, shards, reference, tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        run(2, tiny_cfg, shards, run_dir, *SPIKE, env_extra={"MEGAMEMO_FAULT_BAD_BATCH": "8"})
    first = losses(runs[0])
    assert first == losses(runs[1])  # the same injection: the same losses
    assert list(first) == list(range(1, 13))
    assert {s: first[s] for s in range(1, 8)} == {s: reference[s] for s in range(1, 8)}  # 7 done again alike
    [rec] = interruptions.history(runs[0])
    assert (rec["kind"], rec["step"], rec["rollback_to"]) == ("spike", 8, 6) and rec["loss"] > 5.6
    assert rec["skipped"] == [{"step": 8, "batches": 2, "from": {"epoch": 0, "step": 7}}]
    assert first[8] < 5.4 and first[8] not in (rec["loss"], reference[8])  # batch 10 now, not batch 8 or 9
    g = goodput.of_run(runs[0])
    assert g["interruptions"] == 1 and g["lost_s"] == pytest.approx(rec["seconds_lost"]) and g["steps"] == 12
    # the undone attempt's steps 7 and 8 (the spike) kept beside metrics.jsonl, and replayed as they first happened
    kept = [json.loads(x) for x in (runs[0] / "metrics.rolled_back.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["rolled_back"]) for r in kept] == [
        ("train", s, {"spike": 8, "to": 6}) for s in (7, 8)
    ]
    assert kept[0]["loss"] == first[7] and kept[1]["loss"] == rec["loss"]
    bad = {"MEGAMEMO_FAULT_BAD_BATCH": "8"}
    assert replay(runs[0], 8, "--dp", "2", "--rolled-back", env=bad) == (0, "replay: identical")  # the data's fault
    rc, line = replay(runs[0], 8, "--dp", "2", "--rolled-back")  # other data (no bad batch): not the spike
    assert rc == 1 and line.startswith("replay: differs at step 8: loss "), line
    assert replay(runs[0], 8, "--dp", "2", env=bad) == (0, "replay: identical")  # the attempt that stood: skipped


def replay(run_dir, step, *args, env=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "megamemo", "replay", "--ckpt", str(run_dir), "--step", str(step), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    return p.returncode, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr


@multiproc
def test_replay_is_identical_under_the_runs_layout_and_finds_a_tampered_step(
    tiny_cfg, shards, reference_runs, tmp_path
):
    one = reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT)
    assert replay(one, 6) == (0, "replay: identical")
    tampered = tmp_path / "run"
    shutil.copytree(one, tampered)
    lines = (tampered / "metrics.jsonl").read_text().splitlines()
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("kind") == "train" and rec["step"] == 5:
            lines[i] = json.dumps({**rec, "grad_norm": rec["grad_norm"] * (1 + 2**-20)})
    (tampered / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc, line = replay(tampered, 6)
    assert rc == 1 and line.startswith("replay: differs at step 5: grad_norm "), line


@multiproc
def test_replay_past_warmup_follows_the_runs_lr_schedule(tiny_cfg, shards, reference_runs):
    """Steps 7..8 of the 12-step 2-rank run (warmup 2, cosine over its 12 steps) replayed under its layout from the
    step-6 checkpoint: the replay trains to step 8 only, yet its steps must take the run's LRs - the cosine resumed at
    step 6 of a 12-step schedule, not one over the replay's 8 steps (step 8's update at 0.07 x lr, not 0.5 x; a
    step's loss comes before its update, so the replay compares each step's LR too) nor one started again from step
    0 (a warmup's 0.5 x lr at step 7)."""
    from megamemo.train.engine import lr_factor

    assert lr_factor(7, 2, 12, "cosine", 0.0) == pytest.approx(0.5) and lr_factor(7, 2, 8, "cosine", 0.0) < 0.07
    two = reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_12_STEPS)
    assert replay(two, 8, "--dp", "2") == (0, "replay: identical")


@multiproc
def test_replay_of_a_dp2_keyed_dropout_run_in_one_process_is_within_its_tolerance(tiny_cfg, shards, reference_runs):
    dp2 = reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_ACCUM)
    rc, line = replay(dp2, 6)
    assert rc == 0 and line.startswith("replay: within 1.1e-05 relative = 3 steps x 64 tokens x u 6.0e-08 "), line
