"""Tolerances from the arithmetic, not from what happened to pass (issue 48): a test that compares two floating-point
computations of the same value allows what rounding can explain and nothing more.

u is the unit roundoff of a dtype (half the gap between 1 and the next number: fp32 2^-24 = 6.0e-8, bf16 2^-8 =
3.9e-3, fp64 1.1e-16). A sum or dot product of n terms, computed in any order, is within n·u·Σ|terms| of the exact
value (Higham, Accuracy and Stability of Numerical Algorithms, §3.1, to first order); two computations that order
the same sums differently (another GEMM blocking, another instruction set, split segments, sharded heads) are each
that far from it, so they differ by at most twice that. A chain of such reductions (a model's forward pass) adds
its relative errors to first order, each stage's output scaled back to the compared value's size."""

import torch


def unit_roundoff(dtype=torch.float32) -> float:
    """u of a floating-point dtype: fp32 6.0e-8, bf16 3.9e-3, fp16 4.9e-4, fp64 1.1e-16."""
    return torch.finfo(dtype).eps / 2


def sum_bound(n: int, scale: float, dtype=torch.float32, runs: int = 2) -> float:
    """How far `runs` computations (2: two orders of the same sum; 1: one against the exact value) of a sum of n
    terms whose magnitudes add up to `scale` can be apart: runs · n · u · scale."""
    return runs * n * unit_roundoff(dtype) * scale


def forward_reductions(cfg, klen: int | None = None) -> int:
    """The reduction lengths along a forward pass of MemTransformerLM `cfg`, added up: per layer the q/k/v projection
    (d_model), a score (d_head), the softmax normaliser and the weighted values (klen keys each: the segment and its
    memory), the output projection (n_head·d_head), two layer norms (d_model each) and the feed-forward's two products
    (d_model, d_inner); then the output logits (d_model) and the log-softmax's normaliser (n_token)."""
    klen = cfg.tgt_len + cfg.mem_len if klen is None else klen
    per_layer = 4 * cfg.d_model + cfg.d_head + 2 * klen + cfg.n_head * cfg.d_head + cfg.d_inner
    return cfg.n_layer * per_layer + cfg.d_model + cfg.n_token


def forward_bound(cfg, scale: float, dtype=torch.float32, klen: int | None = None, runs: int = 2) -> float:
    """How far `runs` computations of a forward pass's output of magnitude `scale` can be apart when they order its
    sums differently: sum_bound over all of forward_reductions(cfg, klen), to first order."""
    return sum_bound(forward_reductions(cfg, klen), scale, dtype, runs)


def backward_bound(
    cfg, scale: float, tokens: int, dtype=torch.float32, klen: int | None = None, runs: int = 2
) -> float:
    """The same for a gradient of magnitude `scale`: the backward pass runs the forward's reductions again transposed
    (twice: the forward's own and its transpose), then a weight's gradient sums over the `tokens` positions."""
    return 2 * forward_bound(cfg, scale, dtype, klen, runs) + sum_bound(tokens, scale, dtype, runs)


def weight_drift(a: dict, b: dict) -> float:
    """rho: the largest relative difference max|a - b| / max|a| of a floating-point tensor between two state dicts."""
    return max(
        float((w - b[k]).abs().max()) / max(float(w.abs().max()), 1e-30) for k, w in a.items() if w.is_floating_point()
    )


def drift_bound(cfg, rho: float, scale: float) -> float:
    """How far a forward pass's output of magnitude `scale` can move between two runs whose weights drifted apart
    by rho (weight_drift) and whose sums run in other orders: to first order each of the n_layer + 1 stages (the
    embedding, then each layer) moves its output by at most rho relative, plus forward_bound's rounding."""
    return (cfg.n_layer + 1) * rho * scale + forward_bound(cfg, scale)
