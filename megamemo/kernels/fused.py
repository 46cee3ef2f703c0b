"""LaMemo's two attentions through the fused Triton kernels (megamemo/kernels/relattn_triton.py): the scores, the
rel-shifted position term and the probabilities never leave the chip, forward and backward, with the log-normaliser
and its gradient.

Same signatures and results as megamemo.model.attention.causal_attention / lookahead_attention (the eager form,
which states the maths; within rounding: fp32 scores and an online softmax), swapped into RelAttention by
`apply_attention` (model.attention: fused). Gradients reach q, k, v, R, u and vb; they are bit-identical run to run
(no atomics). Attention dropout is not in the kernel: a call that would drop runs the eager form (training with
model.dropatt > 0 never picks fused: megamemo/train/speedups.py).

On CUDA the kernels are compiled by Triton. On CPU tensors they run in Triton's interpreter, which needs
TRITON_INTERPRET=1 set before triton is imported (the suite sets it): exact, and far too slow for anything but
tests at tiny shapes.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from megamemo.model.attention import _drops, _rows, causal_attention, lookahead_attention, select_lse
from megamemo.util.errors import MegamemoError


class FusedUnavailable(MegamemoError, RuntimeError):
    """The fused kernels cannot run here (no triton, or CPU tensors without the interpreter)."""


@functools.cache
def _kernels():
    try:  # triton only when the kernels are used: the CPU wheel of torch does not bring it
        import megamemo.kernels.relattn_triton as kernels  # imports triton
    except ImportError as e:
        raise FusedUnavailable(f"model.attention: fused needs triton ({e})") from None
    return kernels


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter in this process (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(device) -> None:
    """Raises FusedUnavailable, one line, where the kernels cannot run on `device`."""
    kind = torch.device(device).type
    if kind == "cpu" and not interpreted():
        raise FusedUnavailable(
            "model.attention: fused runs on CUDA, or on the CPU in Triton's interpreter "
            "(set TRITON_INTERPRET=1 before the process starts; tiny shapes only)"
        )
    if kind not in ("cpu", "cuda"):
        raise FusedUnavailable(f"model.attention: fused runs on CUDA (this model is on {kind})")
    _kernels()


def _block(device_type: str) -> int:
    """Tile rows and columns (BM = BN): 16 in the interpreter (the smallest tl.dot), 64 on a GPU."""
    return 16 if device_type == "cpu" else 64


def _launch_options(device_type: str, dh: int) -> dict:
    return {} if device_type == "cpu" else {"num_warps": 4 if dh <= 64 else 8, "num_stages": 2}


def _tiles(mask: torch.Tensor, block: int) -> torch.Tensor:
    """[n_qt, n_kt] int32: 1 where the tile holds a visible pair (mask [Q, K], True = hidden)."""
    Q, K = mask.shape
    n_qt, n_kt = -(-Q // block), -(-K // block)
    padded = F.pad(~mask, (0, n_kt * block - K, 0, n_qt * block - Q))
    return padded.view(n_qt, block, n_kt, block).any(3).any(1).to(torch.int32).contiguous()


class _Problem:
    """One call's shapes, strides and launch constants (the kernels' common arguments)."""

    def __init__(self, q, k, r, mask, s0, scale):
        n, B, Q, dh = q.shape
        self.n, self.B, self.Q, self.K, self.W, self.dh = n, B, Q, k.size(2), r.size(1), dh
        self.block = _block(q.device.type)
        self.n_qt, self.n_kt = -(-Q // self.block), -(-self.K // self.block)
        self.tiles = _tiles(mask, self.block)
        self.mask = mask.to(torch.int8).contiguous()
        self.s0, self.scale = int(s0), float(scale)
        self.prec = "ieee" if q.dtype == torch.float32 else None
        self.upcast = q.dtype != torch.float32 and q.device.type == "cpu"  # the interpreter: see _mm
        self.options = _launch_options(q.device.type, dh)

    def consts(self):
        return dict(
            DH=self.dh,
            BM=self.block,
            BN=self.block,
            T=2 * self.block,
            PREC=self.prec,
            UPCAST=self.upcast,
            **self.options,
        )

    def strides(self):
        # q-like [n*B, Q, dh] and k-like [n*B, K, dh] contiguous; r [n, W, dh] contiguous
        return (self.Q * self.dh, self.dh, self.K * self.dh, self.dh, self.W * self.dh, self.dh)


def _forward(pb: _Problem, q, k, v, r, u, vb):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _kernels()._fwd[(pb.n_qt, pb.n * pb.B)](
        q,
        k,
        v,
        r,
        u,
        vb,
        pb.mask,
        pb.tiles,
        out,
        lse,
        pb.B,
        pb.Q,
        pb.K,
        pb.W,
        pb.s0,
        pb.scale,
        pb.n_kt,
        *pb.strides(),
        **pb.consts(),
    )
    return out, lse


def _r_grad(pb: _Problem, bands: torch.Tensor) -> torch.Tensor:
    """dR [n, W, dh] fp32 from the per-diagonal band gradients [n, D, T, dh]: band d starts at row base0 + d*BN and
    is 2*BN rows long, so the even diagonals tile the rows without overlap, and so do the odd ones."""
    n, D, T, dh = bands.shape
    bn = pb.block
    base0 = pb.s0 - (bn - 1) - (pb.n_qt - 1) * bn
    buf = bands.new_zeros(n, (D + 2) * bn, dh)
    even, odd = bands[:, 0::2].reshape(n, -1, dh), bands[:, 1::2].reshape(n, -1, dh)
    buf[:, : even.size(1)] += even
    buf[:, bn : bn + odd.size(1)] += odd
    out = bands.new_zeros(n, pb.W, dh)
    lo, hi = max(0, base0), min(pb.W, base0 + buf.size(1))
    if hi > lo:
        out[:, lo:hi] = buf[:, lo - base0 : hi - base0]
    return out


def _backward(pb: _Problem, q, k, v, r, u, vb, out, lse, g_out, g_lse):
    kern, z = _kernels(), pb.n * pb.B
    delta = (g_out.float() * out.float()).sum(-1)
    if g_lse is not None:
        delta = delta - g_lse.float()
    args = (q, k, v, r, u, vb, pb.mask, pb.tiles, g_out, lse, delta.contiguous())
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    kern._bwd_kv[(pb.n_kt, z)](
        *args, dk, dv, pb.B, pb.Q, pb.K, pb.W, pb.s0, pb.scale, pb.n_qt, pb.n_kt, *pb.strides(), **pb.consts()
    )
    dqc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dqp = torch.empty_like(dqc)
    kern._bwd_q[(pb.n_qt, z)](
        *args, dqc, dqp, pb.B, pb.Q, pb.K, pb.W, pb.s0, pb.scale, pb.n_kt, *pb.strides(), **pb.consts()
    )
    bands = torch.empty(pb.n, pb.n_qt + pb.n_kt - 1, 2 * pb.block, pb.dh, dtype=torch.float32, device=q.device)
    kern._bwd_r[(pb.n_qt + pb.n_kt - 1, pb.n)](
        *args, bands, pb.B, pb.Q, pb.K, pb.W, pb.s0, pb.scale, pb.n_qt, pb.n_kt, *pb.strides(), **pb.consts()
    )
    dq = (dqc + dqp).to(q.dtype)
    du, dvb = dqc.sum((1, 2)).to(u.dtype), dqp.sum((1, 2)).to(vb.dtype)
    return dq, dk, dv, _r_grad(pb, bands).to(r.dtype), du, dvb


class _FusedRelative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, mask, s0, scale):
        q, k, v, r, u, vb = (t.contiguous() for t in (q, k, v, r, u, vb))
        pb = _Problem(q, k, r, mask, s0, scale)
        out, lse = _forward(pb, q, k, v, r, u, vb)
        ctx.pb = pb
        ctx.save_for_backward(q, k, v, r, u, vb, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, r, u, vb, out, lse = ctx.saved_tensors
        g_out = torch.zeros_like(out) if g_out is None else g_out.contiguous()
        grads = _backward(ctx.pb, q, k, v, r, u, vb, out, lse, g_out, g_lse)
        return (*grads, None, None, None)


def _pow2_at_least_16(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def fused_relative(q, k, v, r_rows, u, vb, s0, mask, scale):
    """q [n,B,Q,dh], k, v [n,B,K,dh], r_rows [n,W,dh], u, vb [n,dh], mask [Q,K] bool (True = hidden) ->
    (context [n,B,Q,dh] in q's dtype, log-normaliser [n,B,Q] fp32) of score[i,j] = ((q_i+u).k_j +
    (q_i+vb).r_rows[s0-i+j]) * scale. A d_head that is not a power of two (>= 16) is zero-padded to one (zeros
    change no dot product) and the context cut back."""
    check_device(q.device)
    dh = q.size(-1)
    width = _pow2_at_least_16(dh)
    if width != dh:
        q, k, v, r_rows, u, vb = (F.pad(t, (0, width - dh)) for t in (q, k, v, r_rows, u, vb))
    out, lse = _FusedRelative.apply(q, k, v, r_rows, u, vb, mask, s0, scale)
    return out[..., :dh], lse


def fused_causal_attention(q, k, v, r, u, vb, mask, scale, drop=None, lse="grad", masking=None):
    """causal_attention (megamemo/model/attention.py) through the fused kernels; `masking` is not used (the mask is
    applied in the kernel). With attention dropout active it is causal_attention itself."""
    if _drops(drop):
        kw = {} if masking is None else {"masking": masking}
        return causal_attention(q, k, v, r, u, vb, mask, scale, drop, lse, **kw)
    L, klen = q.size(2), k.size(2)
    out, norm = fused_relative(q, k, v, _rows(r, klen + 1), u, vb, L - 1, mask, scale)
    return select_lse(out, norm, lse)


def fused_lookahead_attention(qm, k, v, r_fut, u, vf, mask, scale, drop=None, lse="grad", masking=None):
    """lookahead_attention (megamemo/model/attention.py) through the fused kernels; as fused_causal_attention."""
    if _drops(drop):
        kw = {} if masking is None else {"masking": masking}
        return lookahead_attention(qm, k, v, r_fut, u, vf, mask, scale, drop, lse, **kw)
    M, nk = qm.size(2), k.size(2)
    out, norm = fused_relative(qm, k, v, _rows(r_fut, M + 1), u, vf, M - nk, mask, scale)
    return select_lse(out, norm, lse)
