"""Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
generator of Random123 and cuRAND, which passes TestU01's BigCrush), written in torch integer ops.

A counter of four 32-bit words and a key of two are mapped to four 32-bit words by ten rounds of

    (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2          (32 x 32 -> 64-bit products)
    c = (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)
    k = (k0 + W0, k1 + W1) mod 2^32                      (after every round)

Every word is held in an int64 tensor (or, for a key word, a Python int or a 0-d int64 tensor) with a value in
[0, 2^32); the counters broadcast against each other, so counters that vary along different dimensions (a row
index, a column index, a feature group) are never materialised before the products make them full. Two forms,
the same numbers (tests/kernels/test_keyed_dropout.py checks both against Random123's known-answer vectors):
  * `philox` - int64 arithmetic only (products wrap modulo 2^64, the high word is a shift and a mask): what
    torch.compile traces and fuses, on any device, with tensor keys;
  * `philox_words32` - the eager CPU form: the products' high and low words are read as int32 views of the
    64-bit products (no shift, no mask), the xors run on 4-byte words, and a word is widened back to 64 bits
    through a uint32 view (zero extension). About 30% less work on this CPU; needs a little-endian machine.
"""

from __future__ import annotations

import sys

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key increments (golden ratio, sqrt(3) - 1)
MASK = 0xFFFFFFFF
ROUNDS = 10
LITTLE_ENDIAN = sys.byteorder == "little"


def philox(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
    """Philox-4x32-`rounds` of the counter (c0, c1, c2, c3) under the key (k0, k1): four int64 tensors with
    values in [0, 2^32), of the counters' broadcast shape. Counter words: int64 tensors (or ints) in [0, 2^32);
    key words: ints or 0-d int64 tensors (traced: no guard on their values)."""
    for r in range(rounds):
        p0, p1 = c0 * M0, c2 * M1
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, p0 & MASK
        if r + 1 < rounds:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return c0, c1, c2, c3


def _signed(k: int) -> int:
    """The int32 value with the bits of the 32-bit word k."""
    return k - (1 << 32) if k >= 1 << 31 else k


def _hi_lo(p: torch.Tensor):
    """(high word, low word) of int64 products p, as int32 views (little-endian: the low word comes first)."""
    v = p.unsqueeze(-1).view(torch.int32)  # [..., 2]
    return v[..., 1], v[..., 0]


def _wide(w: torch.Tensor) -> torch.Tensor:
    """A 32-bit word held as int32 -> int64 in [0, 2^32) (zero extension through a uint32 view)."""
    return w.view(torch.uint32).to(torch.int64)


def _narrow(w) -> torch.Tensor:
    """A 32-bit word held as int64 in [0, 2^32) -> int32 with the same bits."""
    w = torch.as_tensor(w)
    return (w - ((w >> 31) << 32)).to(torch.int32)


def philox_words32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = ROUNDS):
    """`philox` on the CPU in eager mode: the same numbers, as four int32 tensors holding the 32-bit words (read
    them with a uint32 view, or as bytes). Counter words: int64 tensors in [0, 2^32); key words: ints."""
    if not LITTLE_ENDIAN:  # the int32 views assume the low word first
        return tuple(_narrow(w) for w in philox(c0, c1, c2, c3, k0, k1, rounds))
    c0, c2 = torch.as_tensor(c0), torch.as_tensor(c2)
    c1, c3 = _narrow(c1), _narrow(c3)
    for r in range(rounds):
        hi0, lo0 = _hi_lo(c0 * M0)
        hi1, lo1 = _hi_lo(c2 * M1)
        n0 = torch.bitwise_xor(hi1, c1).bitwise_xor_(_signed(k0))
        n2 = torch.bitwise_xor(hi0, c3).bitwise_xor_(_signed(k1))
        c1, c3 = lo1, lo0
        if r + 1 < rounds:
            c0, c2 = _wide(n0), _wide(n2)
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        else:
            c0, c2 = n0, n2
    return c0, c1, c2, c3
