"""The language model: embed -> layers -> adaptive softmax, with memory passed in and returned."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from .config import ModelConfig
from .layers import LaMemoLayer, XLLayer
from .lengths import Lengths
from .memory import Memory, xl_update
from .positions import causal_mask, position_sequence, sinusoid


class MemTransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        d, n, dh = cfg.d_model, cfg.n_head, cfg.d_head
        self.word_emb = AdaptiveEmbedding(cfg.n_token, cfg.embed_dim, d, cfg.cutoffs, cfg.div_val)
        # dropout on the word embeddings, the position table and the top layer's output: three modules, so that
        # each is a site of its own for keyed masks (megamemo/kernels/keyed.py); drawn in this order either way
        self.drop = nn.Dropout(cfg.dropout)
        self.drop_pos = nn.Dropout(cfg.dropout)
        self.drop_out = nn.Dropout(cfg.dropout)
        self.r_w_bias = nn.Parameter(torch.empty(n, dh))
        self.r_r_bias = nn.Parameter(torch.empty(n, dh))
        if cfg.future_bias:
            self.r_r_bias_future = nn.Parameter(torch.empty(n, dh))
        layer = LaMemoLayer if cfg.lamemo else XLLayer
        self.layers = nn.ModuleList(layer(cfg, li) for li in range(cfg.n_layer))
        self.crit = AdaptiveLogSoftmax(
            cfg.n_token, cfg.embed_dim, d, cfg.cutoffs, cfg.div_val, cfg.tie_weight, cfg.tie_projs, n_vocab=cfg.n_vocab
        )
        self.check_inputs = True  # token-range checks cost a host sync: a training loop on GPU may turn them off
        # train.activation_checkpointing: in training, each layer's activations are recomputed in the backward
        # (torch.utils.checkpoint; dropout masks are replayed from the saved RNG state, or recomputed from their
        # coordinates when keyed, memory is built from tensors outside the recomputed calls, so nothing advances
        # twice)
        self.recompute_layers = False
        self.reset_parameters()

    # ---- initialisation (the reference training scripts' weights_init) ----------------------------------------
    def reset_parameters(self):
        std, pstd = self.cfg.init_std, self.cfg.proj_init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, std)
                nn.init.zeros_(m.bias)
        for p in list(self.word_emb.emb_projs) + list(self.crit.out_projs.values()):
            nn.init.normal_(p, 0.0, pstd)
        for p in self.crit.out_weights:
            nn.init.normal_(p, 0.0, std)
        nn.init.zeros_(self.crit.out_bias)
        if self.crit.n_clusters:
            nn.init.normal_(self.crit.cluster_weight, 0.0, std)
            nn.init.zeros_(self.crit.cluster_bias)
        nn.init.normal_(self.r_w_bias, 0.0, std)
        nn.init.normal_(self.r_r_bias, 0.0, std)
        if self.cfg.future_bias:
            if self.cfg.future_bias_init == "xavier":
                nn.init.xavier_uniform_(self.r_r_bias_future)
            else:
                nn.init.normal_(self.r_r_bias_future, 0.0, std)

    # ---- memory ---------------------------------------------------------------------------------------------
    def memory_names(self) -> list[str]:
        if not self.cfg.has_memory:
            return []
        if self.cfg.lamemo:
            return ["emb"] + [f"{kind}.{li}" for li in range(self.cfg.n_layer) for kind in ("ctx", "lse")]
        return [f"hid.{li}" for li in range(self.cfg.n_layer)]

    def empty_memory(self, batch_size: int) -> Memory:
        return Memory({}, batch_size=batch_size)

    def _check(self, inp, tgt, mem):
        cfg = self.cfg
        if inp.dim() != 2 or inp.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input must be an integer tensor [tgt_len, batch], got {inp.dtype} {tuple(inp.shape)}")
        if tgt is not None and tgt.shape != inp.shape:
            raise ValueError(f"target shape {tuple(tgt.shape)} does not match input shape {tuple(inp.shape)}")
        if self.check_inputs:
            for name, t in (("input", inp), ("target", tgt)):
                if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.vocab_size):
                    raise ValueError(
                        f"{name} token ids must be in [0, {cfg.vocab_size}); got range [{int(t.min())}, {int(t.max())}]"
                    )
        B = inp.size(1)
        if mem.batch_size is not None and mem.batch_size != B:
            raise ValueError(f"memory holds {mem.batch_size} streams but the input has batch {B}")
        if mem.length == 0 and not mem.tensors:
            return
        names = self.memory_names()
        if sorted(mem.tensors) != sorted(names):
            raise ValueError(
                f"memory tensors {sorted(mem.tensors)} do not match this model ({cfg.variant}, "
                f"{cfg.n_layer} layers) which expects {names}"
            )
        first: Any = self.layers[0]  # a layer's attention (plain or TP-split) knows its heads
        n_local = first.attn.n_head
        for k, t in mem.tensors.items():
            tail = {"emb": (cfg.d_model,), "hid": (cfg.d_model,), "ctx": (n_local, cfg.d_head), "lse": (n_local,)}[
                k.split(".")[0]
            ]
            if tuple(t.shape[2:]) != tail:
                raise ValueError(
                    f"memory tensor {k!r} has shape {tuple(t.shape)}, expected [M, {B}, {', '.join(map(str, tail))}]"
                )

    # ---- forward --------------------------------------------------------------------------------------------
    def forward(
        self,
        inp,
        tgt=None,
        mem: Memory | None = None,
        *,
        mem_len=None,
        same_length=None,
        clamp_len=None,
        attend=None,
        observe=None,
    ):
        """inp, tgt [L, B] token ids -> (nll [L, B] fp32, new memory). Without tgt: (log-probs [L, B, V], memory).
        mem_len / same_length / clamp_len override the config for this call (evaluation at other lengths).
        Evaluation-time extras (megamemo/model/trams.py): attend(l, layer) may return a replacement for layer l's
        current-query attention, called as fn(q_cur, k, v, M, r, mask) -> (ctx, lse) in the attention functions'
        head-major layout (q_cur [n,B,L,dh], k, v [n,B,M+L,dh]; ctx [n,B,L,dh], lse [n,B,L]); observe(layer=l,
        kind=..., ...) is told LaMemo's memorizing coefficient ("alpha", [B,n,M]) of every layer."""
        mem = self.empty_memory(inp.size(1)) if mem is None else mem
        self._check(inp, tgt, mem)
        hidden, new_mem = self.encode(inp, mem, mem_len, same_length, clamp_len, attend, observe)
        L, B = inp.shape
        flat = hidden.reshape(L * B, -1)
        if tgt is None:
            return self.crit.log_probs(flat, self.word_emb).view(L, B, -1), new_mem
        return self.crit.nll(flat, tgt.reshape(-1).long(), self.word_emb).view(L, B), new_mem

    def encode(self, inp, mem: Memory, mem_len=None, same_length=None, clamp_len=None, attend=None, observe=None):
        cfg = self.cfg
        at = Lengths(mem=mem_len, clamp=clamp_len, same_length=same_length).resolve(cfg)
        mem_len, same_length, clamp_len = (at.mem if cfg.has_memory else 0), at.same_length, at.clamp
        h0 = self.drop(self.word_emb(inp))
        L, B = inp.shape
        M = mem.length
        klen = M + L
        pos = position_sequence(klen, M, clamp_len, cfg.future_positions, h0.device)
        pos_emb = self.drop_pos(sinusoid(pos, cfg.d_model, h0.dtype))
        mask = causal_mask(L, M, mem_len, same_length, h0.device)
        hooks = [
            (
                (attend(li, layer) if attend is not None else None),
                (functools.partial(observe, layer=li) if observe is not None else None),
            )
            for li, layer in enumerate(self.layers)
        ]
        if cfg.lamemo:
            return self._encode_lamemo(h0, mem, pos_emb, mask, mem_len, hooks)
        return self._encode_xl(h0, mem, pos_emb, mask, mem_len, hooks)

    def _call(self, layer, *args, **kwargs):
        """layer(*args, **kwargs), its activations recomputed in the backward when recompute_layers is on."""
        if self.recompute_layers and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    def _encode_xl(self, h0, mem, pos_emb, mask, mem_len, hooks):
        h, hids = h0, []
        for li, layer in enumerate(self.layers):
            hids.append(h)
            h = self._call(
                layer, h, mem.get(f"hid.{li}"), pos_emb, self.r_w_bias, self.r_r_bias, mask, attend=hooks[li][0]
            )
        new = {}
        if mem_len > 0:
            with torch.no_grad():
                for li, x in enumerate(hids):
                    new[f"hid.{li}"] = xl_update(mem.get(f"hid.{li}"), x, mem_len)
        return self.drop_out(h), Memory(new, batch_size=h0.size(1))

    def _encode_lamemo(self, h0, mem, pos_emb, mask, mem_len, hooks):
        vf = self.r_r_bias_future if self.cfg.future_bias else self.r_r_bias
        emb = mem.get("emb")
        M = 0 if emb is None else emb.size(0)
        rows, new = (h0 if emb is None else torch.cat([emb.to(h0.dtype), h0], 0)), {}
        top = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            ctx_old, lse_old = mem.get(f"ctx.{li}"), mem.get(f"lse.{li}")
            rows, new[f"ctx.{li}"], new[f"lse.{li}"] = self._call(
                layer,
                rows,
                M,
                ctx_old,
                lse_old,
                pos_emb,
                self.r_w_bias,
                self.r_r_bias,
                vf,
                mask,
                mem_len,
                *hooks[li],
                mem_rows_out=li < top,
            )  # the top layer's memory rows would be thrown away
        with torch.no_grad():
            new["emb"] = xl_update(emb, h0, mem_len)
        return self.drop_out(rows[rows.size(0) - h0.size(0) :]), Memory(new, batch_size=h0.size(1))
