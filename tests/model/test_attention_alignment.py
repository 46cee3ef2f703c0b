"""The eager attention's position products padded to a multiple of 64 rows of R on CUDA (megamemo/model/attention.py
ROW_ALIGN): the added columns meet only hidden pairs, so the context, the log-normaliser and every gradient are the
unpadded ones. Exactly so in arithmetic; in floating point a GEMM of another width may sum each dot product's d_head
terms in another order (MKL's AVX2 path does, its AVX-512 path here does not), which moves a value by at most
d_head * u of the largest one (u = 2**-24); a misplaced row moves it by O(1). Run on the CPU with the alignment
turned on there, for causal (with same_length) and look-ahead attention at lengths that are not multiples of 64."""

from __future__ import annotations

import pytest
import torch

from megamemo.model import attention
from megamemo.model.positions import causal_mask, lookahead_mask

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)


def _both(L, M, same_length):
    g = torch.Generator().manual_seed(L * 100 + M)
    n, B, dh, klen, nk = 2, 3, 16, L + M, min(L, M)

    def t(*s):
        return torch.randn(*s, generator=g).requires_grad_()

    q, qm, k, v, r, u, vb = (
        t(n, B, L, dh),
        t(n, B, M, dh),
        t(n, B, klen, dh),
        t(n, B, klen, dh),
        t(n, klen + M, dh),
        t(n, dh),
        t(n, dh),
    )
    ctx, lse = attention.causal_attention(q, k, v, r, u, vb, causal_mask(L, M, M, same_length), 0.3)
    ahead, lse_ahead = attention.lookahead_attention(
        qm, k[:, :, M - nk + 1 : M + 1], v[:, :, M - nk + 1 : M + 1], r[:, klen:], u, vb, lookahead_mask(M, nk), 0.3
    )
    loss = (ctx * 1.5).sum() + lse.sum() + (ahead * 0.5).sum() + (lse_ahead * 2).sum()
    return [ctx, lse, ahead, lse_ahead, *torch.autograd.grad(loss, (q, qm, k, v, r, u, vb))]


@pytest.mark.parametrize("L,M,same_length", [(16, 16, False), (20, 13, True), (7, 70, False)])
def test_aligned_position_rows_change_nothing(L, M, same_length, monkeypatch):
    monkeypatch.setattr(attention, "ROW_ALIGN", {})
    plain = _both(L, M, same_length)
    monkeypatch.setattr(attention, "ROW_ALIGN", {"cpu": 64})
    widths = []
    real = attention._position_term
    monkeypatch.setattr(
        attention, "_position_term", lambda qs, b, rows: widths.append(rows.size(1)) or real(qs, b, rows)
    )
    aligned = _both(L, M, same_length)
    assert widths and all(w % 64 == 0 for w in widths), widths
    for a, b in zip(plain, aligned, strict=True):
        assert float((a - b).abs().max()) <= 16 * 2.0**-24 * float(a.abs().max()), (L, M)
