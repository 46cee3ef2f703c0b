"""Analytic model FLOPs of a training step (what MFU counts), shared by training's progress lines and the benches.

A forward over a [L, B] segment with a full memory of M rows (the steady state of training), counted per matmul
as 2·m·n·k; a training step is 3x the forward (the backward computes each product's two gradients). Counted:

  - every layer's [Q;K;V] projection (LaMemo: memory and current rows; XL/RPE: queries for the current rows only,
    keys and values for all), the position projection r_net over the distances used, attention content and
    position scores and the weighted values of the L current queries over klen = M + L keys, o_net and the
    feed-forward (LaMemo: memory and current rows, since it recomputes the memory rows' states every segment);
  - LaMemo's look-ahead: the M memory queries over the Nk = min(M, L) keys after them (content, values) and their
    position scores over M future distances;
  - less what the top LaMemo layer skips (model/layers.py, mem_rows_out=False): its memory rows' o_net and
    feed-forward, and their look-ahead when the new caches keep none of them (mem_len <= L);
  - the output layer, [L·B, d] x [d, V] (with adaptive softmax cutoffs: the head's shortlist + cluster columns
    only; the tail clusters' work depends on which targets fall there and is not counted, nor the input
    embedding's per-cluster projections with div_val > 1 - a lower bound for such models), and the input and
    output projections between d_embed and d_model when d_embed != d_model (div_val 1).

Not counted: softmax, masks, dropout, layer norms, interpolation and Adam (elementwise work, not FLOPs a
tensor core does). The count is what bench/model_step.py has printed since the speed work began; its test
(tests/test_flops.py) checks it against torch's FlopCounterMode on a real forward+backward.
"""
from __future__ import annotations

from .config import ModelConfig


def forward_flops(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """Forward FLOPs of one [tgt_len, batch] segment with mem_len memory rows (defaults: cfg's training lengths;
    RPE has no memory whatever mem_len says)."""
    B = batch
    L = cfg.tgt_len if tgt_len is None else tgt_len
    M = cfg.mem_len if mem_len is None else mem_len
    d, H, F = cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner
    if not cfg.has_memory:
        M = 0
    klen = L + M
    if cfg.lamemo:
        nk = min(M, L)
        lookahead = 2 * M * nk * H * B * 2 + 2 * M * M * H * B   # content and values, position scores
        if cfg.variant == "lamemo_no_lookahead":
            lookahead = 0                                         # the ablation keeps the cached context
        per_layer = (2 * klen * d * 3 * H * B            # qkv for memory and current rows
                     + 2 * (klen + M) * d * H            # r_net over past and future distances
                     + 3 * 2 * L * klen * H * B          # causal: content, position, values
                     + lookahead
                     + 2 * klen * H * d * B              # o_net for memory and current rows
                     + 2 * klen * 2 * d * F * B)         # FFN for memory and current rows
        # the top layer's memory rows feed nothing: no o_net or FFN for them, and no look-ahead when the new
        # caches keep none of them (M = mem_len <= L; LaMemoLayer's mem_rows_out)
        top_saves = 2 * M * H * d * B + 2 * M * 2 * d * F * B + (lookahead if M <= L else 0)
        body = cfg.n_layer * per_layer - top_saves
    else:
        per_layer = (2 * L * d * H * B + 2 * klen * d * 2 * H * B   # q for current rows, k and v for all
                     + 2 * klen * d * H + 3 * 2 * L * klen * H * B
                     + 2 * L * H * d * B + 2 * L * 2 * d * F * B)
        body = cfg.n_layer * per_layer
    return body + _embedding_and_output(cfg, L * B)


def _embedding_and_output(cfg: ModelConfig, n: int) -> float:
    """The output layer over n positions, and the d_embed <-> d_model projections (see the module docstring)."""
    d, e = cfg.d_model, cfg.embed_dim
    cols = cfg.n_token if not cfg.cutoffs else cfg.cutoffs[0] + len(cfg.cutoffs)   # the head: shortlist + clusters
    projected = not (cfg.div_val == 1 and e == d)
    out = 2 * n * e * cols + (2 * n * d * e if projected else 0)
    inp = 2 * n * e * d if (cfg.div_val == 1 and e != d) else 0
    return out + inp


def step_flops(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """Forward + backward FLOPs of one training micro-batch: 3x the forward."""
    return 3 * forward_flops(cfg, batch, tgt_len, mem_len)


def flops_per_token(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """Training FLOPs per target token at `batch` streams per micro-batch (per process): nearly independent of
    batch (only r_net's projection of the position table is shared by the streams)."""
    L = cfg.tgt_len if tgt_len is None else tgt_len
    return step_flops(cfg, batch, L, mem_len) / (L * batch)
