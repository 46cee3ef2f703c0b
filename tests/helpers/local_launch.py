"""Jobs under launch/local.sh started from tests (test_reliability.py, test_restarts.py): the launcher in a session of
its own (its pid is its process group), its output and its workers' in <run_dir>.log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from megamemo.checkpoint.store import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
FAST = ["--set", "checkpoint.probe=false", "--set", "log.tensorboard=false"]


def start(cfg, shards, run_dir, *args, n=2, restarts: int | None = None, env=None) -> subprocess.Popen:
    """launch/local.sh [--max-restarts R] n ...; `started` on the answer is when (wait_for_step counts only the steps
    this start logs)."""
    log = open(f"{run_dir}.log", "a")
    e = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **(env or {}))
    again = [] if restarts is None else ["--max-restarts", str(restarts)]
    p = subprocess.Popen(
        [
            "bash",
            str(REPO / "launch/local.sh"),
            *again,
            str(n),
            "--config",
            str(cfg),
            "--data",
            str(shards),
            "--run-dir",
            str(run_dir),
            *FAST,
            *args,
        ],
        env=e,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    p.started = time.time()
    return p


def finish(p, timeout) -> int:
    """The launcher's exit code within `timeout` seconds; past it its whole process group is killed and the test
    fails naming the command that hung."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(
            f"still running after {timeout}s (its process group killed): {' '.join(map(str, p.args))}"
        ) from None


def text(run_dir) -> str:
    return Path(f"{run_dir}.log").read_text() if Path(f"{run_dir}.log").exists() else ""


def wait_for_step(run_dir, step, p, timeout=180, committed: int | None = None) -> None:
    """Until the start `p` has logged step `step` or a later one (what earlier starts logged does not count: a
    restart's kill must land in its own training, not in its start-up) and, given `committed`, that step's
    checkpoint is committed (a save is asynchronous, and on loaded cores its commit can come after the next steps)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    end = time.time() + timeout
    while time.time() < end:
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
            if metrics.exists()
            else []
        )
        if any(r.get("kind") == "train" and r["step"] >= step and r["time"] >= p.started for r in records) and (
            committed is None
            or any(s == committed and c for s, _, c in list_checkpoints(Path(run_dir) / "checkpoints"))
        ):
            return
        assert p.poll() is None, text(run_dir)[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached: {text(run_dir)[-2000:]}")
