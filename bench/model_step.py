"""Forward+backward+Adam step speed of megamemo's lamemo, xl and rpe, and of the reference LaMemo code's LaMemo
and Transformer-XL, at one config, side by side in one process.

    python bench/model_step.py --reference-code /work/shared/reference-code/thu-coai-LaMemo
    python bench/model_step.py --threads 1 --precision fp32 --steps 6 --warmup 1 --profile
    python bench/model_step.py --device cuda --gpu-batch 16      # on a GPU machine (also the configs' shapes)

Default config: 4L, d 256, 4x64 heads, d_inner 1024, vocab 256, B 8, L = M = 128, dropout 0.1 (dropatt 0: --dropatt);
1 and 2 threads; fp32 and bf16 (autocast); every megamemo model with stream dropout masks and, beside it, keyed ones
(train.dropout_masks: keyed, megamemo/kernels/keyed.py; "-keyed" rows, the key's step advanced every step). Every model
steps through its own random tokens with its memory carried; the step is what training runs: fused Adam (optim.fused)
and megamemo's malloc settings (megamemo/runtime/allocator.py; --default-malloc to compare). Rounds step every model
once, in an order reversed every other round so that none always runs first (each reference model steps next to its
megamemo counterpart); a model's time is its best (least disturbed) step. Printed: tokens/s, ms/step, the analytic FLOPs
a step executes (megamemo/model/flops.py step_flops: the same figure for the reference, which does the same model's
work), achieved GFLOP/s, and two fractions of the peak: HFU (the executed FLOPs, LaMemo's memory-row recompute and
look-ahead included) and MFU (flops.py model_flops: PaLM's 6 N + attention over mem_len + tgt_len keys, the same for
LaMemo and XL of one shape); then time ratios from the best steps and as the median of the rounds' own ratios (the
steadier of the two on a shared machine): lamemo/xl against their FLOP ratio, keyed/stream masks per variant, and
megamemo/reference tokens/s for lamemo and xl.

Reference code (--reference-code DIR, a checkout of thu-coai/LaMemo; not part of megamemo): its pytorch/ and
pytorch/utils go on sys.path and `mem_transformer.MemTransformerLM` is built with the same config (attn_type 3 =
LaMemo, 0 = Transformer-XL), weights drawn from N(0, 0.02), called as `model(data, target, *mems)` (its training
script also passes mem_target, which adds a softmax over the memory rows that it then discards: not timed here).

The peak. On CPU the "of peak" column is measured, not assumed: a 1024^3 fp32 matmul alone is not this CPU's
peak (smaller, cache-friendly products ran ~1.5x faster here, which put model steps at 104-112% "of peak"). The
probe takes the best FLOP/s over several product shapes - 1024^3, a batched 8x512^3, and the model's own largest
ones (the feed-forward's forward, input-gradient and weight-gradient products at L*B and (L+M)*B rows) - at the
same thread count, in fp32 and, for bf16 runs, also in bf16 (autocast keeps some products in fp32, and on a CPU
without bf16 matmul units fp32 products are the faster ones), sampled once per round between the steps and kept
at its best, as the steps are: HFU and MFU are then of that measured peak. On GPU the peak is the datasheet figure for
the device (megamemo/runtime/peak.py); there the bench also runs megamemo at configs/wt103-base.yaml and
configs/enwik8-base.yaml model shapes (--configs; batch --gpu-batch or the config's data.batch_size, the config's
precision).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from megamemo.kernels import KERNELS, DropoutKey, apply_dropout_masks, apply_kernels
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.flops import model_flops, step_flops
from megamemo.runtime.allocator import tune_cpu_allocator
from megamemo.runtime.peak import device_peak

REPO = Path(__file__).resolve().parents[1]
REFERENCE = {"ref-lamemo": ("lamemo", 3), "ref-xl": ("xl", 0)}  # name -> (megamemo variant, attn_type)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_reference(path: str):
    """The reference's mem_transformer module from a thu-coai/LaMemo checkout (its pytorch/ folder)."""
    root = Path(path)
    src = root / "pytorch" if (root / "pytorch").is_dir() else root
    if not (src / "mem_transformer.py").is_file():
        sys.exit(
            f"model_step: --reference-code {path}: no pytorch/mem_transformer.py there "
            f"(expected a checkout of thu-coai/LaMemo)"
        )
    sys.path[:0] = [str(src), str(src / "utils")]
    import mem_transformer

    return mem_transformer


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model (megamemo's, or the reference's with `ref`), its optimizer and its memory."""

    def __init__(self, name, cfg: ModelConfig, batch, device, precision, ref=None, kernels="auto", masks="stream"):
        self.name, self.cfg, self.batch, self.device, self.precision = name, cfg, batch, device, precision
        torch.manual_seed(0)
        if ref is None:
            self.model = MemTransformerLM(cfg)
            self.model.check_inputs = False
        else:
            c = cfg
            self.model = ref.MemTransformerLM(
                c.n_token,
                c.n_layer,
                c.n_head,
                c.d_model,
                c.d_head,
                c.d_inner,
                c.dropout,
                c.dropatt,
                tie_weight=True,
                tgt_len=c.tgt_len,
                ext_len=0,
                mem_len=c.mem_len,
                attn_type=REFERENCE[name][1],
            )
            with torch.no_grad():
                for p in self.model.parameters():
                    p.normal_(0.0, 0.02)
        self.ref = ref is not None
        self.model.to(device).train()
        self.key = None
        if ref is None:
            apply_kernels(self.model, kernels, device)  # as training does (train.kernels; megamemo/kernels/)
            if masks == "keyed":  # as training does (train.dropout_masks: keyed)
                self.key = DropoutKey(0, (0,), device)
                apply_dropout_masks(self.model, "keyed", self.key)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, fused=True)  # as training (optim.fused)
        self.mem, self.s = (tuple() if self.ref else None), 0
        self.flops = step_flops(cfg, batch)  # executed, HFU's (megamemo/model/flops.py)
        self.model_flops = model_flops(cfg, batch)  # PaLM's convention, MFU's
        self.tokens = batch * cfg.tgt_len

    def step(self) -> float:
        c = self.cfg
        x = torch.randint(0, c.n_token, (c.tgt_len + 1, self.batch), generator=torch.Generator().manual_seed(self.s))
        x = x.to(self.device)
        if self.key is not None:
            self.key.set(step=self.s)
        self.s += 1
        sync(self.device)
        t0 = time.perf_counter()
        dtype = AUTOCAST[self.precision]
        with torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            if self.ref:
                ret = self.model(x[:-1], x[1:], *self.mem)
                loss, self.mem = ret[0], ret[2:]
            else:
                loss, self.mem = self.model(x[:-1], x[1:], self.mem)
        loss.float().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        return time.perf_counter() - t0


class PeakProbe:
    """The best matmul FLOP/s seen over several product shapes (see the module docstring); CPU only."""

    def __init__(self, cfg: ModelConfig, batch: int, precision: str):
        d, f = cfg.d_model, cfg.d_inner
        rows = sorted({cfg.tgt_len * batch, (cfg.tgt_len + cfg.mem_len) * batch})
        mnk = [(1024, 1024, 1024)] + [s for n in rows for s in ((n, d, f), (n, f, d), (d, n, f))]
        self.shapes = [(None, m, k, n) for m, k, n in mnk] + [(8, 512, 512, 512)]
        # operands already in the dtype (no casts timed); under autocast some products stay fp32, so bf16 runs
        # are measured against the better of the two
        self.dtypes = [torch.float32] + ([AUTOCAST[precision]] if AUTOCAST[precision] else [])
        self.best = 0.0

    def sample(self) -> None:
        for dtype in self.dtypes:
            for b, m, k, n in self.shapes:
                a = torch.randn(*((b,) if b else ()), m, k, dtype=dtype)
                w = torch.randn(*((b,) if b else ()), k, n, dtype=dtype)
                a @ w  # warm
                t0 = time.perf_counter()
                a @ w
                dt = time.perf_counter() - t0
                self.best = max(self.best, 2 * (b or 1) * m * k * n / dt)


def interleaved(runners: dict, rounds: int, warmup: int, probe: PeakProbe | None = None) -> dict:
    """{name: [step time per round]}: the rounds step every runner once, the order reversed every other round."""
    for r in runners.values():
        for _ in range(warmup):
            r.step()
    names = list(runners)
    times = {v: [] for v in names}
    for i in range(rounds):
        for v in names if i % 2 == 0 else names[::-1]:
            times[v].append(runners[v].step())
        if probe is not None:
            probe.sample()
    return times


def ratio_line(label, num, den, times, best_of) -> str:
    t_ratio = min(times[num]) / min(times[den])
    paired = statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))
    return f"{label}: time ratio {t_ratio:.3f} (median of the rounds' ratios {paired:.3f})" + best_of(t_ratio, paired)


def utilisation(r: Runner, dt: float, peak: float | None) -> str:
    """The HFU and MFU columns of a step of dt seconds (n/a without a peak)."""
    return "".join(f"{flops / dt / peak:>7.1%}" if peak else f"{'n/a':>7}" for flops in (r.flops, r.model_flops))


def table(runners, times, precision, peak, w) -> None:
    print(
        f"{'model':<{w}}{'prec':<6}{'tokens/s':>10}{'ms/step':>10}{'GFLOP/step':>12}{'GFLOP/s':>10}{'HFU':>7}{'MFU':>7}"
    )
    for v, r in runners.items():
        dt = min(times[v])
        print(
            f"{v:<{w}}{precision:<6}{r.tokens / dt:>10.0f}{dt * 1e3:>10.1f}{r.flops / 1e9:>12.2f}"
            f"{r.flops / dt / 1e9:>10.1f}{utilisation(r, dt, peak)}"
        )


def ratios(runners, times) -> None:
    if "lamemo" in times and "xl" in times:
        f_ratio = runners["lamemo"].flops / runners["xl"].flops
        print(
            ratio_line(
                "lamemo/xl",
                "lamemo",
                "xl",
                times,
                lambda t, p: (
                    f", analytic FLOP ratio {f_ratio:.3f}; time/FLOP ratio {t / f_ratio:.3f} "
                    f"(median {p / f_ratio:.3f}; "
                    f"1.0 = same efficiency)"
                ),
            )
        )
    for v in list(times):
        if f"{v}-keyed" in times:
            print(ratio_line(f"{v} keyed/stream masks", f"{v}-keyed", v, times, lambda t, p: ""))
    for ref, (ours, _) in REFERENCE.items():
        if ref in times and ours in times:  # tokens/s ratio = reference time / megamemo time
            t = min(times[ref]) / min(times[ours])
            p = statistics.median(a / b for a, b in zip(times[ref], times[ours], strict=True))
            print(
                f"{ours} megamemo/reference tokens/s: {t:.2f}x from the best steps (median of the rounds' "
                f"ratios {p:.2f}x)"
            )


def model_config(args, variant) -> ModelConfig:
    return ModelConfig(
        variant=variant,
        n_token=args.vocab,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        d_head=args.d_head,
        d_inner=args.d_inner,
        dropout=args.dropout,
        dropatt=args.dropatt,
        tgt_len=args.tgt_len,
        mem_len=args.mem_len,
    )


def side_by_side(args, device, ref_module, w) -> None:
    names = []  # each reference model next to its megamemo counterpart, lamemo next to xl
    for v in args.variants:
        pair = {"lamemo": ["ref-lamemo", "lamemo"], "xl": ["xl", "ref-xl"]}.get(v) if ref_module else None
        for n in pair or [v]:  # each megamemo model with its masks' forms side by side
            names += [n] if n in REFERENCE else [n if m == "stream" else f"{n}-keyed" for m in args.dropout_masks]
    for threads in args.threads if device.type == "cpu" else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        print(
            f"\n== {device.type}"
            + (f", {threads} thread(s)" if device.type == "cpu" else f" ({torch.cuda.get_device_name(device)})")
        )
        for precision in args.precision:
            runners = {
                v: Runner(
                    v,
                    model_config(args, REFERENCE.get(v, (v.removesuffix("-keyed"),))[0]),
                    args.batch,
                    device,
                    precision,
                    ref=ref_module if v in REFERENCE else None,
                    kernels=args.kernels,
                    masks="keyed" if v.endswith("-keyed") else "stream",
                )
                for v in names
            }
            probe = PeakProbe(runners[names[0]].cfg, args.batch, precision) if device.type == "cpu" else None
            times = interleaved(runners, args.steps, args.warmup, probe)
            if probe is not None:
                peak = probe.best
                kinds = "/".join(str(d).split(".")[1] for d in probe.dtypes)
                print(
                    f"matmul peak {peak / 1e9:.1f} GFLOP/s (best of {len(probe.shapes)} product shapes in "
                    f"{kinds}, sampled every round; HFU and MFU are of it)"
                )
            else:
                p = device_peak(device, precision)
                peak = p.flops
                print(f"peak {p.source}")
            table(runners, times, precision, peak, w)
            ratios(runners, times)
            del runners


def config_shapes(args, device) -> None:
    """megamemo's tokens/s, HFU and MFU at the configs' model shapes (GPU only)."""
    from megamemo.train.config import load

    print(f"\n== {device.type}: megamemo at the configs' model shapes ({torch.cuda.get_device_name(device)})")
    print(
        f"{'config':<20}{'variant':<9}{'batch':>6}{'prec':>6}{'tokens/s':>11}{'TFLOP/s':>9}{'HFU':>7}{'MFU':>7}  peak"
    )
    for path in args.configs:
        cfg = load(str(path), [])
        batch = args.gpu_batch or cfg.data.batch_size
        prec = cfg.precision.dtype
        try:
            r = Runner(cfg.model.variant, cfg.model, batch, device, prec, kernels=args.kernels)
            times = interleaved({"m": r}, args.gpu_steps, args.warmup)["m"]
        except torch.cuda.OutOfMemoryError:
            print(f"{Path(path).name:<20}out of memory at batch {batch}: pass a smaller --gpu-batch")
            torch.cuda.empty_cache()
            continue
        dt = min(times)
        p = device_peak(device, prec)
        print(
            f"{Path(path).name:<20}{cfg.model.variant:<9}{batch:>6}{prec:>6}{r.tokens / dt:>11.0f}"
            f"{r.flops / dt / 1e12:>9.1f}{utilisation(r, dt, p.flops)}  {p.source}"
        )
        del r
        torch.cuda.empty_cache()


def profile_step(variant, args, top=14, steps=3):
    """The top ops of `steps` fp32 CPU steps after warm-up, by self CPU time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    r = Runner(variant, model_config(args, variant), args.batch, torch.device("cpu"), "fp32", kernels=args.kernels)
    for _ in range(args.warmup):
        r.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            r.step()
    print(f"\n-- profile of {variant}: {steps} steps after {args.warmup} warm-up, self CPU time --")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=32))


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
    ap.add_argument("--dropatt", type=float, default=0.0)
    ap.add_argument(
        "--dropout-masks",
        nargs="+",
        choices=["stream", "keyed"],
        default=["stream", "keyed"],
        help="megamemo's dropout masks, side by side (train.dropout_masks)",
    )
    ap.add_argument("--steps", type=int, default=16, help="rounds (each model steps once per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="CPU thread counts")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--variants", nargs="+", default=["lamemo", "xl", "rpe"])
    ap.add_argument(
        "--reference-code",
        metavar="DIR",
        help="a thu-coai/LaMemo checkout (its pytorch/ folder) to time beside megamemo",
    )
    ap.add_argument(
        "--device",
        nargs="+",
        choices=["cpu", "cuda"],
        default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []),
    )
    ap.add_argument(
        "--configs",
        nargs="*",
        default=[REPO / "configs/wt103-base.yaml", REPO / "configs/enwik8-base.yaml"],
        help="on GPU: also time megamemo at these configs' model shapes",
    )
    ap.add_argument("--gpu-batch", type=int, help="batch for --configs (default: each config's data.batch_size)")
    ap.add_argument("--gpu-steps", type=int, default=10, help="timed steps per --configs model")
    ap.add_argument("--profile", action="store_true", help="also print the top ops of lamemo and xl (1 thread)")
    ap.add_argument(
        "--kernels",
        choices=KERNELS,
        default="auto",
        help="megamemo's execution path, as train.kernels: auto (the CPU kernels on the CPU, plain "
        "PyTorch on CUDA), plain or cpu (megamemo/kernels/)",
    )
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (megamemo's commands keep freed memory: megamemo/runtime/allocator.py)",
    )
    args = ap.parse_args()
    if "cuda" in args.device and not torch.cuda.is_available():
        sys.exit("model_step: --device cuda: torch sees no CUDA device")
    ref = load_reference(args.reference_code) if args.reference_code else None
    tuned = not args.default_malloc and tune_cpu_allocator()
    w = max(12, 2 + max(len(v) + 6 * ("keyed" in args.dropout_masks) for v in args.variants))
    print(
        f"config: {args.layers}L d_model {args.d_model} {args.heads}x{args.d_head} d_inner {args.d_inner} "
        f"vocab {args.vocab} batch {args.batch} tgt_len {args.tgt_len} mem_len {args.mem_len} "
        f"dropout {args.dropout} dropatt {args.dropatt}; step = forward + backward + Adam, "
        f"best of {args.steps} interleaved rounds; "
        f"malloc {'tuned (megamemo.runtime.allocator)' if tuned else 'glibc default'}; kernels {args.kernels}"
    )
    print(
        "reference code: "
        + (
            f"{args.reference_code} (ref-lamemo: attn_type 3, ref-xl: attn_type 0)"
            if ref
            else "not given (--reference-code DIR to time thu-coai/LaMemo beside megamemo)"
        )
    )
    for dev in args.device:
        side_by_side(args, torch.device(dev), ref, w)
        if dev == "cuda" and args.configs:
            config_shapes(args, torch.device(dev))
    if "cuda" not in args.device and args.configs and not torch.cuda.is_available():
        print("\n(configs' model shapes: timed on GPU only; this machine has no CUDA device)")
    if args.profile:
        torch.set_num_threads(1)
        for v in ("lamemo", "xl"):
            profile_step(v, args)


if __name__ == "__main__":
    main()
