"""`megamemo plan`'s predicted step time against measured steps: the rehearsal config
(configs/rehearsal-1.3b-width.yaml, real width) on 4 local CPU processes under TP2xPP2, TP2xDP2, PP4, DP4 and TP4
(each with the micro-batch `megamemo plan` picks: the largest that fits, at least pp micro-batches), a few steps
each; the measured step is the median of the intervals between steady-state steps (from step 3: the first fills
the memory). The CPU is calibrated right before the runs (bench/calibrate_cpu.py), and the rate of the layer's
projections at each layout's tp and rows again right before its run: the machine is shared and its speed moves
with the other jobs by up to 2x within minutes. --table predicts with devices.CPU_CALIBRATION
instead (no measurement). Target: every layout within +-25% and the same ranking.

    flock /tmp/megamemo-cpu.lock python bench/plan_vs_step.py [--steps 6] [--out runs/plan_vs_step] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
LAYOUTS = {"tp2pp2": (2, 2, 2), "tp2dp2": (2, 1, 1), "pp4": (1, 4, 4), "dp4": (1, 1, 1), "tp4": (4, 1, 1)}


def run_layout(args, name: str, tp: int, pp: int, ga: int) -> tuple[float, list[float], tuple]:
    """(median steady step seconds, every step interval, load averages before/after)."""
    run = Path(args.out) / name
    before = os.getloadavg()
    if not args.reuse:
        subprocess.run(["rm", "-rf", str(run)], check=True)
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
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--max-steps",
            str(args.steps),
            "--save-every",
            "0",
            "--set",
            f"train.grad_accum={ga}",
            "--set",
            "checkpoint.save_at_end=false",
        ]
        with open(f"{run}.log", "w") as log:
            subprocess.run(
                cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT
            )
    loads = Path(f"{run}.load.json")
    if args.reuse and loads.exists():
        before, after = json.loads(loads.read_text())
    else:
        after = os.getloadavg()
        loads.write_text(json.dumps([before, after]))
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in recs if r.get("kind") == "train"]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps[1:]), gaps, (before, after)


def main() -> int:
    from megamemo.plan.devices import CPU_CALIBRATION, cpu_device
    from megamemo.plan.layouts import plan
    from megamemo.plan.steptime import explain, gemm_width, step_time
    from megamemo.train.config import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "rehearsal-1.3b-width.yaml"))
    ap.add_argument("--data", default=str(REPO / "data" / "enwik8-prefix"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--host-mem-gib", type=float, default=24.0)
    ap.add_argument("--out", default=str(REPO / "runs" / "plan_vs_step"))
    ap.add_argument("--reuse", action="store_true", help="report the runs already in --out")
    ap.add_argument("--table", action="store_true", help="predict with devices.CPU_CALIBRATION (no calibration)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--explain", action="store_true", help="print each layout's predicted breakdown")
    args = ap.parse_args()
    cal_path = Path(args.out) / "calibration.json"
    if args.table:
        cal = CPU_CALIBRATION
    elif args.reuse and cal_path.exists():
        cal = json.loads(cal_path.read_text())
    else:
        from calibrate_cpu import calibrate

        cal = calibrate()
        cal_path.parent.mkdir(parents=True, exist_ok=True)
        cal_path.write_text(json.dumps(cal))
    world, rows = 4, []
    for name in args.layouts.split(","):
        tp, pp, ga = LAYOUTS[name]
        cfg = load(args.config, [f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.grad_accum={ga}"])
        fits = all(plan(cfg, world, args.host_mem_gib / world, s, "cpu").fits for s in range(pp))
        now = dict(cal, gemm={int(w): r for w, r in cal["gemm"].items()})
        if not (args.table or args.reuse):
            from calibrate_cpu import LAYER, layer_gemm_rate

            m = cfg.model
            n_rows = (m.tgt_len + m.mem_len) * cfg.layout(world)[1]
            key = f"{tp}x{n_rows}"
            now["layer_gemm"] = dict(cal.get("layer_gemm", {}))
            now["layer_gemm"][key] = round(layer_gemm_rate(*LAYER, tp, n_rows, 3) / 1e9, 1)
            print(
                f"[{name}] the layer's projections at tp {tp}, {n_rows} rows (GEMM width "
                f"{gemm_width(m, tp, cfg.layout(world)[1])}): {now['layer_gemm'][key]:.1f} GFLOP/s now",
                flush=True,
            )
            (Path(args.out) / f"{name}.calibration.json").write_text(json.dumps(now))
        elif args.reuse and (Path(args.out) / f"{name}.calibration.json").exists():
            now = json.loads((Path(args.out) / f"{name}.calibration.json").read_text())
        st = step_time(cfg, world, cpu_device(now), world, plan)
        measured, gaps, load_avg = run_layout(args, name, tp, pp, ga)
        rows.append((name, st, measured, gaps, load_avg, fits))
        if args.explain:
            print("\n".join(explain(st, cpu_device(now))), flush=True)
    print(
        f"{'layout':<8}{'layout (micro x accum)':<42}{'predicted s':>12}{'measured s':>11}{'pred/meas':>10}"
        f"{'tok/s pred':>11}{'tok/s meas':>11}  {'dominant':<12}load avg    steps (s)"
    )
    worst = 0.0
    for name, st, measured, gaps, load_avg, fits in rows:
        ratio = st.seconds / measured
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name:<8}{st.layout:<42}{st.seconds:>12.2f}{measured:>11.2f}{ratio:>10.2f}{st.tokens_per_s:>11.1f}"
            f"{st.tokens / measured:>11.1f}  {st.dominant:<12}{load_avg[0][0]:.1f}-{load_avg[1][0]:.1f}   "
            + " ".join(f"{g:.2f}" for g in gaps)
            + ("" if fits else "  (does not fit: plan)")
        )
    by_pred = [r[0] for r in sorted(rows, key=lambda r: r[1].seconds)]
    by_meas = [r[0] for r in sorted(rows, key=lambda r: r[2])]
    print(
        f"ranking, predicted: {' > '.join(by_pred)}; measured: {' > '.join(by_meas)}; "
        f"{'the same' if by_pred == by_meas else 'DIFFERENT'}"
    )
    print(f"worst |predicted/measured - 1| = {worst:.1%} (target 25%)")
    return 0 if worst <= 0.25 and by_pred == by_meas else 1


if __name__ == "__main__":
    sys.exit(main())
