"""`megamemo plan` against measured memory: the rehearsal config (configs/rehearsal-1.3b-width.yaml, real width)
trained for a few steps on 4 local CPU processes under TP2xPP2, TP2xDP2 and PP4, a checkpoint saved on the way;
each rank's peak resident set (VmHWM, written at exit under MEGAMEMO_RSS_REPORT) beside the plan's prediction for
its stage (a CPU layout: host memory shared by the 4 ranks), and their ratio. Target: every rank within +-20%.

    python bench/plan_vs_rss.py [--config configs/rehearsal-1.3b-width.yaml] [--data data/enwik8-prefix]
                                [--steps 3] [--out runs/plan_vs_rss] [--reuse]   # --reuse: report existing runs

Runs go one after another (wrap the command in `flock /tmp/megamemo-cpu.lock` on a shared machine). Each rank's
`started` mark (python, torch, DeepSpeed, megatron-core imported, gloo up, no model yet) is the measured process
baseline the plan counts as CPU_BASELINE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp2pp2": (2, 2), "tp2dp2": (2, 1), "pp4": (1, 4)}
GiB = 2**30


def run_layout(args, name: str, tp: int, pp: int) -> Path:
    run = Path(args.out) / name
    if not args.reuse:
        subprocess.run(["rm", "-rf", str(run)], check=True)
        env = {**os.environ, "MEGAMEMO_RSS_REPORT": str(run / "rss"), "OMP_NUM_THREADS": "1"}
        cmd = [
            str(REPO / "launch" / "local.sh"),
            "4",
            "--config",
            args.config,
            "--data",
            args.data,
            "--run-dir",
            str(run),
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--max-steps",
            str(args.steps),
            "--save-every",
            "2",
        ]
        run.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{run}.log", "w") as log:
            subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return run


def rank_stage(rank: int, tp: int, pp: int, world: int) -> int:
    """megatron-core's rank order (TP fastest, then DP, then PP): the pipeline stage of a rank."""
    return rank // (world // pp)


def main() -> int:
    from megamemo.plan.layouts import Plan, plan
    from megamemo.train.config import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "rehearsal-1.3b-width.yaml"))
    ap.add_argument("--data", default=str(REPO / "data" / "enwik8-prefix"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-mem-gib", type=float, default=24.0)
    ap.add_argument("--out", default=str(REPO / "runs" / "plan_vs_rss"))
    ap.add_argument("--reuse", action="store_true", help="report the runs already in --out")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    world, worst, rows = 4, 0.0, []
    for name in args.layouts.split(","):
        tp, pp = LAYOUTS[name]
        run = run_layout(args, name, tp, pp)
        cfg = load(args.config, [f"parallel.tp={tp}", f"parallel.pp={pp}"])
        for f in sorted((run / "rss").glob("rank_*.json")):
            d = json.loads(f.read_text())
            stage = rank_stage(d["rank"], tp, pp, world)
            p = plan(cfg, world, args.host_mem_gib / world, stage, device="cpu")
            measured = d["end"]["hwm"]
            ratio = p.total / measured
            worst = max(worst, abs(ratio - 1))
            rows.append((name, d["rank"], stage, p, measured, d["marks"]["started"]["rss"], ratio))
    print(
        f"{'layout':<8}{'rank':>5}{'stage':>6}"
        + "".join(f"{t[:9]:>10}" for t in Plan.TERMS)
        + f"{'predicted':>11}{'measured':>10}{'baseline':>10}{'pred/meas':>10}   (GiB)"
    )
    for name, rank, stage, p, measured, base, ratio in rows:
        print(
            f"{name:<8}{rank:>5}{stage:>6}"
            + "".join(f"{getattr(p, t) / GiB:>10.3f}" for t in Plan.TERMS)
            + f"{p.total / GiB:>11.3f}{measured / GiB:>10.3f}{base / GiB:>10.3f}{ratio:>10.2f}"
        )
    print(f"worst |predicted/measured - 1| = {worst:.1%} (target 20%)")
    return 0 if worst <= 0.2 else 1


if __name__ == "__main__":
    sys.exit(main())
