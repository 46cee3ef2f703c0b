"""Relative attention alone, in each form megamemo can compute it, side by side in one process: forward and
forward + backward time, TFLOP/s and peak memory, against torch's scaled_dot_product_attention without the position
term (FlashAttention on a GPU: the ceiling a relative-attention kernel can approach).

    python bench/attention_kernel.py --out runs/bench/attention.jsonl                  # on one GPU: 1.3b heads, then
                                                                                       # mem_len 2k, 4k and 16k
    TRITON_INTERPRET=1 python bench/attention_kernel.py --device cpu --tiny            # the plumbing, no speed claim

Forms: eager (megamemo/model/attention.py causal_attention, the log-normaliser with a gradient as LaMemo's
look-ahead needs it), compiled (the same under torch.compile), flex (megamemo/kernels/flex.py), fused (the Triton
kernels, megamemo/kernels/fused.py) and sdpa (the ceiling: q + u against k, no position term, no mask, no
log-normaliser). Shapes: lamemo-1.3b's heads (16 x 128, L = M = 512, micro-batch 4, bf16), then memories of 2k and
4k rows (micro-batch 4) and 16k (micro-batch 1). A form that runs out of memory or fails says so in its row.

FLOPs are counted over the visible (query, key) pairs only: 2 * dh per pair and product, 3 products forward
(content, position, probabilities x values) and 6 backward for the relative forms (dV, dP, dK, dq's content and
position parts, dR), 2 and 5 for sdpa (all pairs visible). A causal kernel that skips hidden tiles therefore gets
no credit for them.

Each form's row is appended to --out (JSON lines) as soon as it is measured, so a kill keeps what ran; the table
printed last repeats them with each form's TFLOP/s over sdpa's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")  # compiled and flex need dynamo
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from megamemo.kernels.flex import flex_causal_attention
from megamemo.kernels.fused import fused_causal_attention
from megamemo.model.attention import causal_attention
from megamemo.model.positions import causal_mask

FORMS = ("sdpa", "eager", "compiled", "flex", "fused")
GPU_SHAPES = [dict(B=4, L=512, M=512), dict(B=4, L=512, M=2048), dict(B=4, L=512, M=4096), dict(B=1, L=512, M=16384)]
TINY_SHAPE = dict(B=2, L=16, M=16)


def inputs(n, dh, B, L, M, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()

    klen = M + L
    return dict(
        q=rnd(n, B, L, dh),
        k=rnd(n, B, klen, dh),
        v=rnd(n, B, klen, dh),
        r=rnd(n, klen + 1, dh),
        u=rnd(n, dh),
        vb=rnd(n, dh),
        mask=causal_mask(L, M, 0, False, device),
    )


def call(form: str, x: dict, scale: float):
    """(context, lse or None) of one form."""
    if form == "sdpa":
        q = (x["q"] + x["u"][:, None, None]).transpose(0, 1)
        return F.scaled_dot_product_attention(q, x["k"].transpose(0, 1), x["v"].transpose(0, 1), scale=scale), None
    fn = {
        "eager": causal_attention,
        "compiled": _compiled(),
        "flex": flex_causal_attention,
        "fused": fused_causal_attention,
    }[form]
    return fn(x["q"], x["k"], x["v"], x["r"], x["u"], x["vb"], x["mask"], scale, lse="grad")


_COMPILED = []


def _compiled():
    if not _COMPILED:
        _COMPILED.append(torch.compile(causal_attention, dynamic=False))
    return _COMPILED[0]


def flop_count(form: str, n, dh, B, L, M, visible: int) -> tuple[float, float]:
    """(forward FLOPs, forward + backward FLOPs) as the module docstring counts them."""
    pairs = n * B * (L * (M + L) if form == "sdpa" else visible)
    fwd, bwd = (2, 5) if form == "sdpa" else (3, 6)
    return 2.0 * dh * pairs * fwd, 2.0 * dh * pairs * (fwd + bwd)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    fn()  # warm-up (compiles)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def measure(form: str, x: dict, scale: float, device, reps: int) -> dict:
    def forward():
        with torch.no_grad():
            call(form, x, scale)

    def both():
        out, lse = call(form, x, scale)
        loss = out.float().square().mean() + (lse.float().mean() if lse is not None else 0)
        loss.backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    fwd_s, both_s = timed(forward, device, reps), timed(both, device, reps)
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    for t in x.values():
        if isinstance(t, torch.Tensor):
            t.grad = None
    return {"fwd_ms": fwd_s * 1e3, "fwd_bwd_ms": both_s * 1e3, "peak_gib": None if peak is None else peak / 2**30}


def run_shape(shape: dict, forms, n, dh, dtype, device, reps: int, out: Path | None, log=print) -> list[dict]:
    x = inputs(n, dh, **shape, device=device, dtype=dtype)
    visible = int((~x["mask"]).sum())
    scale = dh**-0.5
    rows = []
    for form in forms:
        row = {"form": form, **shape, "heads": n, "d_head": dh, "dtype": str(dtype)[6:], "device": str(device)}
        try:
            row.update(measure(form, x, scale, device, reps))
            f, fb = flop_count(form, n, dh, **shape, visible=visible)
            row.update(fwd_tflops=f / row["fwd_ms"] / 1e9, fwd_bwd_tflops=fb / row["fwd_bwd_ms"] / 1e9)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:  # a form that cannot run here says so in its row
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if out is not None:
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        log(line(row))
    return rows


def line(row: dict) -> str:
    what = f"{row['form']:<9} B={row['B']} L={row['L']} M={row['M']:<6}"
    if "error" in row:
        return f"{what} {row['error']}"
    peak = "" if row["peak_gib"] is None else f"  peak {row['peak_gib']:.2f} GiB"
    return (
        f"{what} fwd {row['fwd_ms']:8.3f} ms ({row['fwd_tflops']:7.2f} TFLOP/s)  fwd+bwd "
        f"{row['fwd_bwd_ms']:8.3f} ms ({row['fwd_bwd_tflops']:7.2f} TFLOP/s){peak}"
    )


def ratios(rows: list[dict]) -> list[str]:
    """Each form's forward + backward TFLOP/s over sdpa's at the same shape."""
    out = []
    ceiling = {(r["B"], r["L"], r["M"]): r.get("fwd_bwd_tflops") for r in rows if r["form"] == "sdpa"}
    for r in rows:
        c = ceiling.get((r["B"], r["L"], r["M"]))
        if r["form"] != "sdpa" and c and "error" not in r:
            out.append(f"{r['form']:<9} B={r['B']} M={r['M']:<6} fwd+bwd {r['fwd_bwd_tflops'] / c:.2f}x sdpa")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 heads of 16, L = M = 16, fp32 (the CPU smoke test)")
    p.add_argument("--forms", nargs="+", choices=FORMS, default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-mem", type=int, default=16384, help="skip shapes with a longer memory")
    p.add_argument("--out", type=Path, help="append one JSON line a form and shape")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        shapes, n, dh, dtype = [TINY_SHAPE], 2, 16, torch.float32
        forms = a.forms or ["eager", "fused"]  # CPU: flex has no backward, compiling would cost minutes
    else:
        shapes, n, dh, dtype = [s for s in GPU_SHAPES if s["M"] <= a.max_mem], 16, 128, torch.bfloat16
        forms = a.forms or list(FORMS)
    if device.type == "cpu":
        print("[attention_kernel] on the CPU: the plumbing only; these times say nothing about a GPU", flush=True)
    rows = []
    for shape in shapes:
        rows += run_shape(shape, forms, n, dh, dtype, device, a.reps, a.out)
    for text in ratios(rows):
        print(text, flush=True)
    return 0 if rows and all("error" not in r for r in rows if r["M"] <= 512) else 1


if __name__ == "__main__":
    sys.exit(main())
