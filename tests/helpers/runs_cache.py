"""Training runs started from tests, and the session's cache of reference runs.

`launch` / `wait` / `run` start ranks of `megamemo train` directly (RANK/WORLD_SIZE/MASTER_* in the environment, as
torchrun or srun set them). `ReferenceRuns` (the `reference_runs` session fixture of tests/conftest.py) runs each
reference once per test run (shared by the pytest-xdist workers), keyed by its number of processes, config, data and
arguments, and hands the same run directory to every test that compares against it. A cached run is read-only to the
tests: one that needs to write into it copies it first. Every comparison stays one between two independently produced
runs: the cache only saves training the same reference again."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from helpers import forked
from megamemo.runtime.dist import free_port

REPO = Path(__file__).resolve().parents[2]

TINY = """
model: {variant: lamemo, n_token: 256, n_layer: 2, d_model: 32, n_head: 2, d_head: 16, d_inner: 64,
        dropout: 0.1, dropatt: 0.0, tgt_len: 16, mem_len: 16}
data: {batch_size: 4, roll: true}
optim: {lr: 2.0e-3, clip: 0.25, warmup_steps: 2}
precision: {dtype: fp32}
parallel: {zero_stage: 1}
train: {max_steps: 8}
checkpoint: {save_every: 3, keep_last: 10}
log: {every: 1, tensorboard: false}
"""

# Dropout 0.1 and attention dropout 0.1 with keyed masks (train.dropout_masks: keyed, megamemo/kernels/keyed.py):
# every layout drops what one process drops, so the layouts' equality tests run with dropout on (with stream masks,
# TINY's default, each layout draws its own masks and the runs part ways at the first step)
KEYED = ("--set", "model.dropout=0.1", "--set", "model.dropatt=0.1", "--set", "train.dropout_masks=keyed")
# The shared references (arguments after TINY's; with the session's `tiny_cfg` and `shards`):
# two ranks of TINY as it is (stream dropout), 12 steps, checkpoints at steps 3, 6, 9 and 12
TWO_RANKS_12_STEPS = ("--max-steps", "12", "--set", "log.tensorboard=false")
# one process, keyed dropout, 6 steps (checkpoints at 3 and 6), validation at step 6 at its own lengths: 6
# segments of 8 tokens in 4 columns, 24 tokens of memory
ONE_PROCESS_EXACT = (
    *KEYED,
    "--max-steps",
    "6",
    "--set",
    "log.tensorboard=false",
    "--set",
    "eval.every=6",
    "--set",
    "eval.tgt_len=8",
    "--set",
    "eval.mem_len=24",
    "--set",
    "eval.batch_size=4",
    "--set",
    "eval.max_segments=6",
)
# two ranks of ONE_PROCESS_EXACT's run, each with 2 micro-batches of 1 stream (4 memories, the same global batch),
# ZeRO 1 (TINY's)
TWO_RANKS_ACCUM = (*ONE_PROCESS_EXACT, "--set", "train.grad_accum=2")


def launch(
    n: int, cfg: Path, shards: Path, run_dir: Path, *args: str, env_extra: dict | None = None, fresh: bool = False
):
    """Start n ranks of `megamemo train`; each rank logs to run_dir/../<name>.rank<r>.log. A rank is forked from the
    warm server of helpers/forked.py (its imports done once) unless `fresh` (a new interpreter: the tests of start-up)
    or its environment differs from the server's in what imports read (env_extra of the GPU tests)."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            DS_ACCELERATOR="cpu",
            PYTHONUNBUFFERED="1",
        )
        env.update(env_extra or {})  # e.g. DS_ACCELERATOR=cuda for the GPU tests
        argv = ["train", "--config", str(cfg), "--data", str(shards), "--run-dir", str(run_dir), *args]
        log_path = run_dir.parent / f"{run_dir.name}.rank{r}.log"
        if not fresh and forked.usable(env):
            procs.append(forked.ForkedRank(argv, env, log_path, REPO))
            continue
        with open(log_path, "a") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "megamemo", *argv], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
                )
            )
    return procs


def wait(procs, timeout: float = 180) -> list[int]:
    """Every rank's exit code, within `timeout` seconds; past it the ranks still running are killed and the test
    fails naming them and their command."""
    end = time.time() + timeout
    rcs = []
    for _r, p in enumerate(procs):
        try:
            rcs.append(p.wait(timeout=max(1, end - time.time())))
        except subprocess.TimeoutExpired:
            hung = [i for i, q in enumerate(procs) if q.poll() is None]
            for q in procs:
                q.kill()
                q.wait()
            raise AssertionError(
                f"ranks {hung} of {len(procs)} still running after {timeout:.0f}s (killed): "
                f"{' '.join(map(str, p.args))}"
            ) from None
    return rcs


def logs(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(run_dir.parent.glob(f"{run_dir.name}.rank*.log")))


def run(n, cfg, shards, run_dir, *args, timeout=180, env_extra=None, fresh=False) -> None:
    rcs = wait(launch(n, cfg, shards, run_dir, *args, env_extra=env_extra, fresh=fresh), timeout)
    assert rcs == [0] * n, logs(run_dir)[-4000:]


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            assert rec["step"] not in out, f"step {rec['step']} logged twice"
            out[rec["step"]] = rec["loss"]
    return out


class ReferenceRuns:
    """Each reference run trained once per test run: get(n, cfg, shards, *args) -> its run directory.

    Keyed by what determines the run - the number of processes, the config's text, the shards' manifest and the
    arguments - not by paths, so the pytest-xdist workers of one run (scripts/test.sh) share it: `root` is the
    directory all of them see, and the first to ask trains the reference under a file lock while the others wait
    for it. A run that failed leaves no DONE mark; the next to ask trains it again (and fails the same way)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def get(self, n: int, cfg: Path, shards: Path, *args: str, timeout: float = 180) -> Path:
        what = json.dumps([n, Path(cfg).read_text(), (Path(shards) / "manifest.json").read_text(), list(args)])
        home = self.root / ("reference-" + hashlib.sha256(what.encode()).hexdigest()[:16])
        run_dir = home / "run"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(f"{home}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (home / "DONE").exists():
                shutil.rmtree(home, ignore_errors=True)
                home.mkdir(parents=True)
                run(n, cfg, shards, run_dir, *args, timeout=timeout)
                (home / "DONE").write_text(what)
        return run_dir
