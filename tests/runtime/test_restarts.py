"""Automatic restarts with real processes under launch/local.sh --max-restarts (megamemo/runtime/launcher.py):
  * a rank killed with -9 mid-step: the job starts again by itself, resumes from the newest committed checkpoint and
    ends with the losses of an uninterrupted run, bit for bit, one interruption recorded and the goodput reported;
  * a rank stopped with SIGSTOP: the other rank's watchdog (train.hang_timeout_s) writes its stacks, names the
    stopped rank, the step and the frame it waits in, exits 3 within the timeout; the job restarts and finishes;
  * a config error (exit 2) is not retried;
  * a crash at the same step three times in a row stops the job with one line.
The Slurm side (requeue, node exclusion) is in test_launch_train.py (a real two-node cluster) and
test_launch_sbatch_args.py (recorders)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import local_launch
from helpers.local_launch import text, wait_for_step
from helpers.runs_cache import TWO_RANKS_12_STEPS, losses

from megamemo.runtime.interruptions import history

pytestmark = pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)


def start(cfg, shards, run_dir, *args, n=2, restarts=2, env=None) -> subprocess.Popen:
    return local_launch.start(cfg, shards, run_dir, *args, n=n, restarts=restarts, env=env)


def finish(p, timeout=300) -> int:
    return local_launch.finish(p, timeout)


def worker(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the launcher's worker of that rank (RANK in its environment)."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker of rank {rank}")


@pytest.fixture
def reference(tiny_cfg, shards, reference_runs):
    """Losses of the uninterrupted run (2 ranks, 12 steps, checkpoints every 3): the session's shared reference."""
    return losses(reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_12_STEPS))


def test_a_rank_killed_mid_step_restarts_the_job_bit_exact(tiny_cfg, shards, reference, tmp_path):
    run_dir = tmp_path / "run"
    p = start(tiny_cfg, shards, run_dir, "--max-steps", "12")
    wait_for_step(run_dir, 4, p, committed=3)  # past the step-3 checkpoint, committed
    os.kill(worker(p, 1), signal.SIGKILL)
    assert finish(p) == 0, text(run_dir)[-3000:]
    out = text(run_dir)
    assert losses(run_dir) == reference  # every step once, bit for bit
    [rec] = history(run_dir)
    assert (rec["kind"], rec["rank"], rec["signal"], rec["exit_code"], rec["launcher"]) == (
        "crash",
        1,
        "SIGKILL",
        None,
        "local",
    )
    assert rec["committed"] in (3, 6, 9) and rec["committed"] <= rec["step"] < 12 and rec["node"] == os.uname().nodename
    assert 0 < rec["seconds_lost"] < 60 and rec["started"] < rec["time"]
    restarts = [line for line in out.splitlines() if line.startswith("[launch] restart")]
    assert restarts == [
        f"[launch] restart 1/2: crash of rank 1 on {rec['node']} (signal SIGKILL) after step "
        f"{rec['step']} (last committed: {rec['committed']}; {rec['seconds_lost']:.1f} s lost); "
        f"starting the 2 worker(s) again from the newest committed checkpoint"
    ], out[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_{rec['committed']:08d}" in out
    [good] = re.findall(
        r"^\[train\] goodput (\d+\.\d)%: ([\d.]+) s of training steps in ([\d.]+) s since the "
        r"first start \(2 starts, .*; 1 interruption, ",
        out,
        flags=re.M,
    )
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(r["seconds"] for r in steps if r["kind"] == "train")
    # printed with 1 decimal (half a unit, 0.05 s); 0.06 leaves room for the metrics' own rounded step times
    assert 0 < float(good[0]) < 100 and float(good[1]) == pytest.approx(seconds, abs=0.06), (good, seconds)


def test_a_stopped_rank_is_named_by_the_watchdog_and_the_job_finishes(tiny_cfg, shards, reference, tmp_path):
    run_dir = tmp_path / "run"
    timeout = 8
    p = start(
        tiny_cfg,
        shards,
        run_dir,
        "--max-steps",
        "12",
        "--set",
        f"train.hang_timeout_s={timeout}",
        "--set",
        "parallel.collective_timeout_s=120",
    )
    wait_for_step(run_dir, 4, p)
    stopped = worker(p, 1)
    t_stop = time.time()
    os.kill(stopped, signal.SIGSTOP)  # hung: alive, every thread still
    assert finish(p) == 0, text(run_dir)[-3000:]
    out = text(run_dir)
    [rec] = history(run_dir)
    assert (rec["kind"], rec["rank"]) == ("hang", 1), rec
    # the watchdog of rank 0 fired within the timeout (plus its check interval and the launcher's reaction)
    assert timeout - 1 <= rec["time"] - t_stop < timeout + 6, (rec, t_stop)
    [line] = [x for x in out.splitlines() if x.startswith("[watchdog] rank 0 ")]
    assert re.search(
        rf"hung: no step for \d+ s \(train.hang_timeout_s={timeout}\) after step {rec['step']}; stuck "
        rf"in \w+ \(.*\), called from \w+ \(megamemo/.*\); rank 1 \(.*, pid {stopped}\) not heard from "
        rf"for \d+ s .*; exiting with code 3$",
        line,
    ), line
    stacks = out[out.index("[watchdog] rank 0: every thread's stack") : out.index(line)]
    # every thread's stack, the main thread's in megamemo's loop (where it waits depends on the moment: the step's
    # collectives, or a save's; under load both were seen)
    assert "(most recent call first)" in stacks and re.search(r"megamemo/train/(loop|engine)\.py", stacks), stacks
    assert "[launch] restart 1/2: hang of rank 1 on" in out and losses(run_dir) == reference


def test_a_config_error_is_not_retried(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "run"
    assert finish(start(tiny_cfg, shards, run_dir, "--set", "optim.lr=-1")) == 2
    out = text(run_dir)
    assert out.count("megamemo train: error: optim.lr: must be > 0") == 1, out
    assert "[launch] restart" not in out and not run_dir.exists(), out
    assert (
        out.count(
            "[launch] not restarting: exit code 2 (bad usage, config, data or checkpoint): starting again cannot help"
        )
        == 1
    ), out


def test_a_crash_at_the_same_step_three_times_stops_with_one_line(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "run"
    p = start(
        tiny_cfg,
        shards,
        run_dir,
        "--max-steps",
        "8",
        "--save-every",
        "2",
        "--set",
        "checkpoint.async_save=false",  # step 2 is committed before step 3 begins
        n=1,
        restarts=5,
        env={"MEGAMEMO_FAULT_CRASH_AT": "3:0"},
    )
    assert finish(p) == 1
    out = text(run_dir)
    recs = history(run_dir)
    assert [(r["kind"], r["step"], r["committed"], r["exit_code"]) for r in recs] == [("crash", 2, 2, 1)] * 3, recs
    assert len([x for x in out.splitlines() if x.startswith("[launch] restart")]) == 2, out[-3000:]
    stops = [x for x in out.splitlines() if x.startswith("[launch] not restarting")]
    assert stops == [
        "[launch] not restarting: failed 3 times in a row after step 2: a deterministic failure (a bad "
        "batch, a NaN that skipping does not cure), not a fault of the machines (crash of rank 0 on "
        f"{recs[-1]['node']} (exit code 1) after step 2 (last committed: 2; "
        f"{recs[-1]['seconds_lost']:.1f} s lost))"
    ], out[-3000:]
