"""Statistics and excerpts of a prepared split: the unigram baseline a language model must beat, a prompt.

    unigram_bits(fit_ids, ids, n)    bits per token of `ids` under the unigram distribution of `fit_ids`, add-one
                                     smoothed over all n symbols (a symbol unseen in `fit_ids` still gets mass)
    entropy_bits(ids, n)             the empirical entropy of `ids` itself (the best any unigram model can do on
                                     them: a lower bound, not a fair baseline, since it is fitted on the test data)
    unigram_baseline(dir, split)     both, on a shard directory, fitted on its train split
    excerpt(dir, split, start, n)    raw bytes of n tokens of a byte/char split from the first line start at or
                                     after `start` where n tokens follow it (a prompt for `megamemo generate`)

For byte- and character-level corpora a token is a character, so bits per token are bits per character (bpc).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from megamemo.util.units import bits_per_byte

from .shard_reader import load_vocab, read_split
from .shards import load_manifest
from .vocab import Vocab, per_token


def _counts(ids, n_symbols: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= n_symbols):
        raise ValueError(f"token ids must lie in [0, {n_symbols}), got [{ids.min()}, {ids.max()}]")
    return np.bincount(ids, minlength=n_symbols).astype(np.float64)


def unigram_bits(fit_ids, ids, n_symbols: int, smoothing: float = 1.0) -> float:
    """Cross-entropy in bits per token of `ids` under p(s) = (count_fit(s) + smoothing) / (N_fit + smoothing·n)."""
    fit = _counts(fit_ids, n_symbols) + smoothing
    cnt = _counts(ids, n_symbols)
    if cnt.sum() == 0:
        raise ValueError("no tokens to score")
    p = fit / fit.sum()
    nz = cnt > 0
    if np.any(p[nz] == 0):
        raise ValueError("a scored symbol has probability 0 (smoothing=0 and unseen in the fitted tokens)")
    return float(-(cnt[nz] * np.log2(p[nz])).sum() / cnt.sum())


def entropy_bits(ids, n_symbols: int) -> float:
    """Empirical entropy in bits per token of `ids` (their own unigram frequencies)."""
    cnt = _counts(ids, n_symbols)
    if cnt.sum() == 0:
        raise ValueError("no tokens to score")
    p = cnt[cnt > 0] / cnt.sum()
    return float(-(p * np.log2(p)).sum())


def unit(data_dir: str | Path) -> str:
    """'bits/token' for word-level and subword tokenizers, else 'bpc' (a token is a character)."""
    m = load_manifest(data_dir)
    kind = (m.get("tokenizer") or {}).get("kind") or (m.get("vocab") or {}).get("kind")
    return "bits/token" if per_token(kind) else "bpc"


def unigram_baseline(data_dir: str | Path, split: str = "test", fit: str = "train") -> dict:
    """{'bits': split under fit's add-one unigram, 'self_entropy': split's own entropy, 'tokens', 'fit_tokens',
    'unit'} for a shard directory made by `megamemo prepare`."""
    n = len(load_vocab(data_dir))
    ids, fit_ids = read_split(data_dir, split), read_split(data_dir, fit)
    out: dict[str, Any] = {
        "split": split,
        "fit": fit,
        "smoothing": "add-one",
        "bits": unigram_bits(fit_ids, ids, n),
        "self_entropy": entropy_bits(ids, n),
        "tokens": int(ids.size),
        "fit_tokens": int(fit_ids.size),
        "unit": unit(data_dir),
    }
    n_bytes = load_manifest(data_dir)["splits"][split].get("n_bytes")
    if n_bytes:  # subword corpora: the whole split is scored, so its recorded UTF-8 bytes
        out["bits_per_byte"] = bits_per_byte(out["bits"] * out["tokens"] * math.log(2.0), n_bytes)
    return out


def excerpt(data_dir: str | Path, split: str = "test", start: int = 0, n_tokens: int = 256) -> bytes:
    """Raw bytes of `n_tokens` tokens of a byte/char split, from the first line start at or after `start` (or from
    `start` itself where no line starts with n_tokens after it); `start` is clamped to the split's last n_tokens."""
    vocab = load_vocab(data_dir)
    if not isinstance(vocab, Vocab) or vocab.kind not in ("bytes", "chars"):
        raise ValueError(f"excerpt: a {vocab.kind!r} vocabulary has no raw bytes (byte/char corpora only)")
    ids = read_split(data_dir, split)
    table = np.array([vocab.symbol_byte(s) for s in vocab.symbols], dtype=np.uint8)
    raw = table[np.asarray(ids, dtype=np.int64)]
    start = min(max(start, 0), max(raw.size - n_tokens, 0))  # a short split: its last n_tokens
    if start > 0:
        nl = np.flatnonzero(raw[start - 1 :] == 10)
        if nl.size and start + int(nl[0]) + n_tokens <= raw.size:
            start += int(nl[0])
    out = raw[start : start + n_tokens].tobytes()
    if not out:
        raise ValueError(f"excerpt: split {split!r} has no tokens at or after {start}")
    return out
