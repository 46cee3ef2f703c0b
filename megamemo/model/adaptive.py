"""Adaptive input embedding and projected adaptive log-softmax (Baevski & Auli; Grave et al.), with a full
softmax as the no-cutoff case.

Cluster order is forward: the head's tail-cluster column for cluster i (1-based) is `shortlist + i - 1`
(the TF original and HF order). kimiyoung's PyTorch code reads column -i; the importer reverses those rows.
Tying is done by the LM passing the embedding's tables to the softmax, so no parameter is stored twice.

A padded vocabulary (ModelConfig.n_vocab < n_token, `model.n_token: auto`): the ids n_vocab .. n_token-1 have rows in
the tables but are no symbols. Their output bias is read as -inf (`mask_padding`), so the softmax gives them
probability 0 exactly and the NLL is the unpadded vocabulary's. With cutoffs the padding ids are the last cluster's
last rows: they are masked inside that cluster's softmax, and the head and every other cluster are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def cluster_bounds(n_token: int, cutoffs: list[int]) -> list[int]:
    return [0] + list(cutoffs) + [n_token]


def mask_padding(bias: torch.Tensor, first: int, n_vocab: int | None) -> torch.Tensor:
    """bias [rows] of vocabulary ids first .. first+rows-1 -> the same with -inf at the padding ids (>= n_vocab):
    a softmax then gives them probability 0 exactly, and no gradient reaches their rows (a new tensor: the parameter
    itself is left as it is). n_vocab None: no padding."""
    rows = bias.size(0)
    keep = rows if n_vocab is None else min(max(n_vocab - first, 0), rows)
    if keep == rows:
        return bias
    return torch.cat([bias[:keep], bias.new_full((rows - keep,), float("-inf"))])


class AdaptiveEmbedding(nn.Module):
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val):
        super().__init__()
        self.bounds = cluster_bounds(n_token, cutoffs)
        self.div_val, self.d_proj = div_val, d_proj
        self.scale = d_proj**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i in range(len(self.bounds) - 1):
                d_i = d_embed // div_val**i
                self.emb_layers.append(nn.Embedding(self.bounds[i + 1] - self.bounds[i], d_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))

    def proj(self, i):
        return self.emb_projs[i] if len(self.emb_projs) > i else None

    def forward(self, x):
        if self.div_val == 1:
            e = self.emb_layers[0](x)
            if self.proj(0) is not None:
                e = F.linear(e, self.proj(0))
        else:
            flat = x.reshape(-1)
            e = flat.new_zeros(flat.numel(), self.d_proj, dtype=self.emb_projs[0].dtype)
            for i in range(len(self.bounds) - 1):
                lo, hi = self.bounds[i], self.bounds[i + 1]
                idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
                if idx.numel():
                    e = e.index_copy(
                        0, idx, F.linear(self.emb_layers[i](flat[idx] - lo), self.emb_projs[i]).to(e.dtype)
                    )
            e = e.view(*x.shape, self.d_proj)
        return e * self.scale


class AdaptiveLogSoftmax(nn.Module):
    """Owns the output biases, cluster weights, and the projections/tables that are not tied to the input."""

    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val, tie_weight, tie_projs, n_vocab=None):
        super().__init__()
        self.bounds = cluster_bounds(n_token, cutoffs)
        self.n_vocab = n_vocab  # ids from n_vocab on are padding (None: none)
        self.n_clusters = len(cutoffs)
        self.shortlist = self.bounds[1]
        self.div_val, self.d_proj = div_val, d_proj
        n_parts = len(self.bounds) - 1
        tie_projs = list(tie_projs) + [tie_projs[-1] if tie_projs else False] * (n_parts - len(tie_projs))
        self.tie_weight = tie_weight
        self.tie_projs = tie_projs[:n_parts]
        dims = [d_embed] if div_val == 1 else [d_embed // div_val**i for i in range(n_parts)]
        # own tables (when not tied): one [n_token, d] for div_val 1, else one per cluster
        self.out_weights = nn.ParameterList()
        if not tie_weight:
            for i, d_i in enumerate(dims):
                rows = n_token if div_val == 1 else self.bounds[i + 1] - self.bounds[i]
                self.out_weights.append(nn.Parameter(torch.empty(rows, d_i)))
        self.out_bias = nn.Parameter(torch.zeros(n_token))
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        # projections: per cluster, None when the dims agree (div_val 1, d_embed == d_proj)
        self.has_proj = [not (div_val == 1 and d_proj == d_embed) for _ in range(n_parts)]
        self.out_projs = nn.ParameterDict(
            {
                str(i): nn.Parameter(torch.empty(d_proj, dims[i if div_val > 1 else 0]))
                for i in range(n_parts)
                if self.has_proj[i] and not self.tie_projs[i]
            }
        )

    def parts(self, emb: AdaptiveEmbedding):
        """Per cluster i: (weight [rows, d_i], bias [rows], proj [d_proj, d_i] or None), tying resolved."""
        out = []
        for i in range(len(self.bounds) - 1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            k = 0 if self.div_val == 1 else i  # div_val 1: one table, this cluster's rows of it
            table = emb.emb_layers[k].weight if self.tie_weight else self.out_weights[k]
            assert isinstance(table, torch.Tensor)
            w = table[lo:hi] if self.div_val == 1 else table
            b = mask_padding(self.out_bias[lo:hi], lo, self.n_vocab)
            if not self.has_proj[i]:
                p = None
            elif self.tie_projs[i]:
                p = emb.emb_projs[0] if self.div_val == 1 else emb.emb_projs[i]
            else:
                p = self.out_projs[str(i)]
            out.append((w, b, p))
        return out

    @staticmethod
    def _logits(h, w, b, p):
        if p is not None:
            h = h @ p
        return F.linear(h, w, b)

    def _head(self, h, parts):
        w, b, p = parts[0]
        if self.n_clusters:
            w = torch.cat([w, self.cluster_weight], 0)
            b = torch.cat([b, self.cluster_bias], 0)
        return F.log_softmax(self._logits(h, w, b, p).float(), dim=-1)

    def nll(self, h, target, emb):
        """h [N, d_proj], target [N] -> NLL [N] (fp32), in position order."""
        parts = self.parts(emb)
        head = self._head(h, parts)
        if not self.n_clusters:
            return -head.gather(1, target[:, None]).squeeze(1)
        logp = head.gather(1, target.clamp(max=self.shortlist - 1)[:, None]).squeeze(1)
        for i in range(1, len(self.bounds) - 1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            idx = ((target >= lo) & (target < hi)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            tail = F.log_softmax(self._logits(h[idx], *parts[i]).float(), dim=-1)
            lp = head[idx, self.shortlist + i - 1] + tail.gather(1, (target[idx] - lo)[:, None]).squeeze(1)
            logp = logp.index_copy(0, idx, lp)
        return -logp

    def log_probs(self, h, emb):
        """h [N, d_proj] -> log-probabilities over the whole vocabulary [N, n_token] (fp32)."""
        parts = self.parts(emb)
        head = self._head(h, parts)
        if not self.n_clusters:
            return head
        out = [head[:, : self.shortlist]]
        for i in range(1, len(self.bounds) - 1):
            tail = F.log_softmax(self._logits(h, *parts[i]).float(), dim=-1)
            out.append(head[:, self.shortlist + i - 1, None] + tail)
        return torch.cat(out, 1)
