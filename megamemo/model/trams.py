"""TRAMS (training-free memory selection) at evaluation, and an inspectable forward pass, on the model's weights.

TRAMS (lwaekfjlk/TRAMS, spec §6.2), per layer, head and stream:
  * the memory cache is a FIFO *pool* of `pool` rows (TRAMS's mem_len);
  * the newest `recent` memory rows (remain_mem_num) and the current segment are always attended;
  * of the older pool rows (the candidates), the `attend - recent` (topk_num) with the highest score of their
    reformulated key K'_j = W_Q^(h)^T k_j^(h) (a d_model vector, so q_i.k_j = x_i.K'_j) are attended too,
    in chronological order;
  * the score is the reference code's ||K'||_2 * |sum_k K'_k| (metric="code") or the paper's
    cos<K', 1> * ||K'|| = sum_k K'_k / sqrt(d) (metric="paper"); only the content key enters it;
  * the attended keys get compressed relative positions: the selected rows sit right before the recent ones,
    as if the attended memory were contiguous (slot t of A attended rows is at distance A + i - t from query i).
The cache keeps every pool row; selection is redone at every segment. clamp_len applies to the compressed
distances; same_length limits each query to `attend` keys. With attend == pool nothing is dropped and
the result is the plain model with mem_len = pool, bit for bit (tests/model/test_trams.py).

TRAMS for LaMemo (an option no paper has tried; our definition). LaMemo's memory is the embedding FIFO E and per
layer the context cache C and its log-normaliser S, and the memory rows' states are recomputed every segment.
Selection here restricts only what the *current* tokens attend to: at each layer the current queries see the
selected pool rows + the newest `recent` rows + the current segment (compressed positions as above). The
look-ahead is untouched: every pool row is still refreshed by look-ahead attention to the newest tokens (true
future distances), interpolated with its cached C/S and written back, so the caches of all `pool` rows are
exactly those of plain LaMemo with mem_len = pool - including rows a query skipped. The extra cost over plain
LaMemo with mem_len = attend is the look-ahead over the larger pool (linear in the pool size).

`forward(model, inp, tgt, mem, select=..., observe=...)` runs the model's own modules and attention functions
layer by layer (a re-implementation of MemTransformerLM.encode that the tests hold bit-equal to it) with two
optional extras: key selection (`select`, a TramsConfig) and an observer called with the attention
probabilities and LaMemo's memorizing coefficient of every layer (used by `megamemo analyze`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megamemo.model import Memory, MemTransformerLM
from megamemo.model.attention import causal_attention, causal_scores
from megamemo.model.lengths import Lengths
from megamemo.model.positions import causal_mask, position_sequence, sinusoid
from megamemo.util.errors import UsageError

METRICS = ("code", "paper")


@dataclass
class TramsConfig:
    pool: int  # memory rows cached (TRAMS mem_len)
    attend: int  # memory rows each query attends: recent + selected (remain_mem_num + topk_num)
    recent: int  # newest memory rows always attended (remain_mem_num)
    metric: str = "code"  # code: ||K'|| * |sum K'| (the reference code) | paper: sum K' / sqrt(d)

    @property
    def topk(self) -> int:
        return self.attend - self.recent

    def validate(self) -> TramsConfig:
        if not 0 <= self.recent <= self.attend <= self.pool:
            raise UsageError(f"trams: need 0 <= recent ({self.recent}) <= attend ({self.attend}) <= pool ({self.pool})")
        if self.metric not in METRICS:
            raise UsageError(f"trams.metric: must be one of {METRICS}, got {self.metric!r}")
        return self


# ---- the metric and the selection ------------------------------------------------------------------------------
def reformulated_keys(k: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """k [n,B,T,dh] content keys (head-major, as the attention functions), w_q [n*dh, d] the query weight
    -> K' [n,B,T,d] with K'_j = W_Q^(h)^T k_j^(h)."""
    n, B, T, dh = k.shape
    return torch.einsum("nbte,ned->nbtd", k.float(), w_q.float().view(n, dh, -1))


def key_scores(kp: torch.Tensor, metric: str = "code") -> torch.Tensor:
    """K' [..., d] -> score [...]: the reference code's ||K'|| * |sum K'| or the paper's cos<K',1> * ||K'||."""
    if metric == "code":
        return kp.norm(dim=-1) * kp.sum(-1).abs()
    if metric == "paper":
        return kp.sum(-1) / math.sqrt(kp.size(-1))
    raise UsageError(f"trams metric must be one of {METRICS}, got {metric!r}")


