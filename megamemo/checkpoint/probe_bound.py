"""How far a bf16/fp16 run's recorded probe may lie from its single-device replay: a bound derived from the dtype's
unit roundoff, the model's depth (the rounding operations of its forward, counted on the replay) and its width (the
GEMMs' accumulation length), in nats through the scale of the model's log-probabilities.

The recording (the sharded training model on its device) and the replay (the converted model cast to the run's
dtype, on the CPU) are two implementations of the same arithmetic that round in different places: GEMMs that
accumulate in another order or blocking, attention kernels, tensor-parallel partial sums. In the standard model
of floating-point error each rounding operation of a forward is off by at most u_eff = u + K * 2^-24 relative
(u: the dtype's unit roundoff; K: the longest GEMM accumulation, i.e. the width, summed in fp32), and to first
order the relative errors of a chain add. A forward of N rounding operations therefore gives log-probs (centred
over the vocabulary, which removes the log-normaliser) off by at most N * u_eff relative in the worst case, when
every error points the same way, and by sqrt(N) * u_eff as an RMS when they are independent (they add in
quadrature). A token's NLL, -c_y + log sum exp c, moves by the error of c_y plus the probability-weighted mean
error: at most twice the error of one centred log-prob. With S the RMS of the replay's centred log-probs (nats)
and N_rec, N_rep the rounding operations of the recording and of the replay:

    max  |diff| <= 2 * (N_rec + N_rep) * u_eff * S          every token: the worst case, errors added
    mean |diff| <= 2 * sqrt(N_rec + N_rep) * u_eff * S      over the tokens (mean <= RMS): errors in quadrature

N_rep is counted (util/rounding.py); N_rec is N_rep plus what tensor parallelism adds: each of a layer's two
row-parallel GEMMs (attention output, second feed-forward) rounds its tp partial products and the tp - 1 sums of
the all-reduce instead of one product, 4 (tp - 1) per layer. A fault (a layer swapped, a tensor-parallel shard
misplaced, a stale memory) moves the NLL by a sizeable fraction of S on most tokens, far past the mean bound:
tests/checkpoint/test_probe_bound.py checks both directions at d_model 1024.
"""

from __future__ import annotations

import math

import torch

from megamemo.model import Memory, MemTransformerLM
from megamemo.util.rounding import ACCUMULATION_ROUNDOFF, unit_roundoff

SCALE_ROWS = 256  # log-prob rows at a time for the scale (large vocabularies)


def accumulation_width(model: MemTransformerLM, segment_len: int) -> int:
    """The longest inner dimension of the forward's GEMMs: the projections' (d_model, d_inner, heads x d_head) and
    attention's probability-times-value product (the keys: the segment plus the memory)."""
    cfg = model.cfg
    return max(cfg.d_model, cfg.d_inner, cfg.n_head * cfg.d_head, segment_len + cfg.mem_len)


def tp_roundings(model: MemTransformerLM, tp: int) -> int:
    """Rounding operations tensor parallelism adds to a forward (see the module's docstring)."""
    return 4 * (max(int(tp), 1) - 1) * model.cfg.n_layer


@torch.no_grad()
def logprob_scale(model: MemTransformerLM, segment: torch.Tensor, memory: Memory | None) -> float:
    """S: the RMS over tokens and vocabulary of the centred log-probs of `model` on one stream of `segment` [L, B],
    from `memory` (that stream's first column is used) or empty."""
    x = segment[:, :1]
    mem = model.empty_memory(1) if memory is None else memory.select_batch(slice(0, 1))
    was_training = model.training
    model.eval()
    try:
        hidden, _ = model.encode(x.to(next(model.parameters()).device), mem)
        flat, total, count = hidden.reshape(x.size(0), -1), 0.0, 0
        for rows in flat.split(SCALE_ROWS):
            lp = model.crit.log_probs(rows, model.word_emb).double()
            total += float((lp - lp.mean(-1, keepdim=True)).pow(2).sum())
            count += lp.numel()
    finally:
        model.train(was_training)
    return math.sqrt(total / count)


def half_tolerance(
    model: MemTransformerLM, dtype: torch.dtype, replay_roundings: int, probe: dict, memory: Memory | None
) -> dict:
    """The max and mean bounds (nats) for a probe recorded in `dtype` and replayed by `model` (already in `dtype`)
    with `replay_roundings` rounding operations per forward; `memory` is what the replay started from (or None)."""
    first = probe["segments"][0][0]
    tp = int((probe.get("layout") or {}).get("tp") or 1)
    u = unit_roundoff(dtype) + accumulation_width(model, first.size(0)) * ACCUMULATION_ROUNDOFF
    n = 2 * replay_roundings + tp_roundings(model, tp)
    scale = logprob_scale(model, first, memory)
    return {
        "max": 2 * n * u * scale,
        "mean": 2 * math.sqrt(n) * u * scale,
        "derived": {"roundings": n, "unit_roundoff": u, "logprob_scale": scale, "tp": tp},
    }
