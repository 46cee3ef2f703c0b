"""The planner's op trace (megamemo/plan/optrace.py) against what CUDA runs: per model shape, one training
micro-batch's forward + backward (full memory, the model in the run's dtype, eager, one process, no optimizer):

  - kernels: the trace's count against torch.profiler's CUDA kernels (and memsets) of one micro-batch;
  - device time: the profiler's kernel time, GEMMs (cuBLAS / CUTLASS / fused attention kernels, by name) and the
    rest, against the trace priced on the device row (opcost.py: --device, default h100-80g);
  - host time per kernel: the wall of a micro-batch that is launch-bound (the device idle between kernels) over its
    kernel count, and the wall of every shape against the planner's simulated one.

    python bench/trace_vs_profile.py [--device h100-80g] [--out results.json]      # on a GPU machine
    python bench/trace_vs_profile.py --predict-only        # the planner's side alone, anywhere (no CUDA)

Shapes: the small bench config (bench/model_step.py's default: 4L d 256, 4x64 heads, d_inner 1024, vocab 256,
B 8, L = M = 128; lamemo, xl, rpe; bf16 and fp32, and lamemo at B 1), configs/enwik8-base.yaml's and
configs/wt103-base.yaml's models at their batch, and two layers of configs/lamemo-1.3b.yaml's at micro-batch 1 and 4.

The figures in megamemo/plan/devices.py (GPU_LAUNCH, GPU_ELEMENTWISE_BW, GPU_UNALIGNED_SLOWDOWN) come from these
measurements on an H100 (2026-11-26; the device tool ran a condensed copy of this script's measure() with the
same shapes, warm-up, median and kernel-name split).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.memory import Memory
from megamemo.plan import opcost
from megamemo.plan.devices import device as device_row
from megamemo.plan.optrace import DTYPES, trace

REPO = Path(__file__).resolve().parents[1]
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d\d_|fmha|attention|flash", re.IGNORECASE)
SMALL = dict(
    n_token=256, n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=128, mem_len=128, dropout=0.1
)


def shapes():
    from megamemo.train.config import load

    out = []
    for variant in ("lamemo", "xl", "rpe"):
        for dtype in ("bf16", "fp32"):
            out.append((f"small {variant} {dtype}", ModelConfig(variant=variant, **SMALL), 8, dtype))
    out.append(("small lamemo autocast", ModelConfig(variant="lamemo", **SMALL), 8, "autocast"))
    out.append(("small lamemo bf16 B1", ModelConfig(variant="lamemo", **SMALL), 1, "bf16"))
    for name in ("enwik8-base", "wt103-base"):
        cfg = load(str(REPO / "configs" / f"{name}.yaml"), [])
        out.append((name, cfg.model, cfg.data.batch_size, cfg.precision.dtype))
    big = load(str(REPO / "configs" / "lamemo-1.3b.yaml"), ["model.n_layer=2", "model.n_token=32000"]).model
    out += [("1.3b 2 layers B1", big, 1, "bf16"), ("1.3b 2 layers B4", big, 4, "bf16")]
    return out


def full_memory(cfg, B, dtype, dev):
    M, n = cfg.mem_len, cfg.n_head
    if cfg.lamemo:
        t = {"emb": torch.randn(M, B, cfg.d_model, device=dev, dtype=dtype)}
        for li in range(cfg.n_layer):
            t[f"ctx.{li}"] = torch.randn(M, B, n, cfg.d_head, device=dev, dtype=dtype)
            t[f"lse.{li}"] = torch.zeros(M, B, n, device=dev)
    else:
        t = {f"hid.{li}": torch.randn(M, B, cfg.d_model, device=dev, dtype=dtype) for li in range(cfg.n_layer)}
    return Memory(t, batch_size=B)


def measure(cfg, B, dtype, dev, steps=5):
    """dtype "autocast": an fp32 model under bf16 autocast, as bench/model_step.py runs bf16."""
    torch.manual_seed(0)
    cast = dtype == "autocast"
    dt = torch.float32 if cast else DTYPES[dtype]
    model = MemTransformerLM(cfg).to(device=dev, dtype=dt).train()
    model.check_inputs = False
    mem = full_memory(cfg, B, torch.bfloat16 if cast else dt, dev)
    x = torch.randint(0, cfg.n_token, (cfg.tgt_len, B), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cast):
            nll, _ = model(x, x, mem)
        nll.float().mean().backward()
        model.zero_grad(set_to_none=True)

    walls = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 2:
            walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gemm = [e for e in kernels if GEMM_KERNEL.search(e.name)]
    model = mem = None  # freed before empty_cache (step's closure shares them)
    torch.cuda.empty_cache()

    def us(e):
        return e.time_range.elapsed_us()

    other = [e for e in kernels if not GEMM_KERNEL.search(e.name)]
    return {
        "wall_ms": 1e3 * statistics.median(walls),
        "kernels": len(kernels),
        "gemm_kernels": len(gemm),
        "gemm_ms": sum(map(us, gemm)) / 1e3,
        "other_ms": sum(map(us, other)) / 1e3,
        "top_other": sorted(((round(us(e), 1), e.name[:60]) for e in other), reverse=True)[:6],
    }


def op_loop(dev, n=2000):
    """Host microseconds per op of a bare loop of in-place adds on a small tensor (dispatch + launch alone)."""
    x = torch.zeros(1024, device=dev)
    for _ in range(100):
        x.add_(1.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def predict(cfg, B, dtype, row):
    dev = device_row(row)
    fwd, bwd = trace(cfg, B, 1, dtype).stage(cfg.n_layer, True, True)
    cost = opcost.concat([opcost.price(fwd, dev, dtype), opcost.price(bwd, dev, dtype)])
    return {
        "kernels": int(fwd.launches.sum() + bwd.launches.sum()),
        "gemm_ms": 1e3 * cost.gemm.sum(),
        "other_ms": 1e3 * cost.other.sum(),
        "wall_ms": 1e3 * opcost.run(cost)[0],
        "gemm_tflop": float(fwd.flops.sum() + bwd.flops.sum()) / 1e12,
        "gbytes": float(fwd.bytes.sum() + bwd.bytes.sum()) / 1e9,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100-80g", help="the devices.py row to price the trace on")
    ap.add_argument("--out")
    ap.add_argument("--predict-only", action="store_true", help="print the planner's figures, measure nothing")
    args = ap.parse_args()
    if args.predict_only:
        for name, cfg, B, dtype in shapes():
            p = predict(cfg, B, "bf16" if dtype == "autocast" else dtype, args.device)
            print(
                f"{name:<24} kernels {p['kernels']:>6}   GEMM {p['gemm_ms']:8.2f} ms   other {p['other_ms']:8.2f} ms"
                f"   wall {p['wall_ms']:8.2f} ms   {p['gemm_tflop']:.3f} TFLOP   {p['gbytes']:.2f} GB"
            )
        return
    if not torch.cuda.is_available():
        sys.exit("trace_vs_profile: needs a CUDA device")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; trace priced on {args.device}")
    loop = op_loop(dev)
    print(f"a bare loop of small in-place adds: {loop:.1f} us an op")
    rows = [{"op_loop_us": loop}]
    for name, cfg, B, dtype in shapes():
        got, pred = measure(cfg, B, dtype, dev), predict(cfg, B, "bf16" if dtype == "autocast" else dtype, args.device)
        rows.append({"shape": name, "batch": B, "dtype": dtype, "measured": got, "predicted": pred})
        print(
            f"{name:<24} kernels {got['kernels']:>6} / {pred['kernels']:>6} traced   "
            f"GEMM {got['gemm_ms']:8.2f} / {pred['gemm_ms']:8.2f} ms   other {got['other_ms']:8.2f} / "
            f"{pred['other_ms']:8.2f} ms   wall {got['wall_ms']:8.2f} / {pred['wall_ms']:8.2f} ms   "
            f"host {1e3 * got['wall_ms'] / got['kernels']:.1f} us/kernel"
        )
        print(f"  largest other kernels (us): {got['top_other']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