def select_rows(k_mem: torch.Tensor, w_q: torch.Tensor, cfg: TramsConfig) -> torch.Tensor | None:
    """Memory rows attended per (head, stream): k_mem [n,B,M,dh] the memory rows' keys -> index [n,B,A] in
    chronological order (selected old rows, then the newest `recent`), or None when all M rows are attended."""
    n, B, M, _ = k_mem.shape
    if M <= cfg.attend:
        return None
    n_cand = M - cfg.recent
    recent = torch.arange(n_cand, M, device=k_mem.device).expand(n, B, cfg.recent)
    if cfg.topk == 0:
        return recent
    scores = key_scores(reformulated_keys(k_mem[:, :, :n_cand], w_q), cfg.metric)
    chosen = scores.topk(cfg.topk, dim=-1).indices.sort(dim=-1).values
    return torch.cat([chosen, recent], -1)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [n,B,T,dh], index [n,B,K] -> [n,B,K,dh]."""
    return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.size(-1)))


def attention_probs(q, k, r, u, vb, mask, scale) -> torch.Tensor:
    """The causal attention's probabilities [n,B,L,klen] fp32 (what causal_attention weights v with), from
    q [n,B,L,dh] and k [n,B,klen,dh]."""
    return torch.softmax(causal_scores(q, k, r, u, vb, scale).float().masked_fill(mask, float("-inf")), dim=-1)


# ---- the forward pass ------------------------------------------------------------------------------------------
Observer = Callable[..., None]


class _Causal:
    """The current queries' attention of one layer, over all keys or over the selected memory rows."""

    def __init__(
        self,
        model: MemTransformerLM,
        select: TramsConfig | None,
        clamp_len: int,
        same_length: bool,
        observe: Observer | None,
    ):
        self.model, self.select, self.observe = model, select, observe
        self.clamp_len, self.same_length = clamp_len, same_length

    def __call__(self, li, layer, q_cur, k, v, M, r_full, mask_full):
        """q_cur [n,B,L,dh]; k, v [n,B,M+L,dh]; r_full [n, >=M+L, dh] (rows: distance M+L-1 ... 0 first).
        -> (ctx [n,B,L,dh], lse [n,B,L]) of the current queries."""
        m = self.model
        L = q_cur.size(2)
        attn = layer.attn
        index = None
        if self.select is not None and M:
            w_q = attn.qkv.weight[: attn.n_head * attn.d_head]
            index = select_rows(k[:, :, :M], w_q, self.select)
        if index is None:
            kk, vv, mlen, r, mask = k, v, M, r_full, mask_full
        else:
            assert self.select is not None  # index is set only when selecting
            mlen = index.size(-1)
            cur = torch.arange(M, M + L, device=k.device).expand(*index.shape[:2], L)
            full = torch.cat([index, cur], -1)
            kk, vv = _gather_rows(k, full), _gather_rows(v, full)
            pos = position_sequence(mlen + L, mlen, self.clamp_len, None, k.device)
            r = attn.rel(m.drop_pos(sinusoid(pos, m.cfg.d_model, q_cur.dtype)))
            mask = causal_mask(L, mlen, self.select.attend, self.same_length, k.device)
        ctx, lse = causal_attention(
            q_cur,
            kk,
            vv,
            r,
            m.r_w_bias,
            m.r_r_bias,
            mask,
            attn.scale,
            attn.dropatt,
            lse="grad" if m.cfg.lamemo else "none",
            masking=attn.masking,
        )  # as the layer
        if self.observe is not None:  # observers see batch-major [B,n,...] (megamemo/eval/analyze.py)
            probs = attention_probs(q_cur, kk, r, m.r_w_bias, m.r_r_bias, mask, attn.scale)
            self.observe(
                layer=li,
                kind="causal",
                probs=probs.transpose(0, 1),
                mlen=mlen,
                index=None if index is None else index.transpose(0, 1),
            )
        return ctx, lse


def forward(
    model: MemTransformerLM,
    inp,
    tgt=None,
    mem: Memory | None = None,
    *,
    select: TramsConfig | None = None,
    mem_len: int | None = None,
    same_length: bool | None = None,
    clamp_len: int | None = None,
    observe: Observer | None = None,
):
    """Like `model(inp, tgt, mem, ...)`: (nll [L,B] or log-probs [L,B,V], new memory). With `select` the cache
    holds select.pool rows and the current tokens attend to the TRAMS selection of them. `observe(layer=, kind=,
    ...)` is called per layer with kind "causal" (probs [B,n,L,klen], mlen, index) and, for LaMemo, "alpha"
    (the memorizing coefficient [B,n,M] of the memory rows)."""
    cfg = model.cfg
    if select is not None:
        select.validate()
        if mem_len is not None and mem_len != select.pool:
            raise UsageError(f"mem_len {mem_len} conflicts with the TRAMS pool {select.pool}")
        if not cfg.has_memory:
            raise UsageError(f"TRAMS needs a model with memory; {cfg.variant!r} has none")
        mem_len = select.pool
    at = Lengths(mem=mem_len, clamp=clamp_len, same_length=same_length).resolve(cfg)
    same_length, clamp_len = at.same_length, at.clamp
    assert same_length is not None and clamp_len is not None  # resolve() takes the model's where None
    causal = _Causal(model, select, clamp_len, same_length, observe)
    return model(
        inp,
        tgt,
        mem,
        mem_len=mem_len,
        same_length=same_length,
        clamp_len=clamp_len,
        attend=lambda li, layer: functools.partial(causal, li, layer),
        observe=observe,
    )
