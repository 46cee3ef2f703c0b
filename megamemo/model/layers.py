"""Decoder layers: relative multi-head attention (XL or LaMemo) + position-wise feed-forward."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import causal_attention, interpolate, lookahead_attention, mask_scores, memorizing_coefficient
from .positions import lookahead_mask


class ReluDropout(nn.Dropout):
    """The feed-forward's activation and its dropout: F.dropout(F.relu(x)). One module, so that a kernel may do
    both in one pass (megamemo.kernels.dropout.CpuDropout(relu=True) on the CPU)."""

    def forward(self, x):
        return F.dropout(F.relu(x), self.p, self.training, self.inplace)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_inner)
        self.fc2 = nn.Linear(d_inner, d_model)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop_inner = ReluDropout(dropout)  # ReLU, then dropout on the d_inner activation (split under TP)
        self.drop = nn.Dropout(dropout)
        self.pre_lnorm = pre_lnorm

    def forward(self, x):
        if self.pre_lnorm:
            return x + self.drop(self.fc2(self.drop_inner(self.fc1(self.layer_norm(x)))))
        return self.layer_norm(x + self.drop(self.fc2(self.drop_inner(self.fc1(x)))))


def project_split(x, weight, q_rows):
    """x [T, B, d] and a [Q; K; V] weight -> (queries of the last q_rows rows, [K; V] of all rows)."""
    nd = weight.size(0) // 3
    return F.linear(x[x.size(0) - q_rows :], weight[:nd]), F.linear(x, weight[nd:])


class FusedQKV(nn.Linear):
    """The [Q; K; V] projection, one weight. `split(x, q_rows)` projects queries for the last q_rows rows only
    (Transformer-XL's memory rows are never queries) and keys/values for all; the tensor-parallel form keeps
    this method (parallel/tensor.py)."""

    def split(self, x, q_rows):
        return project_split(x, self.weight, q_rows)


class RelAttention(nn.Module):
    """Projections of one attention block. q, k, v come from one fused weight laid out [Q; K; V], each
    head-major (feature h*d_head + e belongs to head h); `n_head` is the number of heads this module holds."""

    def __init__(self, d_model, n_head, d_head, dropout, dropatt, pre_lnorm):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.qkv = FusedQKV(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        # on attention probabilities (per head: split across ranks under TP): the current queries' attention, and
        # LaMemo's look-ahead of the memory queries (a site of its own: keyed masks tell the two apart)
        self.dropatt = nn.Dropout(dropatt)
        self.dropatt_ahead = nn.Dropout(dropatt)
        self.masking = mask_scores  # how scores are masked (attention.mask_scores; megamemo.kernels may swap it)
        # the attention functions (attention.py's eager ones; megamemo.kernels may swap in fused forms with the
        # same signatures and results, e.g. FlexAttention: model.attention)
        self.causal, self.lookahead = causal_attention, lookahead_attention
        self.pre_lnorm = pre_lnorm
        self.scale = 1.0 / math.sqrt(d_head)

    def heads(self, x, q_rows=None):
        """[T, B, d] -> q, k, v each [n, B, T, dh], contiguous (one copy; time slices of them are then plain
        strided batches for the products, never copied again). q_rows: queries for the last q_rows rows only."""
        T, B, _ = x.shape
        x = self.layer_norm(x) if self.pre_lnorm else x
        if q_rows is None or q_rows == T:
            qkv = self.qkv(x)
            return qkv.view(T, B, 3, self.n_head, self.d_head).permute(2, 3, 1, 0, 4).contiguous().unbind(0)
        q, kv = self.qkv.split(x, q_rows)
        q = q.view(q_rows, B, self.n_head, self.d_head).permute(2, 1, 0, 3).contiguous()
        k, v = kv.view(T, B, 2, self.n_head, self.d_head).permute(2, 3, 1, 0, 4).contiguous().unbind(0)
        return q, k, v

    def rel(self, pos_emb):
        """[P, d] sinusoids -> [n, P, dh]."""
        return self.r_net(pos_emb).view(-1, self.n_head, self.d_head).transpose(0, 1)

    def output(self, x, ctx):
        """Residual + o_net over context rows ctx [T, B, n, dh] (time-major, any strides) aligned with x [T, B, d]."""
        T, B, n, dh = ctx.shape
        out = self.drop(self.o_net(ctx.reshape(T, B, n * dh)))
        return x + out if self.pre_lnorm else self.layer_norm(x + out)


def _time_major(ctx, lse):
    """[n,B,T,dh], [n,B,T] (attention's layout) -> [T,B,n,dh], [T,B,n] views (the caches' and o_net's layout)."""
    return ctx.permute(2, 1, 0, 3), (None if lse is None else lse.permute(2, 1, 0))


class XLLayer(nn.Module):
    """Transformer-XL layer: memory = this layer's input at previous segments. `index`: its place in the model
    (0 = the lowest layer), a coordinate of its dropout masks in keyed mode (megamemo/kernels/keyed.py)."""

    def __init__(self, cfg, index: int = 0):
        super().__init__()
        self.index = index
        self.attn = RelAttention(cfg.d_model, cfg.n_head, cfg.d_head, cfg.dropout, cfg.dropatt, cfg.pre_lnorm)
        self.ff = FeedForward(cfg.d_model, cfg.d_inner, cfg.dropout, cfg.pre_lnorm)

    def forward(self, h, mem, pos_emb, u, vb, mask, attend=None):
        """attend: optional replacement of the current queries' attention (see MemTransformerLM.forward)."""
        L = h.size(0)
        cat = h if mem is None or mem.size(0) == 0 else torch.cat([mem, h], 0)
        klen = cat.size(0)
        q, k, v = self.attn.heads(cat, q_rows=L)  # memory rows are keys and values only
        r = self.attn.rel(pos_emb)
        if attend is None:
            ctx, _ = self.attn.causal(
                q, k, v, r, u, vb, mask, self.attn.scale, self.attn.dropatt, lse="none", masking=self.attn.masking
            )
        else:
            ctx, _ = attend(q, k, v, klen - L, r, mask)
        return self.ff(self.attn.output(h, _time_major(ctx, None)[0]))


class LaMemoLayer(nn.Module):
    """LaMemo layer: recomputes the memory rows' states from the layer below, refreshes their context with
    look-ahead attention and merges it with the cached context (memory interpolation). `index`: as XLLayer's."""

    def __init__(self, cfg, index: int = 0):
        super().__init__()
        self.index = index
        self.attn = RelAttention(cfg.d_model, cfg.n_head, cfg.d_head, cfg.dropout, cfg.dropatt, cfg.pre_lnorm)
        self.ff = FeedForward(cfg.d_model, cfg.d_inner, cfg.dropout, cfg.pre_lnorm)
        self.variant = cfg.variant

    def forward(
        self, cat, M, ctx_old, lse_old, pos_emb, u, vb, vf, mask, mem_len, attend=None, observe=None, mem_rows_out=True
    ):
        """cat [M+L,B,d]: the M memory rows' states at this layer, then the current rows; ctx_old [M,B,n,dh] and
        lse_old [M,B,n] (fp32) the caches; pos_emb [klen+M, d]. Returns (cat', ctx_new, lse_new): the next
        layer's rows in the same layout, and the caches (the last mem_len rows of [memory; current], detached).
        mem_rows_out=False (the top layer, whose memory rows' states nothing reads) returns only the L current
        rows: the memory rows skip o_net and the feed-forward, and also the look-ahead and interpolation when
        the new caches keep none of them (mem_len <= L) and nothing observes them. Values and gradients of what
        is returned are unchanged. attend / observe: see MemTransformerLM.forward."""
        klen = cat.size(0)
        L = klen - M
        beg = max(0, klen - mem_len)  # the new caches' first row
        dev = cat.device
        q, k, v = self.attn.heads(cat)
        q_mem, q_cur = q.split([M, L], 2)  # a split's backward is one cat; two slices would zero-fill q twice
        r = self.attn.rel(pos_emb)
        if attend is None:
            ctx, lse = self.attn.causal(
                q_cur, k, v, r, u, vb, mask, self.attn.scale, self.attn.dropatt, lse="value", masking=self.attn.masking
            )
        else:
            ctx, lse = attend(q_cur, k, v, M, r, mask)
        ctx, lse = _time_major(ctx, lse)
        first = M  # ctx, lse hold rows [first, klen)
        if M and (mem_rows_out or beg < M or observe is not None):
            if self.variant == "lamemo_no_lookahead":
                c_mem, s_mem = ctx_old.to(ctx.dtype), lse_old.float()
            else:
                nk = min(M, L)
                a, s_la = self.attn.lookahead(
                    q_mem,
                    k[:, :, M - nk + 1 : M + 1],
                    v[:, :, M - nk + 1 : M + 1],
                    r[:, klen:],
                    u,
                    vf,
                    lookahead_mask(M, nk, dev),
                    self.attn.scale,
                    self.attn.dropatt_ahead,
                    masking=self.attn.masking,
                )
                a, s_la = _time_major(a, s_la)
                if self.variant == "lamemo_no_interp":
                    c_mem, s_mem = a, s_la
                else:
                    c_mem, s_mem = interpolate(ctx_old, lse_old, a, s_la)
                if observe is not None:
                    observe(kind="alpha", alpha=memorizing_coefficient(lse_old, s_la).permute(1, 2, 0))
            ctx = torch.cat([c_mem, ctx], 0)  # one copy, already in o_net's row order
            lse = torch.cat([s_mem, lse], 0)
            first = 0
        if mem_rows_out:
            out = self.ff(self.attn.output(cat, ctx))
        else:
            out = self.ff(self.attn.output(cat[M:], ctx[M - first :]))
        ctx_new = ctx[beg - first :].detach()
        lse_new = lse[beg - first :].detach()
        if torch.compiler.is_compiling():  # one stride for every producer of the caches: no recompile on it
            ctx_new, lse_new = ctx_new.contiguous(), lse_new.contiguous()
        return out, ctx_new, lse_new
