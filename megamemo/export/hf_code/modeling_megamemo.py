"""An exported megamemo model (LaMemo, Transformer-XL, Transformer+RPE, full or adaptive softmax) for Hugging Face
transformers, in plain torch. Self-contained: copied next to config.json by `megamemo export hf`, it needs only torch
and transformers. It restates megamemo's model (megamemo/model/) from its spec, with the same parameter names, so
megamemo's model.safetensors loads as it is.

Memory is the cache: `MegamemoCache`, passed as `cache=` (or `past_key_values=`), holds the recurrent memory
(Transformer-XL: every layer's input at the last mem_len positions; LaMemo: the embedding FIFO and each layer's
context cache and its log-normaliser). `model(input_ids, cache=c)` continues the stream that c has seen. A call's
input is cut into segments of `tgt_len` tokens (the training segment length), each one attending to the memory left
by the one before, as megamemo's evaluation does; `generate()` uses `generation_mem_len` (megamemo generate's
default, mem_len + tgt_len - 1) and one-token segments after the prompt. Inputs are [batch, time]; padding is not
supported (a stream's memory would hold the pads). `logits` are log-probabilities over the whole vocabulary (the
adaptive softmax has no single logit matrix); `labels` gives the mean next-token NLL within the call. A padded
vocabulary (config n_vocab < n_token) gives its padding ids log-probability -inf: they are never generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from .configuration_megamemo import MegamemoConfig

INTERP_EPS = 1e-6  # the epsilon in LaMemo's memory-interpolation weight


class MegamemoCache(Cache):
    """The recurrent memory of a batch of streams. `memory`: name -> time-major tensor [M, batch, ...];
    `seen`: tokens consumed so far (what generation asks as the sequence length); `window`: for the memory-less
    rpe variant while generating, the last tokens (it re-encodes them, as megamemo generate does)."""

    def __init__(self):
        super().__init__(layers=[])
        self.memory: dict[str, torch.Tensor] = {}
        self.seen = 0
        self.window: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def memory_length(self) -> int:
        return next(iter(self.memory.values())).size(0) if self.memory else 0

    def _map(self, fn):
        self.memory = {k: fn(v, 1) for k, v in self.memory.items()}
        if self.window is not None:
            self.window = fn(self.window, 0)

    def reorder_cache(self, beam_idx):
        self._map(lambda t, dim: t.index_select(dim, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int):
        self._map(lambda t, dim: t.repeat_interleave(repeats, dim=dim))

    def reset(self):
        self.memory, self.seen, self.window = {}, 0, None

    def crop(self, tokens_to_remove: int):
        if tokens_to_remove:
            raise NotImplementedError("a recurrent memory cannot be cropped")


@dataclass
class MegamemoOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: MegamemoCache | None = None  # also read as .past_key_values (transformers' alias)


# ---- layers ----------------------------------------------------------------------------------------------------
class AdaptiveEmbedding(nn.Module):
    def __init__(self, c: MegamemoConfig, d_embed: int):
        super().__init__()
        self.bounds = [0] + list(c.cutoffs) + [c.n_token]
        self.div_val, self.d_proj = c.div_val, c.d_model
        self.emb_layers, self.emb_projs = nn.ModuleList(), nn.ParameterList()
        if c.div_val == 1:
            self.emb_layers.append(nn.Embedding(c.n_token, d_embed))
            if c.d_model != d_embed:
                self.emb_projs.append(nn.Parameter(torch.zeros(c.d_model, d_embed)))
        else:
            for i in range(len(self.bounds) - 1):
                d_i = d_embed // c.div_val**i
                self.emb_layers.append(nn.Embedding(self.bounds[i + 1] - self.bounds[i], d_i))
                self.emb_projs.append(nn.Parameter(torch.zeros(c.d_model, d_i)))

    def forward(self, ids):
        if self.div_val == 1:
            e = self.emb_layers[0](ids)
            if len(self.emb_projs):
                e = e @ self.emb_projs[0].t()
        else:
            e = torch.zeros(*ids.shape, self.d_proj, dtype=self.emb_projs[0].dtype, device=ids.device)
            for i, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=True)):
                inside = (ids >= lo) & (ids < hi)
                if inside.any():
                    e[inside] = self.emb_layers[i](ids[inside] - lo) @ self.emb_projs[i].t()
        return e * math.sqrt(self.d_proj)


class AdaptiveSoftmax(nn.Module):
    """Full softmax (no cutoffs) or the projected adaptive softmax; the tied tables live in the embedding."""

    def __init__(self, c: MegamemoConfig, d_embed: int):
        super().__init__()
        self.bounds = [0] + list(c.cutoffs) + [c.n_token]
        self.n_vocab = c.n_vocab  # ids from n_vocab on are padding (None: none)
        n = len(self.bounds) - 1
        self.n_clusters, self.shortlist, self.div_val, self.tie_weight = n - 1, self.bounds[1], c.div_val, c.tie_weight
        ties = list(c.tie_projs)
        self.tie_projs = (ties + [ties[-1] if ties else False] * n)[:n]
        dims = [d_embed] if c.div_val == 1 else [d_embed // c.div_val**i for i in range(n)]
        self.out_weights = nn.ParameterList()
        if not c.tie_weight:
            for i, d_i in enumerate(dims):
                rows = c.n_token if c.div_val == 1 else self.bounds[i + 1] - self.bounds[i]
                self.out_weights.append(nn.Parameter(torch.zeros(rows, d_i)))
        self.out_bias = nn.Parameter(torch.zeros(c.n_token))
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.has_proj = not (c.div_val == 1 and c.d_model == d_embed)
        self.out_projs = nn.ParameterDict(
            {
                str(i): nn.Parameter(torch.zeros(c.d_model, dims[i if c.div_val > 1 else 0]))
                for i in range(n)
                if self.has_proj and not self.tie_projs[i]
            }
        )

    def _cluster(self, i, emb: AdaptiveEmbedding):
        lo, hi = self.bounds[i], self.bounds[i + 1]
        k = 0 if self.div_val == 1 else i  # div_val 1: one table, this cluster's rows of it
        table = emb.emb_layers[k].weight if self.tie_weight else self.out_weights[k]
        assert isinstance(table, torch.Tensor)
        w = table[lo:hi] if self.div_val == 1 else table
        p = None
        if self.has_proj:
            p = emb.emb_projs[0 if self.div_val == 1 else i] if self.tie_projs[i] else self.out_projs[str(i)]
        b = self.out_bias[lo:hi]
        if self.n_vocab is not None and hi > self.n_vocab:  # padding ids: bias -inf, probability 0
            keep = max(self.n_vocab - lo, 0)
            b = torch.cat([b[:keep], b.new_full((hi - lo - keep,), float("-inf"))])
        return w, b, p

    @staticmethod
    def _log_softmax(h, w, b, p):
        return F.log_softmax(F.linear(h if p is None else h @ p, w, b).float(), dim=-1)

    def log_probs(self, h, emb: AdaptiveEmbedding):
        """h [N, d_model] -> [N, n_token] log-probabilities, fp32."""
        w, b, p = self._cluster(0, emb)
        if not self.n_clusters:
            return self._log_softmax(h, w, b, p)
        head = self._log_softmax(h, torch.cat([w, self.cluster_weight]), torch.cat([b, self.cluster_bias]), p)
        out = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            out.append(
                head[:, self.shortlist + i - 1 : self.shortlist + i] + self._log_softmax(h, *self._cluster(i, emb))
            )
        return torch.cat(out, 1)


class Attention(nn.Module):
    def __init__(self, c: MegamemoConfig):
        super().__init__()
        self.n, self.dh, self.p_att, self.p = c.n_head, c.d_head, c.dropatt, c.dropout
        self.qkv = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.r_net = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(c.d_model)

    def project(self, x, part, rows=None):
        """x [T, B, d] -> part (0 q, 1 k, 2 v) of the last `rows` rows as [T', B, n, dh]."""
        x = x if rows is None else x[x.size(0) - rows :]
        w = self.qkv.weight.chunk(3, 0)[part]
        return F.linear(x, w).view(x.size(0), x.size(1), self.n, self.dh)

    def attend(self, q, k, v, r, u, vb, hidden):
        """Relative attention of queries q [Q,B,n,dh] over keys/values k, v [K,B,n,dh]. r = (rows [P,n,dh], index
        [Q,K]): the position embedding of pair (i, j) is rows[index[i, j]]; pairs where `hidden` [Q,K] is True are
        masked. score = ((q+u).k + (q+vb).R) / sqrt(dh), normalised in fp32.
        -> context [Q,B,n,dh] (v's dtype), log-normaliser [Q,B,n] (fp32)."""
        rows, index = r
        scale = 1.0 / math.sqrt(self.dh)
        content = torch.einsum("ibnd,jbnd->bnij", q + u, k)
        by_row = torch.einsum("ibnd,pnd->bnip", q + vb, rows)  # [B, n, Q, P]
        position = by_row.gather(3, index.expand(*by_row.shape[:2], *index.shape))
        score = ((content + position) * scale).float().masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(score, -1)
        prob = F.dropout(torch.softmax(score, -1), self.p_att, self.training).to(v.dtype)
        return torch.einsum("bnij,jbnd->ibnd", prob, v), lse.permute(2, 0, 1)

    def output(self, x, ctx, pre_lnorm):
        out = F.dropout(self.o_net(ctx.reshape(ctx.size(0), ctx.size(1), -1)), self.p, self.training)
        return x + out if pre_lnorm else self.layer_norm(x + out)


class FeedForward(nn.Module):
    def __init__(self, c: MegamemoConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.d_model, c.d_inner), nn.Linear(c.d_inner, c.d_model)
        self.layer_norm, self.p, self.pre = nn.LayerNorm(c.d_model), c.dropout, c.pre_lnorm

    def forward(self, x):
        inner = F.dropout(F.relu(self.fc1(self.layer_norm(x) if self.pre else x)), self.p, self.training)
        out = F.dropout(self.fc2(inner), self.p, self.training)
        return x + out if self.pre else self.layer_norm(x + out)


class Layer(nn.Module):
    def __init__(self, c: MegamemoConfig):
        super().__init__()
        self.attn, self.ff = Attention(c), FeedForward(c)


def _typed(layers: nn.ModuleList) -> list[Layer]:
    """The model's layers as what they are (an nn.ModuleList yields bare Modules to a type checker)."""
    return cast("list[Layer]", list(layers))


def _interpolate(c_old, s_old, a, s_new):
    """LaMemo's memory interpolation: alpha = e^s_old / (e^s_old + e^s_new + eps), context alpha*c_old +
    (1-alpha)*a, log-normaliser log(e^s_old + e^s_new)."""
    top = torch.maximum(s_old, s_new)
    e_old, e_new = torch.exp(s_old - top), torch.exp(s_new - top)
    alpha = (e_old / (e_old + e_new + INTERP_EPS)).unsqueeze(-1)
    merged = torch.nan_to_num(alpha * c_old.float() + (1 - alpha) * a.float())
    return merged.to(a.dtype), torch.logaddexp(s_old, s_new)


# ---- the model -------------------------------------------------------------------------------------------------
class MegamemoForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegamemoConfig
    base_model_prefix = "megamemo"
    main_input_name = "input_ids"
    _is_stateful = True
    _no_split_modules = ["Layer"]

    def __init__(self, config: MegamemoConfig):
        super().__init__(config)
        c = config
        d_embed = c.d_model if c.d_embed is None else c.d_embed
        self.word_emb = AdaptiveEmbedding(c, d_embed)
        self.r_w_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        if c.variant in ("lamemo", "lamemo_no_interp"):  # the look-ahead's own position bias
            self.r_r_bias_future = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layer))
        self.crit = AdaptiveSoftmax(c, d_embed)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the memory is a MegamemoCache, made by forward

    def _init_weights(self, module):
        pass  # every weight comes from the exported checkpoint

    def get_input_embeddings(self):
        return self.word_emb

    # ---- positions and masks -----------------------------------------------------------------------------------
    def _sinusoids(self, klen, M, dtype, device):
        """Rows of the relative-position embedding: distances klen-1 .. 0, then for LaMemo the M look-ahead
        distances (1..M; -1..-M for lamemo_xlrpe), clamped from above at clamp_len. Angles in fp32 always."""
        c = self.config
        pos = torch.arange(klen - 1, -1, -1, device=device, dtype=torch.float32)
        if c.lamemo and M:
            ahead = torch.arange(1, M + 1, device=device, dtype=torch.float32)
            pos = torch.cat([pos, -ahead if c.variant == "lamemo_xlrpe" else ahead])
        if c.clamp_len > 0:
            pos = pos.clamp(max=c.clamp_len)
        freq = 1.0 / 10000 ** (torch.arange(0, c.d_model, 2, device=device, dtype=torch.float32) / c.d_model)
        angle = pos[:, None] * freq[None, :]
        emb = torch.cat([angle.sin(), angle.cos()], -1).to(dtype)
        return F.dropout(emb, c.dropout, self.training)

    def _causal(self, L, M, mem_len, device):
        """Current query i (position M+i) over keys 0..M+L-1: (row of R per pair, hidden [L, M+L])."""
        i = torch.arange(L, device=device)[:, None] + M
        j = torch.arange(M + L, device=device)[None, :]
        hidden = j > i
        if self.config.same_length and 0 < mem_len < M + L:
            hidden = hidden | (j <= i - mem_len)
        return (M + L - 1 - (i - j)).clamp(0, M + L - 1), hidden

    # ---- one segment -------------------------------------------------------------------------------------------
    def _segment(self, ids, memory, mem_len):
        """ids [L, B] -> (hidden [L, B, d], new memory dict)."""
        c = self.config
        h0 = F.dropout(self.word_emb(ids), c.dropout, self.training)
        L = ids.size(0)
        M = next(iter(memory.values())).size(0) if memory else 0
        pos = self._sinusoids(M + L, M, h0.dtype, ids.device)
        index, hidden = self._causal(L, M, mem_len, ids.device)
        run = self._lamemo if c.lamemo else self._xl
        h, new = run(h0, memory, M, pos, index, hidden, mem_len)
        return F.dropout(h, c.dropout, self.training), new

    def _xl(self, h, memory, M, pos, index, hidden, mem_len):
        c, new = self.config, {}
        for li, layer in enumerate(_typed(self.layers)):
            old = memory.get(f"hid.{li}")
            keep = h if old is None else torch.cat([old, h.to(old.dtype)], 0)
            if mem_len > 0:
                new[f"hid.{li}"] = keep[max(0, keep.size(0) - mem_len) :].detach()
            x = keep.to(h.dtype)
            x = layer.attn.layer_norm(x) if c.pre_lnorm else x
            a = layer.attn
            rows = a.r_net(pos).view(-1, c.n_head, c.d_head)
            ctx, _ = a.attend(
                a.project(x, 0, h.size(0)),
                a.project(x, 1),
                a.project(x, 2),
                (rows, index),
                self.r_w_bias,
                self.r_r_bias,
                hidden,
            )
            h = layer.ff(a.output(h, ctx, c.pre_lnorm))
        return h, new

    def _lamemo(self, h0, memory, M, pos, index, hidden, mem_len):
        c = self.config
        vf = self.r_r_bias_future if hasattr(self, "r_r_bias_future") else self.r_r_bias
        emb = memory.get("emb")
        rows_in = h0 if emb is None else torch.cat([emb.to(h0.dtype), h0], 0)
        klen, L = rows_in.size(0), h0.size(0)
        beg = max(0, klen - mem_len)
        new = {}
        x_all = rows_in
        if M and c.variant != "lamemo_no_lookahead":  # look-ahead keys: positions M-nk+1 .. M
            nk = min(M, L)
            i = torch.arange(M, device=h0.device)[:, None]
            p = torch.arange(M - nk + 1, M + 1, device=h0.device)[None, :]
            ahead_index, ahead_hidden = (p - i - 1).clamp(0, M - 1), p <= i
        for li, layer in enumerate(_typed(self.layers)):
            a = layer.attn
            x = a.layer_norm(x_all) if c.pre_lnorm else x_all
            q, k, v = a.project(x, 0), a.project(x, 1), a.project(x, 2)
            r = a.r_net(pos).view(-1, c.n_head, c.d_head)
            ctx, lse = a.attend(q[M:], k, v, (r[:klen], index), self.r_w_bias, self.r_r_bias, hidden)
            if M:
                c_old, s_old = memory[f"ctx.{li}"], memory[f"lse.{li}"].float()
                if c.variant == "lamemo_no_lookahead":
                    c_mem, s_mem = c_old.to(ctx.dtype), s_old
                else:
                    ahead, s_ahead = a.attend(
                        q[:M],
                        k[M - nk + 1 : M + 1],
                        v[M - nk + 1 : M + 1],
                        (r[klen:], ahead_index),
                        self.r_w_bias,
                        vf,
                        ahead_hidden,
                    )
                    if c.variant == "lamemo_no_interp":
                        c_mem, s_mem = ahead, s_ahead
                    else:
                        c_mem, s_mem = _interpolate(c_old, s_old, ahead, s_ahead)
                ctx, lse = torch.cat([c_mem, ctx], 0), torch.cat([s_mem, lse], 0)
            new[f"ctx.{li}"], new[f"lse.{li}"] = ctx[beg:].detach(), lse[beg:].detach()
            x_all = layer.ff(a.output(x_all, ctx, c.pre_lnorm))
        keep = h0 if emb is None else torch.cat([emb, h0.to(emb.dtype)], 0)
        new["emb"] = keep[max(0, keep.size(0) - mem_len) :].detach()
        return x_all[M:], new

    # ---- the transformers interface ----------------------------------------------------------------------------
    def forward(
        self,
        input_ids=None,
        cache=None,
        past_key_values=None,
        labels=None,
        attention_mask=None,
        use_cache=None,
        memory_length=None,
        generating=False,
        return_dict=True,
        **kwargs,
    ):
        """input_ids [B, T]; cache / past_key_values: a MegamemoCache to continue (None: a fresh one);
        memory_length: the memory kept (default config.mem_len); labels [B, T]: the mean NLL of labels[:, 1:]
        given the call's positions before them (-100 ignored)."""
        c = self.config
        if input_ids is None:
            raise ValueError("megamemo models take input_ids (no inputs_embeds)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "megamemo models carry a memory per stream: padded batches (attention_mask with zeros) "
                "are not supported"
            )
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = MegamemoCache()
        elif not isinstance(cache, MegamemoCache):
            raise TypeError(f"cache must be a MegamemoCache, got {type(cache).__name__}")
        mem_len = c.mem_len if memory_length is None else memory_length
        mem_len = mem_len if c.has_memory else 0
        ids = input_ids.t()  # time-major inside
        if not c.has_memory and generating:
            logits = self._rpe_window(ids, cache)
        else:
            outs = []
            for s in range(0, ids.size(0), c.tgt_len):
                h, cache.memory = self._segment(ids[s : s + c.tgt_len], cache.memory, mem_len)
                outs.append(h)
            h = torch.cat(outs, 0)
            logits = (
                self.crit.log_probs(h.reshape(-1, h.size(-1)), self.word_emb).view(*h.shape[:2], -1).transpose(0, 1)
            )
        cache.seen += ids.size(0)
        loss = None
        if labels is not None:
            loss = F.nll_loss(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        keep = cache if use_cache is not False else None
        return MegamemoOutput(loss=loss, logits=logits, cache=keep)

    def _rpe_window(self, ids, cache):
        """Generating with the memory-less variant (megamemo generate's way): the next token's distribution from
        the last tgt_len tokens re-encoded; earlier rows of this call are scored segment by segment."""
        c = self.config
        window = ids if cache.window is None else torch.cat([cache.window, ids], 0)
        window = window[max(0, window.size(0) - c.tgt_len) :]
        cache.window = window
        h, _ = self._segment(window, {}, 0)
        rows = [self.crit.log_probs(h[-1], self.word_emb)[None]]
        if ids.size(0) > 1:
            head = [self._segment(ids[s : s + c.tgt_len], {}, 0)[0] for s in range(0, ids.size(0) - 1, c.tgt_len)]
            h = torch.cat(head, 0)[: ids.size(0) - 1]
            rows.insert(0, self.crit.log_probs(h.reshape(-1, h.size(-1)), self.word_emb).view(*h.shape[:2], -1))
        return torch.cat(rows, 0).transpose(0, 1)

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = MegamemoCache()
        return {
            "input_ids": input_ids[:, cache.seen :],
            "cache": cache,
            "use_cache": True,
            "generating": True,
            "memory_length": self.config.generation_mem_len,
            "attention_mask": kwargs.get("attention_mask"),
        }
