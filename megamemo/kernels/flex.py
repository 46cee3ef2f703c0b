"""LaMemo's two attentions through FlexAttention (torch.nn.attention.flex_attention): one fused kernel per call
that never writes the [Q, K] scores to memory, forward and backward, with the log-normaliser and its gradient.

Same signatures and results as megamemo.model.attention.causal_attention / lookahead_attention (the eager
form, which states the maths); swapped into RelAttention by `apply_attention` (model.attention). The score
    score[i, j] = ((q_i + u) . k_j + (q_i + v_b) . R[s0 - i + j]) * scale,   hidden where mask[i, j]
becomes:
  * the content term: flex's own q.k, with q + u as the query (flex applies the scale);
  * the position term: bd = (q + v_b) . R^T * scale, one product per call [n, B, Q, W], read by `score_mod` at
    the skewed index s0 - i + j (the eager path's rel_shift becomes an index; clamped where the pair is hidden);
  * the mask: a boolean lookup in `score_mod` (-inf where hidden), so any mask the eager path takes (causal,
    same_length, look-ahead) is the same here.
The head-major layout [n, B, T, dh] is passed as flex's [batch, heads, T, dh] (n as its batch, B as its heads):
score_mod's (b, h) index bd the same way.

FlexAttention is a compiled kernel: on CUDA a call outside a compiled region goes through a compiled
flex_attention (TorchDynamo must be on: megamemo.kernels.compiler.enable_compiler); inside a compiled layer
(train.compile) dynamo compiles it with the layer. On the CPU it runs its reference implementation, forward only
(torch 2.13 has no CPU backward): eval, generate and the probe can use it, training cannot. Attention dropout
(model.dropatt > 0 in training) is not expressible as a score_mod: a call that would drop runs the eager form.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9
    AuxRequest = None  # type: ignore[assignment,misc]  # absent there: None says so to the callers

from megamemo.model.attention import _drops, _rows, causal_attention, lookahead_attention, select_lse

from .compiler import enable_compiler


@functools.cache
def _compiled_flex():
    enable_compiler()
    return torch.compile(flex_attention, dynamic=False)


def _flex_call(device_type: str):
    if torch.compiler.is_compiling() or device_type == "cpu":
        return flex_attention  # compiled with the enclosing region / the CPU's reference form
    return _compiled_flex()


def flex_relative(q, k, v, r_rows, u, vb, s0, mask, scale):
    """q [n,B,Q,dh], k, v [n,B,K,dh], r_rows [n,W,dh], u, vb [n,dh], mask [Q,K] bool (True = hidden) ->
    (context [n,B,Q,dh] in q's dtype, log-normaliser [n,B,Q] fp32) of the score in the module docstring."""
    W = r_rows.size(1)
    bd = torch.matmul((q + vb[:, None, None]) * scale, r_rows.transpose(1, 2)[:, None])  # [n, B, Q, W]

    def score_mod(score, b, h, i, j):
        pos = bd[b, h, i, (s0 - i + j).clamp(0, W - 1)]
        # -inf as a Python scalar: a captured 0-d tensor becomes a constant buffer inductor cannot lower inside a
        # compiled layer (seen on an H200: "ShapeAsConstantBuffer object has no attribute dtype")
        return torch.where(mask[i, j], float("-inf"), score + pos.to(score.dtype))

    flex = _flex_call(q.device.type)
    query = q + u[:, None, None].to(q.dtype)
    with warnings.catch_warnings():  # the CPU's reference form says it is not the fused kernel: known
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if AuxRequest is not None:  # torch >= 2.9's form; return_lse is deprecated there
            out, aux = flex(query, k, v, score_mod=score_mod, scale=scale, return_aux=AuxRequest(lse=True))
            return out, aux.lse
        return flex(query, k, v, score_mod=score_mod, scale=scale, return_lse=True)


def flex_causal_attention(q, k, v, r, u, vb, mask, scale, drop=None, lse="grad", masking=None):
    """causal_attention (megamemo/model/attention.py) through FlexAttention; `masking` is not used (the mask is
    applied in the kernel). With attention dropout active it is causal_attention itself."""
    if _drops(drop):
        kw = {} if masking is None else {"masking": masking}
        return causal_attention(q, k, v, r, u, vb, mask, scale, drop, lse, **kw)
    L, klen = q.size(2), k.size(2)
    out, norm = flex_relative(q, k, v, _rows(r, klen + 1), u, vb, L - 1, mask, scale)
    return select_lse(out, norm, lse)


def flex_lookahead_attention(qm, k, v, r_fut, u, vf, mask, scale, drop=None, lse="grad", masking=None):
    """lookahead_attention (megamemo/model/attention.py) through FlexAttention; as flex_causal_attention."""
    if _drops(drop):
        kw = {} if masking is None else {"masking": masking}
        return lookahead_attention(qm, k, v, r_fut, u, vf, mask, scale, drop, lse, **kw)
    M, nk = qm.size(2), k.size(2)
    out, norm = flex_relative(qm, k, v, _rows(r_fut, M + 1), u, vf, M - nk, mask, scale)
    return select_lse(out, norm, lse)
