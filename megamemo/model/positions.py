"""Sinusoidal relative positions and the index arithmetic that aligns them with query/key pairs."""

from __future__ import annotations

import functools

import torch

# Positions are always computed in fp32, whatever the dtype of the module that uses them: the angles pos x inv_freq
# reach ~1e3-1e4 radians at real lengths, where bf16 (8 bits) keeps steps of 4-64 radians and fp16 steps of 0.5-8,
# so an angle rounded to half precision is a different position. The frequencies are therefore not a module buffer
# (module.to(bf16) would round them too); sinusoid() reads them from a per-device fp32 cache and casts only its
# result. Every path (training, pipeline stages, eval, the conversion probe, generation, TRAMS) goes through it.


def inv_freq(d_model: int) -> torch.Tensor:
    """[d_model / 2] fp32 inverse frequencies, computed on the CPU (the same values on every device)."""
    return 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, dtype=torch.float32, device="cpu") / d_model))


@functools.cache
def _inv_freq_on(d_model: int, device: torch.device) -> torch.Tensor:
    return inv_freq(d_model).to(device)


def sinusoid(pos: torch.Tensor, d_model: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[P] positions -> [P, d_model] in `dtype`: all sines, then all cosines (concatenated, not interleaved). The
    angles and their sines/cosines are fp32; only the result is cast."""
    freq = _inv_freq_on(d_model, pos.device)
    angles = pos.float()[:, None] * freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


def position_sequence(klen: int, mlen: int, clamp_len: int, future: str | None, device=None) -> torch.Tensor:
    """fp32 distances for the rows of R: klen-1 ... 0 (past), then for LaMemo the M future distances
    1..M ("abs", the disentangled RPE) or -1..-M ("signed", XL's RPE). clamp_len clamps from above only."""
    pos = torch.arange(klen - 1, -1, -1.0, dtype=torch.float32, device=device)
    if future is not None and mlen > 0:
        fut = torch.arange(1.0, mlen + 1, dtype=torch.float32, device=device)
        pos = torch.cat([pos, fut if future == "abs" else -fut])
    if clamp_len > 0:
        pos = pos.clamp(max=clamp_len)
    return pos


def causal_mask(qlen: int, mlen: int, mem_len: int, same_length: bool, device=None) -> torch.Tensor:
    """[qlen, klen] bool, True where key j is hidden from query i (at position mlen + i): j in its future, or,
    with same_length, j so far back that the query would see more than mem_len keys. Without memory
    (mem_len 0) same_length has nothing to equalise and changes nothing (the reference would mask every key)."""
    klen = mlen + qlen
    i = torch.arange(qlen, device=device)[:, None] + mlen
    j = torch.arange(klen, device=device)[None, :]
    mask = j > i
    if same_length and 0 < mem_len < klen:
        mask = mask | (j <= i - mem_len)
    return mask


def lookahead_mask(mlen: int, nk: int, device=None) -> torch.Tensor:
    """[mlen, nk] bool, True where look-ahead key k (position p = mlen-nk+1+k) is hidden from memory query i:
    p <= i (not after it)."""
    i = torch.arange(mlen, device=device)[:, None]
    p = torch.arange(mlen - nk + 1, mlen + 1, device=device)[None, :]
    return p <= i
