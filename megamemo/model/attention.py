"""Relative-position attention as functions of tensors.

Layout inside these functions is [batch, heads, time, d_head]; `heads` is whatever number of heads the caller
holds (all of them on one device, a slice of them under tensor parallelism). Scores are masked, normalised and
turned into log-normalisers in fp32 whatever the input dtype.
"""
from __future__ import annotations

import torch

EPS_INTERP = 1e-6  # the reference's epsilon in the interpolation weight's denominator


def _expand(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index.expand(like.shape[0], like.shape[1], *index.shape)


def _normalise(score, mask, v, drop, lse):
    """score [B,n,Q,K] (a fresh tensor, any dtype) -> (context [B,n,Q,dh] in v's dtype, log-normaliser [B,n,Q]
    fp32). `drop` (attention dropout, a module or None) is applied to the probabilities, not to the normaliser.
    lse: "grad" (a differentiable normaliser), "value" (for detached caches: no autograd), "none" (not needed)."""
    score = score.float().masked_fill_(mask, float("-inf"))
    prob = torch.softmax(score, dim=-1).to(v.dtype)
    if lse == "grad":
        norm = torch.logsumexp(score, dim=-1)
    elif lse == "value":
        with torch.no_grad():
            norm = torch.logsumexp(score, dim=-1)
    else:
        norm = None
    if drop is not None:
        prob = drop(prob)
    return prob @ v, norm


def causal_attention(q, k, v, r, u, vb, mask, rel_index, scale, drop=None, lse="grad"):
    """Transformer-XL relative attention of L current queries over klen = M + L keys.

    q [B,n,L,dh]; k, v [B,n,klen,dh]; r [n,klen,dh]: R row c holds distance klen-1-c; u, vb [n,dh] content and
    position biases; mask [L,klen] bool (True = hidden); rel_index [L,klen]: the R row for each (query, key).
    score[i,j] = ((q_i+u).k_j + (q_i+vb).R(dist(i,j))) * scale  (the scale applied to the queries).
    """
    qs = q * scale
    ac = (qs + u[:, None] * scale) @ k.transpose(-1, -2)
    bd = ((qs + vb[:, None] * scale) @ r.transpose(-1, -2)).gather(-1, _expand(rel_index, q))
    return _normalise(ac.add_(bd), mask, v, drop, lse)


def lookahead_attention(qm, k, v, r_fut, u, vf, t_index, mask, scale, drop=None, lse="grad"):
    """LaMemo's look-ahead: M memory queries attend to the Nk keys at positions [M-Nk+1, M] that lie after them.

    qm [B,n,M,dh]; k, v [B,n,Nk,dh]; r_fut [n,M,dh]: row t holds future distance t+1; vf [n,dh] the look-ahead
    position bias; t_index [M,Nk] the R_fut row per (query, key); mask [M,Nk] (True where key <= query).
    """
    qs = qm * scale
    ac = (qs + u[:, None] * scale) @ k.transpose(-1, -2)
    bd = ((qs + vf[:, None] * scale) @ r_fut.transpose(-1, -2)).gather(-1, _expand(t_index, qm))
    return _normalise(ac.add_(bd), mask, v, drop, lse)


def interpolate(c_old, s_old, a, s_new):
    """Merge the cached context c_old (log-normaliser s_old) with the look-ahead context a (s_new), in log space.

    alpha = exp(s_old) / (exp(s_old) + exp(s_new) + eps), shifted by the max so nothing overflows; the merged
    log-normaliser is the exact logaddexp. c_old, a [B,n,M,dh]; s_old, s_new [B,n,M] fp32.
    Returns (merged context in a's dtype, merged log-normaliser fp32).
    """
    alpha = memorizing_coefficient(s_old, s_new).unsqueeze(-1)
    merged = alpha * c_old.float() + (1.0 - alpha) * a.float()
    return torch.nan_to_num(merged).to(a.dtype), torch.logaddexp(s_old.float(), s_new)


def memorizing_coefficient(s_old, s_new):
    """alpha per memory row (the paper's Figure 6 quantity), [B,n,M] fp32."""
    s_old = s_old.float()
    c = torch.maximum(s_old, s_new)
    ea, eb = torch.exp(s_old - c), torch.exp(s_new - c)
    return ea / (ea + eb + EPS_INTERP)
