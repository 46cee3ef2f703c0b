"""Losses in the units the papers report, from a mean per-token NLL in nats: bits per character (bpc, byte and
character corpora), perplexity (ppl, word and subword corpora) and bits per byte (the UTF-8 bytes the tokens stand
for: lm-evaluation-harness's unit, comparable across tokenizers). The one place these conversions live."""

from __future__ import annotations

import math

LN2 = math.log(2.0)
MAX_EXP = 700.0  # exp() of more overflows a float: a diverged loss shows as a huge perplexity, not an error


def bits(nll_nats: float) -> float:
    """Nats to bits: a mean per-character NLL is bpc."""
    return nll_nats / LN2


def perplexity(nll_nats: float) -> float:
    return math.exp(min(nll_nats, MAX_EXP))


def bits_per_byte(total_nll_nats: float, n_bytes: int) -> float:
    """A TOTAL NLL (nats, summed over the scored tokens) in bits over the bytes of the text those tokens stand for."""
    return total_nll_nats / LN2 / n_bytes if n_bytes > 0 else float("nan")


def metric_value(nll_nats: float, metric: str) -> float:
    """A mean per-token NLL in `metric`: "bpc" or "ppl"."""
    if metric == "bpc":
        return bits(nll_nats)
    if metric == "ppl":
        return perplexity(nll_nats)
    raise ValueError(f"unknown metric {metric!r} (bpc or ppl)")
