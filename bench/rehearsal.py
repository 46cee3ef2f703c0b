"""Resharding and conversion at real width (issue 14, items 5-6), from a TP2 x PP2 run of the rehearsal config
(configs/rehearsal-1.3b-width.yaml; bench/checkpoint_io.py leaves one at runs/checkpoint_io/async: 6 steps,
checkpoints at steps 4 and 6):

  * its step-4 checkpoint copied into a new run directory (`megamemo convert relayout`) and resumed in place under
    TP1 x PP4 and TP2 x DP2 for steps 5-6: the losses against the uninterrupted run's (dropout 0, fp32: 1e-5);
  * `megamemo convert to-single` of the run: its peak resident memory (/usr/bin/time's maximum RSS) against the
    fp32 weights it writes, and against an idle process that imported the same modules (the baseline);
  * with --full: configs/lamemo-1.3b.yaml itself (24 layers, 1.31 B parameters) built with parallel.init=shard on
    4 processes as TP2 x PP2, fp32, saved at step 0 without training (--max-steps 0; ZeRO 0: no Adam moments exist
    before the first step and no fp32 master copy - Adam would add 10.5 GB over the 4 ranks, ZeRO's master 5.2 GB,
    more than this 24 GiB machine shared with other jobs can give; segments of 32 keep the probe cheap, the
    weights are the same), then converted to one safetensors file; times and peak memory printed.

    python bench/rehearsal.py [--ref runs/checkpoint_io/async] [--out runs/rehearsal_bench] [--full]

Wrap it in `flock /tmp/megamemo-cpu.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def timed(cmd: list[str], log: Path, **env: str) -> tuple[int, float, int]:
    """(exit code, seconds, peak RSS bytes of the command) via /usr/bin/time -f %M (KiB)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(
            ["/usr/bin/time", "-f", "MAXRSS_KB %M", *cmd], stdout=f, stderr=subprocess.STDOUT, env={**ENV, **env}
        ).returncode
    secs = time.perf_counter() - t0
    peak = [int(line.split()[1]) * 1024 for line in log.read_text().splitlines() if line.startswith("MAXRSS_KB")]
    return rc, secs, peak[-1] if peak else 0


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}


def relayouts(ref: Path, out: Path, config: str, data: str) -> bool:
    ok = True
    want = losses(ref)
    for name, tp, pp in (("tp1pp4", 1, 4), ("tp2dp2", 2, 1)):
        run = out / name
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "megamemo",
                "convert",
                "relayout",
                "--ckpt",
                str(ref / "checkpoints" / "step_00000004"),
                "--out",
                str(run),
            ],
            check=True,
            env=ENV,
            stdout=subprocess.DEVNULL,
        )
        rc, secs, _ = timed(
            [
                str(REPO / "launch" / "local.sh"),
                "4",
                "--config",
                config,
                "--data",
                data,
                "--run-dir",
                str(run),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--max-steps",
                "6",
                "--set",
                "checkpoint.save_at_end=false",
                "--set",
                "log.tensorboard=false",
            ],
            out / f"{name}.log",
        )
        got = losses(run) if rc == 0 else {}
        diffs = [abs(got[s] - want[s]) for s in (5, 6) if s in got]
        good = rc == 0 and len(diffs) == 2 and max(diffs) <= 1e-5
        ok &= good
        print(
            f"TP2xPP2 step 4 -> {name}: rc {rc}, {secs:.0f}s; steps 5, 6 losses "
            + ", ".join(f"{got.get(s)!r} vs {want[s]!r}" for s in (5, 6))
            + (f"; max |diff| {max(diffs):.2e}" if diffs else "")
            + f" -> {'OK' if good else 'FAIL'}"
        )
    return ok


def to_single(ckpt: Path, out: Path, label: str, bound: float = 1.5) -> bool:
    single = out / f"{label}-single"
    shutil.rmtree(single, ignore_errors=True)
    rc, secs, peak = timed(
        [sys.executable, "-m", "megamemo", "convert", "to-single", "--ckpt", str(ckpt), "--out", str(single)],
        out / f"{label}-convert.log",
    )
    _, _, base = timed(
        [sys.executable, "-c", "import torch, safetensors, megamemo.interop.convert"], out / "baseline.log"
    )
    weights = (single / "model.safetensors").stat().st_size if rc == 0 else 0
    ratio = peak / weights if weights else float("inf")
    print(
        f"convert to-single ({label}): rc {rc}, {secs:.1f}s, fp32 weights {weights / GiB:.3f} GiB, peak RSS "
        f"{peak / GiB:.3f} GiB = {ratio:.2f}x the weights (bound {bound}x); the process baseline (python, "
        f"torch, megamemo imported) {base / GiB:.3f} GiB, peak above it {(peak - base) / weights:.2f}x"
    )
    return rc == 0 and ratio <= bound


def full_size(out: Path, data: str) -> bool:
    run = out / "lamemo-1.3b"
    shutil.rmtree(run, ignore_errors=True)
    rc, secs, _ = timed(
        [
            str(REPO / "launch" / "local.sh"),
            "4",
            "--config",
            str(REPO / "configs" / "lamemo-1.3b.yaml"),
            "--data",
            data,
            "--run-dir",
            str(run),
            "--tp",
            "2",
            "--pp",
            "2",
            "--max-steps",
            "0",
            "--set",
            "parallel.init=shard",
            "--set",
            "precision.dtype=fp32",
            "--set",
            "parallel.zero_stage=0",
            "--set",
            "parallel.overlap_comm=false",
            "--set",
            "parallel.reduce_bucket_size=null",
            "--set",
            "train.grad_accum=2",
            "--set",
            "data.batch_size=2",
            "--set",
            "eval.every=0",
            "--set",
            "log.tensorboard=false",
            "--set",
            "model.tgt_len=32",
            "--set",
            "model.mem_len=32",
        ],  # a cheap probe
        out / "lamemo-1.3b.log",
        MEGAMEMO_RSS_REPORT=str(run / "rss"),
    )
    peaks = [json.loads(f.read_text())["end"]["hwm"] for f in sorted((run / "rss").glob("rank_*.json"))]
    print(
        f"lamemo-1.3b built (shard init) and saved at step 0 on 4 processes (TP2 x PP2, fp32, ZeRO 0): rc {rc}, "
        f"{secs:.0f}s; peak RSS per rank " + ", ".join(f"{p / GiB:.2f}" for p in peaks) + " GiB"
    )
    return rc == 0 and to_single(run, out, "lamemo-1.3b")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=str(REPO / "runs" / "checkpoint_io" / "async"))
    ap.add_argument("--out", default=str(REPO / "runs" / "rehearsal_bench"))
    ap.add_argument("--config", default=str(REPO / "configs" / "rehearsal-1.3b-width.yaml"))
    ap.add_argument("--data", default=str(REPO / "data" / "enwik8-prefix"))
    ap.add_argument("--full", action="store_true", help="also the full lamemo-1.3b (about 14 GB of memory)")
    ap.add_argument("--skip-relayout", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    if not args.skip_relayout:
        ok &= relayouts(Path(args.ref), out, args.config, args.data)
    ok &= to_single(Path(args.ref), out, "rehearsal")
    if args.full:
        ok &= full_size(out, args.data)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
