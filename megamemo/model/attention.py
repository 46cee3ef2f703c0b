"""Relative-position attention as functions of tensors.

Layout inside these functions is head-major, [heads, batch, time, d_head]; `heads` is whatever number of heads
the caller holds (all of them on one device, a slice of them under tensor parallelism). Head-major lets the
position term of all streams of a head be one [batch*time, d_head] @ [d_head, P] product with that head's R
(batch-major would broadcast R over the batch: a copy of R per stream, and small products). Scores are masked,
normalised and turned into log-normalisers in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS_INTERP = 1e-6  # the reference's epsilon in the interpolation weight's denominator


# The eager position products have klen + 1 (or M + 1) columns, e.g. 1025 and 513: GEMMs of such widths miss the
# tensor cores' aligned tiles (measured ~4.5x slower than aligned ones on an H200). On CUDA the rows of R are taken
# up to the next multiple of ROW_ALIGN: exact, because the added columns of the product are read by rel_shift only
# for hidden pairs (a visible pair reads column s0 - i + j <= klen - 1). Not on the CPU, where the extra columns
# would be work for nothing (a tiny model's 33 rows would become 64).
ROW_ALIGN = {"cuda": 64}


def _rows(r: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of r [heads, P, dh], zero-padded at the end when P < n (a copy only then)."""
    return r[:, :n] if r.size(1) >= n else F.pad(r, (0, 0, 0, n - r.size(1)))


