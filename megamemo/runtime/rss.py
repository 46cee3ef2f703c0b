"""Resident memory of a training process at a few points, for bench/plan_vs_rss.py (plan against measurement).

With MEGAMEMO_RSS_REPORT=DIR each rank writes DIR/rank_<r>.json at exit: its current and peak resident set size
(VmRSS, VmHWM from /proc/self/status) at each mark - `started` (python, torch, DeepSpeed, megatron-core imported
and the process group up, before the model is built), `built` (model and engine) - and at the end. Off (no file,
no cost) without the variable; on systems without /proc the figures are getrusage's peak only.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

ENV = "MEGAMEMO_RSS_REPORT"
_marks: dict[str, dict[str, int]] = {}


def status() -> dict[str, int]:
    """{'rss': bytes, 'hwm': bytes} of this process now (peak = VmHWM: the kernel's high-water mark)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    out.setdefault("hwm", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out.setdefault("rss", out["hwm"])
    return out


def mark(name: str) -> None:
    if os.environ.get(ENV):
        _marks[name] = status()


def write(rank: int) -> None:
    """DIR/rank_<rank>.json with the marks and the final figures; nothing without MEGAMEMO_RSS_REPORT."""
    target = os.environ.get(ENV)
    if not target:
        return
    Path(target).mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "marks": _marks, "end": status()}
    (Path(target) / f"rank_{rank}.json").write_text(json.dumps(doc, indent=1))
