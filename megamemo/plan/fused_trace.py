"""What the fused attention kernels (megamemo/kernels/fused.py, model.attention: fused) cost, as op-trace records:
the planner's stand-in for them on meta tensors, where Triton kernels cannot run.

Each call is one kernel forward and three backward (dK/dV, dq, dR), plus the small torch ops around them (the
backward's D = rowsum(dO * O) - dLSE and the dR bands' sum). No [Q, K] tensor is read or written: the scores,
the position term and the probabilities stay on chip, which is the point.

FLOPs are the kernels' executed ones over the tiles they do not skip (64 x 64 on a GPU: a tile with any visible
pair is computed whole). Per tile pair, in units of 2 * d_head multiply-adds per (query, key) pair: forward 4
(content 1, the position band of 2 * 64 rows 2, probabilities x values 1); backward 19 (dK/dV kernel 6: content,
band, dO V^T, dV, dK; dq kernel 7: content, band, dO V^T, dq content, dq position 2; dR kernel 6: content, band,
dO V^T, dR 2). Recorded as one GEMM-like op a kernel, shaped like torch's fused attention (rows: the queries, cols:
d_head), so the planner prices it at the device's GEMM efficiency for that shape. The kernels' real speed is
unmeasured until a GPU measures it (bench/attention_kernel.py): this is an estimate.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 64  # the kernels' tile on a GPU (kernels/fused.py _block)
FWD_UNITS, BWD_UNITS = 4, 19


def _tiles_visible(Q: int, K: int, first_visible, last_visible) -> int:
    """Tile pairs holding a visible pair, for a mask whose row i sees keys first_visible(i) .. last_visible(i)."""
    n = 0
    for t in range(-(-Q // BLOCK)):
        rows = np.arange(t * BLOCK, min(Q, (t + 1) * BLOCK))
        lo, hi = int(first_visible(rows).min()), int(last_visible(rows).max())
        if hi >= lo:
            n += hi // BLOCK - lo // BLOCK + 1
    return n


def causal_tiles(L: int, klen: int) -> int:
    M = klen - L
    return _tiles_visible(L, klen, lambda i: np.zeros_like(i), lambda i: np.minimum(M + i, klen - 1))


def lookahead_tiles(M: int, nk: int) -> int:
    # key k (position M - nk + 1 + k) is visible to memory query i when it lies after it
    return _tiles_visible(M, nk, lambda i: np.maximum(0, i - (M - nk)), lambda i: np.full_like(i, nk - 1))


def _bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Fused(torch.autograd.Function):
    """Shapes out, records in: (context, lse) of meta tensors, and the kernels' records through `emit`."""

    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, tiles: int, emit):
        n, B, Q, dh = q.shape
        pairs = n * B * tiles * BLOCK * BLOCK
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        emit("fused_attention_fwd", 2 * dh * pairs * FWD_UNITS, _bytes(q, k, v, r), _bytes(out, lse), Q, dh, 1)
        ctx.emit, ctx.pairs = emit, pairs
        ctx.save_for_backward(q, k, v, r, u, vb, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, r, u, vb, out, lse = ctx.saved_tensors
        n, B, Q, dh = q.shape
        emit = ctx.emit
        emit("fused_attention_delta", 0, _bytes(out, out, lse), _bytes(lse), 0, 0, 1)
        emit(
            "fused_attention_bwd",
            2 * dh * ctx.pairs * BWD_UNITS,
            _bytes(q, k, v, r, out, lse, lse),
            _bytes(q, q, k, v) + 4 * n * r.size(1) * 2 * dh,
            Q,
            dh,
            3,
        )
        emit("fused_attention_dr_sum", 0, 4 * n * r.size(1) * 2 * dh, _bytes(r), 0, 0, 2)
        grads = [torch.empty_like(t) for t in (q, k, v, r, u, vb)]
        return (*grads, None, None)


def stand_ins(emit):
    """(causal, lookahead) with the attention functions' signatures, for a model traced on meta tensors."""

    def causal(q, k, v, r, u, vb, mask, scale, drop=None, lse="grad", masking=None):
        L, klen = q.size(2), k.size(2)
        out, norm = _Fused.apply(
            q.contiguous(), k.contiguous(), v.contiguous(), r[:, : klen + 1], u, vb, causal_tiles(L, klen), emit
        )
        return out, (None if lse == "none" else norm)

    def lookahead(qm, k, v, r_fut, u, vf, mask, scale, drop=None, lse="grad", masking=None):
        M, nk = qm.size(2), k.size(2)
        out, norm = _Fused.apply(
            qm.contiguous(), k.contiguous(), v.contiguous(), r_fut[:, : M + 1], u, vf, lookahead_tiles(M, nk), emit
        )
        return out, (None if lse == "none" else norm)

    return causal, lookahead