def _aligned_rows(r: torch.Tensor, n: int) -> torch.Tensor:
    """_rows(r, n) with n rounded up to a multiple of ROW_ALIGN on r's device (see there)."""
    align = ROW_ALIGN.get(r.device.type, 1)
    return _rows(r, -(-n // align) * align)


def rel_shift(buf: torch.Tensor, s0: int, width: int) -> torch.Tensor:
    """buf [..., Q, W] contiguous -> the view out[..., i, j] = buf[..., i, s0 - i + j], shape [..., Q, width].

    The skewed diagonal of a relative-position score matrix, read through strides instead of a padded copy or
    a gather: element (i, j) sits at flat offset i*(W-1) + s0 + j of its matrix, so rows step by W-1. Where
    s0 - i + j falls outside [0, W) the view reads a neighbouring row's element: callers mask those pairs.
    Needs width <= W-1 (rows do not overlap) and (Q-1)*(W-1) + s0 + width <= Q*W (stays inside the matrix)."""
    Q, W = buf.shape[-2:]
    if not buf.is_contiguous() or width > W - 1 or (Q - 1) * (W - 1) + s0 + width > Q * W or s0 < 0:
        raise ValueError(
            f"rel_shift of {tuple(buf.shape)} (contiguous {buf.is_contiguous()}) "
            f"by {s0} to width {width} would leave the matrix"
        )
    # torch.compile cannot trace storage_offset(): there the buffer is a fresh product (offset 0, as every caller's)
    base = 0 if torch.compiler.is_compiling() else buf.storage_offset()
    return buf.as_strided((*buf.shape[:-2], Q, width), (*buf.stride()[:-2], W - 1, 1), base + s0)


class _SoftmaxLSE(torch.autograd.Function):
    """softmax over the last dim and its log-normaliser, both differentiable; d lse / d score = softmax."""

    @staticmethod
    def forward(ctx, score):
        prob = torch.softmax(score, dim=-1)
        ctx.save_for_backward(prob)
        return prob, _lse_from(score, prob)

    @staticmethod
    def backward(ctx, g_prob, g_lse):
        (prob,) = ctx.saved_tensors
        if g_prob is None:
            return prob * g_lse.unsqueeze(-1)
        shift = (g_prob * prob).sum(-1, keepdim=True)
        if g_lse is not None:
            shift = shift - g_lse.unsqueeze(-1)
        return (g_prob - shift).mul_(prob)


def _lse_from(score, prob):
    """log sum exp(score) over the last dim, read off its softmax at the top score a: score_a - log(prob_a),
    exact because prob_a = exp(score_a - lse) >= 1/K. Two cheap max-reductions instead of an exponential pass."""
    return score.amax(-1) - prob.amax(-1).log()


def _position_term(qs, bias_s, r_rows):
    """(qs + bias_s) @ r_rows^T per head: qs [n,B,Q,dh], bias_s [n,dh], r_rows [n,W,dh] -> [n,B,Q,W] contiguous."""
    n, B, Q, dh = qs.shape
    x = (qs + bias_s[:, None, None]).reshape(n, B * Q, dh)
    return torch.bmm(x, r_rows.transpose(1, 2)).view(n, B, Q, r_rows.size(1))


def mask_scores(score, mask):
    """score [..., Q, K] (fp32, changed in place) with the hidden pairs (mask [Q, K] True) at -inf: torch's
    masked_fill. The attention functions take another form as `masking` (megamemo.kernels: a cheaper one on CPU)."""
    return score.masked_fill_(mask, float("-inf"))


def _normalise(score, mask, v, drop, lse, masking=mask_scores):
    """score [n,B,Q,K] (a fresh tensor, any dtype) -> (context [n,B,Q,dh] in v's dtype, log-normaliser [n,B,Q]
    fp32). mask [Q,K] bool (True = hidden) is applied by `masking`; every row keeps at least one key. `drop`
    (attention dropout, a module or None) is applied to the probabilities, not to the normaliser. lse: "grad" (a
    differentiable normaliser), "value" (for detached caches: no autograd), "none" (not needed).

    Not torch's scaled_dot_product_attention: LaMemo's look-ahead and memory interpolation need each row's
    log-normaliser, which it does not return, and attention dropout is a module here (under tensor parallelism
    it draws from the rank's own stream). Where neither is needed causal_attention uses it (_fused_causal)."""
    score = masking(score.float(), mask)
    norm = None
    if lse == "grad":
        prob, norm = _SoftmaxLSE.apply(score)
    else:
        prob = torch.softmax(score, dim=-1)
        if lse == "value":
            with torch.no_grad():
                norm = _lse_from(score, prob)
    prob = prob.to(v.dtype)
    if drop is not None:
        prob = drop(prob)
    return prob @ v, norm


def select_lse(out, lse, want):
    """(out, the log-normaliser as a call asked for it): "grad" as computed, "value" detached, "none" None. For the
    fused forms (megamemo/kernels), which always compute it."""
    if want == "grad":
        return out, lse
    return out, (lse.detach() if want == "value" else None)


def causal_attention(q, k, v, r, u, vb, mask, scale, drop=None, lse="grad", masking=mask_scores):
    """Transformer-XL relative attention of L current queries over klen = M + L keys.

    q [n,B,L,dh]; k, v [n,B,klen,dh]; r [n,>=klen,dh]: R row c holds distance klen-1-c (rows past klen are
    ignored); u, vb [n,dh] content and position biases; mask [L,klen] bool (True = hidden, at least every
    future key); masking applies it (see mask_scores). score[i,j] = ((q_i+u).k_j + (q_i+vb).R(dist(i,j))) * scale
    (the scale applied to the queries).
    Query i (position M+i) and key j are M+i-j apart: R row L-1-i+j, a skewed diagonal read with rel_shift from
    the products with klen+1 rows of R (the one past klen only ever meets masked future keys).
    With the plain masking, no normaliser asked for (lse="none": Transformer-XL's layers) and no attention
    dropout drawn, torch's scaled_dot_product_attention computes it (_fused_causal).
    """
    if lse == "none" and masking is mask_scores and not _drops(drop):
        return _fused_causal(q, k, v, r, u, vb, mask, scale), None
    return _normalise(causal_scores(q, k, r, u, vb, scale), mask, v, drop, lse, masking)


def _drops(drop) -> bool:
    """Whether the attention-dropout module (or None) would drop anything now."""
    return drop is not None and drop.training and drop.p > 0


def _fused_causal(q, k, v, r, u, vb, mask, scale):
    """causal_attention's context by torch's scaled_dot_product_attention: the content term (q+u).k is its own
    product, the position term (q+vb).R and the mask are its additive attn_mask (in q's dtype, as it requires).
    Its memory-efficient kernel on CUDA keeps no [L,klen] probabilities for the backward."""
    L, klen = q.size(2), k.size(2)
    bd = _position_term(q * scale, vb * scale, _aligned_rows(r, klen + 1))
    bias = rel_shift(bd, L - 1, klen).masked_fill(mask, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q + u[:, None, None], k, v, attn_mask=bias, scale=scale)


def causal_scores(q, k, r, u, vb, scale):
    """The unmasked scores [n,B,L,klen] of causal_attention (arguments as there)."""
    L, klen = q.size(2), k.size(2)
    qs = q * scale
    ac = (qs + (u * scale)[:, None, None]) @ k.transpose(-1, -2)
    bd = _position_term(qs, vb * scale, _aligned_rows(r, klen + 1))
    return ac.add_(rel_shift(bd, L - 1, klen))


def lookahead_attention(qm, k, v, r_fut, u, vf, mask, scale, drop=None, lse="grad", masking=mask_scores):
    """LaMemo's look-ahead: M memory queries attend to the Nk keys at positions [M-Nk+1, M] that lie after them.

    qm [n,B,M,dh]; k, v [n,B,Nk,dh]; r_fut [n,>=M,dh]: row t holds future distance t+1; vf [n,dh] the look-ahead
    position bias; mask [M,Nk] (True where key <= query). Memory query i and key k (position M-Nk+1+k) are
    M-Nk+1+k-i apart: R_fut row M-Nk-i+k, read with rel_shift from the products with M+1 rows of R_fut.
    """
    M, nk = qm.size(2), k.size(2)
    qs = qm * scale
    ac = (qs + (u * scale)[:, None, None]) @ k.transpose(-1, -2)
    bd = _position_term(qs, vf * scale, _aligned_rows(r_fut, M + 1))
    return _normalise(ac.add_(rel_shift(bd, M - nk, nk)), mask, v, drop, lse, masking)


def interpolate(c_old, s_old, a, s_new):
    """Merge the cached context c_old (log-normaliser s_old) with the look-ahead context a (s_new), in log space.

    alpha = exp(s_old) / (exp(s_old) + exp(s_new) + eps), shifted by the max so nothing overflows; the merged
    log-normaliser is the exact logaddexp. c_old, a [..., dh] in one layout (the layer passes time-major
    [M,B,n,dh]); s_old, s_new fp32 with that layout less dh.
    Returns (merged context in a's dtype, merged log-normaliser fp32).
    """
    alpha = memorizing_coefficient(s_old, s_new).unsqueeze(-1).float()
    merged = torch.lerp(a.float(), c_old.float(), alpha)  # alpha*c_old + (1-alpha)*a, one fused op
    return _NanToNum.apply(merged).to(a.dtype), torch.logaddexp(s_old.float(), s_new)


class _NanToNum(torch.autograd.Function):
    """torch.nan_to_num (NaN -> 0, +-inf -> +-max) with the same gradient (passed where x is finite, else 0),
    read off x == nan_to_num(x) in one comparison written as floats. torch's own backward builds isfinite(x)
    in three passes and converts the bool mask to floats, twice the time of the whole forward+backward here."""

    @staticmethod
    def forward(ctx, x):
        y = torch.nan_to_num(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        if torch.compiler.is_compiling():  # compiled: one fused elementwise kernel (no out= there)
            return (x == y).to(g.dtype) * g
        return torch.eq(x, y, out=torch.empty_like(g)).mul_(g)


def memorizing_coefficient(s_old, s_new):
    """alpha per memory row (the paper's Figure 6 quantity), fp32, in the layout of s_old and s_new."""
    s_old = s_old.float()
    c = torch.maximum(s_old, s_new)
    ea, eb = torch.exp(s_old - c), torch.exp(s_new - c)
    return ea / (ea + eb + EPS_INTERP)
