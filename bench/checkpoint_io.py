"""Checkpoints at real width: the rehearsal config (configs/rehearsal-1.3b-width.yaml, TP2 x PP2 on 4 local CPU
processes, fp32) trained for 6 steps with a save every 2, three times in one run of this script:

  1. asynchronous saves (checkpoint.async_save true, the default) - the reference losses;
  2. synchronous saves - the same losses, and the stall is the whole save;
  3. asynchronous, killed with SIGKILL (every process at once) at a random moment of the step-4 save, then
     restarted: it resumes from the newest committed checkpoint and its losses must equal run 1's bit for bit.

Printed: bytes written per rank, each save's time and the training stall it caused (from the trainer's
`[checkpoint] committed` lines), the resume's load time (its `[checkpoint] resumed ... (loaded in Xs)` line), and,
in this process, sha256 of every file against reading every tensor of it (safetensors) - the verification's cost
beside the load's.

    python bench/checkpoint_io.py [--config ...] [--data data/enwik8-prefix] [--out runs/checkpoint_io] [--seed N]

Wrap it in `flock /tmp/megamemo-cpu.lock` on a shared machine. Exit 1 when the killed run does not resume exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 6, 2


def launch(args, run: Path, *extra: str) -> subprocess.Popen:
    run.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(REPO / "launch" / "local.sh"),
        "4",
        "--config",
        args.config,
        "--data",
        args.data,
        "--run-dir",
        str(run),
        "--max-steps",
        str(STEPS),
        "--save-every",
        str(EVERY),
        "--set",
        "log.tensorboard=false",
        *extra,
    ]
    log = open(run.parent / f"{run.name}.log", "a")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the launcher's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill9(p: subprocess.Popen) -> None:
    """SIGKILL every worker, then the launcher: no process gets to finish a step or a save (the workers would
    otherwise get SIGTERM from their parent's death and stop cleanly)."""
    for pid in descendants(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def saves(run: Path) -> list[tuple[float, float]]:
    """(save seconds, training stall seconds) of each committed save, from the run's log."""
    out = []
    for line in (run.parent / f"{run.name}.log").read_text().splitlines():
        m = re.search(r"committed .*\((\d+\.\d+)s in the background, training stalled (\d+\.\d+)s[,)]", line)
        if m:
            out.append((float(m[1]), float(m[2])))
        m = re.search(r"committed .*\((\d+\.\d+)s, synchronous\)", line)
        if m:
            out.append((float(m[1]), float(m[1])))
    return out


def verify_vs_load(step_dir: Path) -> tuple[float, float, int]:
    """(sha256 seconds, safetensors read seconds, bytes) over the step's rank files, in this process (the files
    are in the page cache, just written: both are memory-bound, as on a resume right after a save)."""
    import torch
    from safetensors import safe_open

    from megamemo.util.files import file_sha256

    files = sorted(step_dir.glob("rank_*.safetensors"))
    t0 = time.perf_counter()
    for f in files:
        file_sha256(f)
    t1 = time.perf_counter()
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                torch.empty_like(t).copy_(t)  # every byte read (get_tensor may map the file lazily)
    return t1 - t0, time.perf_counter() - t1, sum(f.stat().st_size for f in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "rehearsal-1.3b-width.yaml"))
    ap.add_argument("--data", default=str(REPO / "data" / "enwik8-prefix"))
    ap.add_argument("--out", default=str(REPO / "runs" / "checkpoint_io"))
    ap.add_argument("--seed", type=int, default=None, help="the kill moment's random seed")
    ap.add_argument("--crash-only", action="store_true", help="only part 3, against the async run in --out")
    args = ap.parse_args()
    out = Path(args.out)
    runs = {"async": out / "async", "sync": out / "sync"}
    if args.crash_only:
        return crash_test(args, out, losses(runs["async"]))
    shutil.rmtree(out, ignore_errors=True)
    for name, run in runs.items():
        rc = launch(args, run, "--set", f"checkpoint.async_save={'true' if name == 'async' else 'false'}").wait()
        if rc:
            print(f"{name} run failed (rc {rc}): see {run}.log")
            return 1
    ref = losses(runs["async"])
    step = runs["async"] / "checkpoints" / f"step_{STEPS:08d}"
    sizes = {f.name: f.stat().st_size for f in sorted(step.glob("rank_*.safetensors"))}
    print("bytes written per rank (TP2 x PP2, fp32 weights + Adam moments + memory):")
    for name, n in sizes.items():
        print(f"  {name}: {n / 2**20:8.1f} MiB")
    for name, run in runs.items():
        s = saves(run)
        steps_s = sorted(
            json.loads(line)["time"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == "train"
        )
        print(
            f"{name:>5} saves: "
            + ", ".join(f"{a:.1f}s (stall {b:.2f}s)" for a, b in s)
            + f"; training {steps_s[-1] - steps_s[0]:.1f}s for steps 2..{STEPS}"
        )
    same = losses(runs["sync"]) == ref
    print(f"sync losses == async losses: {same}")

    verify_s, load_s, nbytes = verify_vs_load(step)
    print(
        f"in one process over {nbytes / 2**30:.2f} GiB: sha256 {verify_s:.2f}s ({nbytes / verify_s / 1e9:.2f} GB/s), "
        f"safetensors read {load_s:.2f}s ({nbytes / load_s / 1e9:.2f} GB/s): verify/load = {verify_s / load_s:.2f}"
    )

    return 0 if crash_test(args, out, ref) == 0 and same else 1


def crash_test(args, out: Path, ref: dict[int, float]) -> int:
    """3. killed in the middle of a save, restarted: 0 when it resumes bit-exactly."""
    rng = random.Random(args.seed)
    crash = out / "crash"
    shutil.rmtree(crash, ignore_errors=True)
    (out / "crash.log").unlink(missing_ok=True)
    p = launch(args, crash)
    target = crash / "checkpoints" / f"step_{2 * EVERY:08d}"
    while not target.exists() and p.poll() is None:
        time.sleep(0.05)
    delay = rng.uniform(0.0, 8.0)  # a step-4 save takes 8-13 s at this size
    time.sleep(delay)
    committed_at_kill = (target / "COMMITTED").exists()
    newest = sorted(d.name for d in (crash / "checkpoints").glob("step_*") if (d / "COMMITTED").exists())
    kill9(p)
    files = sorted(f.name for f in target.iterdir()) if target.exists() else []
    print(
        f"killed (SIGKILL, every process) {delay:.2f}s into the step-{2 * EVERY} save (committed then: "
        f"{committed_at_kill}; {len(files)} files there; newest committed: {newest[-1] if newest else None})"
    )
    before = losses(crash)
    rc = launch(args, crash).wait()
    log = (crash.parent / "crash.log").read_text()
    m = re.findall(r"resumed from .*step_(\d+) at step \d+ \(loaded in (\d+\.\d+)s\)", log)
    after = losses(crash)
    resumed = int(m[-1][0]) if m else None
    exact = (
        rc == 0 and all(after[s] == ref[s] for s in range(1, STEPS + 1)) and all(before[s] == ref[s] for s in before)
    )
    expected = int(newest[-1].split("_")[1]) if newest else None
    exact = exact and resumed == expected
    print(
        f"restart: rc {rc}, resumed from step {resumed} (the newest committed at the kill: {expected}; "
        f"load {m[-1][1] if m else '?'}s on rank 0); losses of "
        f"steps 1..{STEPS} equal the uninterrupted run's bit for bit: {exact}"
    )
    for s in range(1, STEPS + 1):
        print(f"  step {s}: uninterrupted {ref[s]!r:<22} killed+resumed {after.get(s)!r}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
