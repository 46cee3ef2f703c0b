"""Goodput: productive training time over wall time since the first start (Google's measure of a job's efficiency).

    goodput = productive / wall
    productive  the seconds of the training steps the run kept, each step once: metrics.jsonl holds one "train"
                record per step of the run's final history (a restart trims the steps it does again), and each
                carries `seconds`, the step's own time
    wall        from the first start (the process start in the first "start" record of metrics.jsonl) to the end
                (the "end" record after the last start; for a run that has not ended, its newest record)

Everything else is in wall and not in productive: start-ups (from each start's process start to the first step's
beginning: `startup_s`), the work lost to interruptions (the steps since the last commit, done again after a
restart, and the time a hang took to detect: `lost_s`, the interruption records' seconds_lost), and the rest
(`other_s`: checkpoint stalls, evaluation, the time between a failure and the next start).

A fresh start (no checkpoint to resume) begins a new history unless it is a restart (MEGAMEMO_RESTART > 0, set by
launch/local.sh --max-restarts, or a requeued Slurm job): train/metrics.py keeps the earlier starts then.
A start that failed before its first step wrote no "start" record: when it was the run's very first, wall begins at
the next start (its lost time is then not counted).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megamemo.runtime.interruptions import history


def process_started() -> float:
    """This process's start as wall-clock time (Linux /proc: boot time + start ticks), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def compute(records: list[dict], interruptions: list[dict]) -> dict | None:
    """The goodput of a run from its metrics records and interruption records; None without a start record."""
    starts = [r for r in records if r.get("kind") == "start"]
    if not starts:
        return None
    t0 = float(starts[0]["time"])
    steps = [r for r in records if r.get("kind") == "train" and isinstance(r.get("seconds"), (int, float))]
    productive = sum(float(r["seconds"]) for r in steps)
    lost = [r for r in interruptions if float(r.get("time", 0)) >= t0]
    ends = [r for r in records if r.get("kind") == "end" and float(r["time"]) >= float(starts[-1]["time"])]
    if ends:
        t_end = float(ends[-1]["time"])
    else:
        t_end = max(float(r["time"]) for r in records + lost if isinstance(r.get("time"), (int, float)))
    wall = max(t_end - t0, 1e-9)
    startup = sum(max(0.0, float(s["ready"]) - float(s["time"])) for s in starts if "ready" in s)
    lost_s = sum(float(r.get("seconds_lost", 0.0)) for r in lost)
    return {
        "goodput": productive / wall,
        "productive_s": productive,
        "wall_s": wall,
        "startup_s": startup,
        "lost_s": lost_s,
        "other_s": wall - productive - startup - lost_s,
        "starts": len(starts),
        "interruptions": len(lost),
        "steps": len(steps),
        "ended": bool(ends),
        "first_start": t0,
        "end": t_end,
    }


def of_run(run_dir: Path) -> dict | None:
    run_dir = Path(run_dir)
    return compute(_records(run_dir / "metrics.jsonl"), history(run_dir))


def describe(g: dict) -> str:
    """One line: goodput 83.2%: 41.3 s of training steps in 49.6 s since the first start (...)."""
    n = g["interruptions"]
    return (
        f"goodput {g['goodput']:.1%}: {g['productive_s']:.1f} s of training steps in {g['wall_s']:.1f} s since "
        f"the first start ({g['starts']} start{'s' if g['starts'] != 1 else ''}, start-ups {g['startup_s']:.1f} s; "
        f"{n} interruption{'s' if n != 1 else ''}, {g['lost_s']:.1f} s lost; checkpoints, evaluation and the "
        f"rest {max(0.0, g['other_s']):.1f} s)"
    )
