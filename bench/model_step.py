"""Forward+backward+Adam step speed of lamemo, xl and rpe at one config, side by side in one run.

Prints tokens/s, analytic model FLOPs per step (backward = 2x forward, counted per matmul, including the memory
rows LaMemo recomputes and its look-ahead attention, less the top layer's memory-row work that nothing reads),
achieved GFLOP/s, and the fp32 peak measured in the same run with a 1024^3 matmul, for each thread count and
precision asked for; then the lamemo/xl time ratio beside the analytic FLOP ratio (from the best steps, and the
median of the rounds' own ratios). The step is what training runs: fused Adam (optim.fused) and megamemo's
malloc settings (megamemo/allocator.py; --default-malloc to compare).

    python bench/model_step.py            # 4L, d 256, 4x64, d_inner 1024, B 8, L=M=128; 1 and 2 threads; fp32, bf16
    python bench/model_step.py --threads 1 --precision fp32 --profile
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megamemo.allocator import tune_cpu_allocator
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.flops import step_flops


def matmul_peak(seconds=1.0) -> float:
    """fp32 1024^3 matmul FLOP/s: the best of groups of 5 over `seconds` (the least disturbed, like the steps)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * 1024 ** 3 / best


def profile_step(variant, args, top=14, steps=3):
    """The top ops of `steps` fp32 steps after warm-up, by self CPU time (torch.profiler): what bounds the rest."""
    from torch.profiler import ProfilerActivity, profile

    r = Runner(variant, args, "fp32")
    for _ in range(args.warmup):
        r.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            r.step()
    print(f"\n-- profile of {variant}: {steps} steps after {args.warmup} warm-up, self CPU time --")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=32))


class Runner:
    """One model, its optimizer and its memory, stepping through its own data."""

    def __init__(self, variant, args, precision):
        torch.manual_seed(0)
        self.cfg = ModelConfig(variant=variant, n_token=args.vocab, n_layer=args.layers, d_model=args.d_model,
                               n_head=args.heads, d_head=args.d_head, d_inner=args.d_inner, dropout=args.dropout,
                               tgt_len=args.tgt_len, mem_len=args.mem_len)
        self.model = MemTransformerLM(self.cfg).train()
        self.model.check_inputs = False
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, fused=True)  # as training (optim.fused)
        self.args, self.precision, self.mem, self.s = args, precision, None, 0
        self.flops = step_flops(self.cfg, args.batch)    # megamemo/model/flops.py

    def step(self) -> float:
        a = self.args
        x = torch.randint(0, a.vocab, (a.tgt_len + 1, a.batch), generator=torch.Generator().manual_seed(self.s))
        self.s += 1
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            nll, self.mem = self.model(x[:-1], x[1:], self.mem)
        nll.mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def interleaved(variants, args, precision) -> tuple[dict, dict]:
    """Per variant (best step time, FLOPs per step), and per variant its step times round by round. The variants'
    steps are interleaved so a neighbour's load on a shared machine hits them alike, in an order reversed every
    other round so that neither variant always runs first; the best (minimum) time is the least disturbed one."""
    runners = {v: Runner(v, args, precision) for v in variants}
    for r in runners.values():
        for _ in range(args.warmup):
            r.step()
    times = {v: [] for v in variants}
    for i in range(args.steps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            times[v].append(runners[v].step())
    return {v: (min(times[v]), runners[v].flops) for v in variants}, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--d-inner", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tgt-len", type=int, default=128)
    ap.add_argument("--mem-len", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--variants", nargs="+", default=["lamemo", "xl", "rpe"])
    ap.add_argument("--profile", action="store_true", help="also print the top ops of lamemo and xl (1 thread)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc as it is (megamemo's commands keep freed memory: megamemo/allocator.py)")
    args = ap.parse_args()
    tuned = not args.default_malloc and tune_cpu_allocator()
    w = max(10, 2 + max(map(len, args.variants)))  # the variant column
    print(f"config: {args.layers}L d_model {args.d_model} {args.heads}x{args.d_head} d_inner {args.d_inner} "
          f"vocab {args.vocab} batch {args.batch} tgt_len {args.tgt_len} mem_len {args.mem_len} "
          f"dropout {args.dropout}; step = forward + backward + Adam, best of {args.steps} interleaved; "
          f"malloc {'tuned (megamemo.allocator)' if tuned else 'glibc default'}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        peak = matmul_peak()
        print(f"\n== {threads} thread(s): fp32 1024^3 matmul peak {peak / 1e9:.1f} GFLOP/s")
        for precision in args.precision:
            print(f"{'variant':<{w}}{'prec':<6}{'tokens/s':>10}{'ms/step':>10}{'GFLOP/step':>12}{'GFLOP/s':>10}"
                  f"{'of peak':>9}")
            res, times = interleaved(args.variants, args, precision)
            for v, (dt, flops) in res.items():
                print(f"{v:<{w}}{precision:<6}{args.batch * args.tgt_len / dt:>10.0f}{dt * 1e3:>10.1f}"
                      f"{flops / 1e9:>12.2f}{flops / dt / 1e9:>10.1f}{flops / dt / peak:>9.1%}")
            if "lamemo" in res and "xl" in res:
                t_ratio = res["lamemo"][0] / res["xl"][0]
                f_ratio = res["lamemo"][1] / res["xl"][1]
                paired = statistics.median(a / b for a, b in zip(times["lamemo"], times["xl"]))
                print(f"lamemo/xl: time ratio {t_ratio:.3f} (median of the rounds' ratios {paired:.3f}), analytic "
                      f"FLOP ratio {f_ratio:.3f}; time/FLOP ratio {t_ratio / f_ratio:.3f} "
                      f"(median {paired / f_ratio:.3f}; 1.0 = same efficiency)")
    if args.profile:
        torch.set_num_threads(1)
        for v in ("lamemo", "xl"):
            profile_step(v, args)
    print("\nreference code at the default config, one thread, fp32 (quoted from the speed issue, not measured "
          "here): lamemo ~560 tokens/s, xl ~850 tokens/s")


if __name__ == "__main__":
    main()
