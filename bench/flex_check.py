"""FlexAttention against megamemo's eager relative attention: the causal attention (Transformer-XL / LaMemo's
current rows) and LaMemo's look-ahead, forward and backward, with the log-normaliser and its gradient.

    python bench/flex_check.py --device cuda            # forward + backward, fp32 and bf16, then timings
    python bench/flex_check.py --device cpu --small     # forward only (flex has no backward on the CPU)

The flex form of the score (see megamemo/model/attention.py for the eager one):
  * content term: flex's own q.k with the query q + u (scale applied by flex);
  * position term: bd = (q + v_bias) . R^T * scale, one product per layer [n, B, Q, W], read in score_mod at the
    skewed index (the rel_shift of the eager path becomes an index): causal s0 = L-1, look-ahead s0 = M-nk;
  * the mask: a block mask (causal: key j <= query i + M, bottom-right; look-ahead: key after the memory row).
Printed: the largest differences of context, log-normaliser and every gradient against the eager path (in fp32
the eager path is the reference; in bf16 both are compared with the fp32 eager result, side by side), then the
time of forward+backward of each at a real width. Exit status 1 when fp32 differs by more than 1e-4.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TORCHDYNAMO_DISABLE"] = "0"  # megamemo turns dynamo off unless told otherwise
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megamemo.model.attention import _rows, causal_attention, lookahead_attention
from megamemo.model.positions import causal_mask, lookahead_mask


def flex_rel(q, k, v, r_rows, u, vb, s0, keep, scale, flex):
    """q [n,B,Q,dh], k, v [n,B,K,dh], r_rows [n,W,dh]; score[i,j] = ((q_i+u).k_j + (q_i+vb).R[s0-i+j]) * scale
    where keep(i, j); returns (context [n,B,Q,dh], lse [n,B,Q] fp32)."""
    n, B, Q, dh = q.shape
    K, W = k.size(2), r_rows.size(1)
    bd = torch.matmul((q + vb[:, None, None]) * scale, r_rows.transpose(1, 2)[:, None])  # [n,B,Q,W]

    def score_mod(score, b, h, i, j):
        return score + bd[b, h, i, (s0 - i + j).clamp(0, W - 1)].to(score.dtype)

    def mask_mod(b, h, i, j):
        return keep(i, j)

    block = create_block_mask(mask_mod, None, None, Q, K, device=q.device)
    out, lse = flex(q + u[:, None, None], k, v, score_mod=score_mod, block_mask=block, scale=scale, return_lse=True)
    return out, lse


def cases(device, dtype, n, B, L, M, dh, seed=0, grad=True):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    klen = M + L
    q, k, v = rnd(n, B, klen, dh), rnd(n, B, klen, dh), rnd(n, B, klen, dh)
    r = rnd(n, klen + 1 + M, dh)
    u, vb, vf = rnd(n, dh), rnd(n, dh), rnd(n, dh)
    return dict(q=q, k=k, v=v, r=r, u=u, vb=vb, vf=vf)


def run_causal(t, L, M, scale, impl, flex=None):
    q_cur = t["q"][:, :, M:]
    klen = M + L
    if impl == "eager":
        mask = causal_mask(L, M, M, False, t["q"].device)
        return causal_attention(q_cur, t["k"], t["v"], t["r"], t["u"], t["vb"], mask, scale, lse="grad")
    return flex_rel(
        q_cur, t["k"], t["v"], _rows(t["r"], klen + 1), t["u"], t["vb"], L - 1, lambda i, j: j <= i + M, scale, flex
    )


def run_lookahead(t, L, M, scale, impl, flex=None):
    klen = M + L
    nk = min(M, L)
    qm, kk, vv = t["q"][:, :, :M], t["k"][:, :, M - nk + 1 : M + 1], t["v"][:, :, M - nk + 1 : M + 1]
    r_fut = t["r"][:, klen:]
    if impl == "eager":
        return lookahead_attention(
            qm, kk, vv, r_fut, t["u"], t["vf"], lookahead_mask(M, nk, t["q"].device), scale, lse="grad"
        )
    return flex_rel(
        qm, kk, vv, _rows(r_fut, M + 1), t["u"], t["vf"], M - nk, lambda i, j: M - nk + 1 + j > i, scale, flex
    )


def grads(t, out, lse, backward):
    if not backward:
        return {}
    for x in t.values():
        x.grad = None
    w = torch.linspace(-1, 1, out.numel() // out.size(-1), device=out.device).view(out.shape[:-1])
    (out.float().sum(-1) * w + lse.float() * w.flip(-1)).sum().backward()  # the lse's gradient counts too
    return {name: x.grad.detach().float().clone() for name, x in t.items() if x.grad is not None}


def compare(device, backward, small):
    n, B, L, M, dh = (2, 2, 8, 8, 8) if small else (4, 2, 128, 128, 64)
    scale = dh**-0.5
    flex = flex_attention if device == "cpu" else torch.compile(flex_attention, dynamic=False)
    worst = 0.0
    for kind, fn in (("causal", run_causal), ("look-ahead", run_lookahead)):
        ref_t = cases(device, torch.float32, n, B, L, M, dh)
        ref_out, ref_lse = fn(ref_t, L, M, scale, "eager")
        ref_g = grads(ref_t, ref_out, ref_lse, backward)
        for dtype in (torch.float32, torch.bfloat16):
            for impl in ("eager", "flex"):
                if impl == "eager" and dtype == torch.float32:
                    continue
                t = cases(device, dtype, n, B, L, M, dh, grad=backward)
                with torch.set_grad_enabled(backward):
                    out, lse = fn(t, L, M, scale, impl, flex)
                gr = grads(t, out, lse, backward)
                d = {
                    "ctx": (out.float() - ref_out.float()).abs().max().item(),
                    "lse": (lse.float() - ref_lse.float()).abs().max().item(),
                }
                d.update(
                    {f"d{name}": ((gr[name] - ref_g[name]).abs().max() / ref_g[name].abs().max()).item() for name in gr}
                )
                if dtype == torch.float32:
                    worst = max(worst, *d.values())
                print(
                    f"{kind:10s} {str(dtype)[6:]:8s} {impl:5s} " + " ".join(f"{k} {x:.2e}" for k, x in d.items()),
                    flush=True,
                )
    return worst


def timing(n=16, B=8, L=512, M=512, dh=64, reps=10):
    scale = dh**-0.5
    flex = torch.compile(flex_attention, dynamic=False)
    for kind, fn in (("causal", run_causal), ("look-ahead", run_lookahead)):
        for impl in ("eager", "flex"):
            t = cases("cuda", torch.bfloat16, n, B, L, M, dh)
            torch.cuda.reset_peak_memory_stats()
            for rep in range(reps + 3):
                if rep == 3:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                out, lse = fn(t, L, M, scale, impl, flex)
                (out.float().sum() + lse.sum()).backward()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / reps * 1e3
            print(
                f"time {kind:10s} {impl:5s} bf16 n{n} B{B} L{L} M{M}: {ms:.2f} ms fwd+bwd, peak "
                f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB",
                flush=True,
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU check)")
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args(argv)
    print(
        f"torch {torch.__version__} on {a.device}"
        + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else ""),
        flush=True,
    )
    worst = compare(a.device, backward=a.device != "cpu", small=a.small)
    print(f"fp32 flex vs eager: worst {worst:.2e}", flush=True)
    if a.device == "cuda" and not a.no_timing:
        timing()
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
