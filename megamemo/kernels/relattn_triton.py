"""Triton kernels of relative-position attention with the rel-shifted position term fused: the scores, the position
product and the probabilities stay on chip, forward and backward (FlashAttention-2's tiling and online softmax).

For queries i and keys j of one head and one stream (megamemo/model/attention.py states the maths):

    score[i, j] = ((q_i + u) . k_j + (q_i + vb) . R[s0 - i + j]) * scale,     -inf where mask[i, j]

The position term of a BM x BN tile (queries i0.., keys j0..) needs the BM + BN - 1 consecutive rows of R from
base = s0 - i0 - (BM - 1) + j0: one product band = (q + vb) @ R[base : base + T]^T of [BM, T] (T = BM + BN, a power
of two, the last column unused), then the skewed diagonal pos[i, j] = band[i, (BM - 1) - i + j], read with
`tl.gather` inside the tile. The dense [Q, K] position term is never formed. Rows of R outside [0, W) load as
zeros: they meet only hidden pairs.

The mask is any [Q, K] boolean (causal, same_length, the look-ahead's), read tile by tile; a table of tiles that
hold a visible pair lets every kernel skip the hidden ones (a quarter of the causal tiles at L = M, about half of
the look-ahead's).

Backward (dO, and dLSE since LaMemo's interpolation differentiates through the log-normaliser): with
P = exp(score - lse) and D_i = dO_i . O_i - dLSE_i, dScore = P * (dO V^T - D). Three kernels, none with atomics, so
the gradients are bit-identical run to run (train.deterministic can use them):
  * _bwd_kv, one program per key tile: dK = scale dScore^T (q + u), dV = P^T dO;
  * _bwd_q, one program per query tile: the content part scale dScore K and the position part scale G R_band of
    dq (G: dScore scattered back onto the band's skew, [BM, T]), kept apart for du and dvb;
  * _bwd_r, one program per head and tile diagonal (tiles with equal j0 - i0 read the same band of R): the band's
    gradient scale G^T (q + vb) summed over the streams and the diagonal's tiles; adjacent diagonals' bands overlap
    by BN - 1 rows, so the caller adds them in two passes (even and odd diagonals), without contention.

Kernels launch on CUDA tensors, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before
triton is imported), which runs the same source in numpy: that is how the suite checks them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (the interpreter with half-precision inputs, whose numpy dot of bf16
    does not compute products of the values): the operands, already rounded to their dtype, multiplied as fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _tile_scores(
    qu,
    qv,
    K,
    R,
    k_row0,
    r_row0,
    z,
    h,
    k_len,
    r_rows,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(scores [BM, BN] before the scale and mask, the keys [BN, DH], the band of R [T, DH]) of one tile."""
    offs_n = k_row0 + tl.arange(0, BN)
    offs_d = tl.arange(0, DH)
    k = tl.load(K + z * sk_z + offs_n[:, None] * sk_t + offs_d[None, :], mask=(offs_n < k_len)[:, None], other=0.0)
    rows = r_row0 + tl.arange(0, T)
    r = tl.load(
        R + h * sr_h + rows[:, None] * sr_t + offs_d[None, :], mask=((rows >= 0) & (rows < r_rows))[:, None], other=0.0
    )
    band = _mm(qv, tl.trans(r), PREC, UPCAST)  # [BM, T]
    skew = (BM - 1) - tl.arange(0, BM)[:, None] + tl.arange(0, BN)[None, :]  # in [0, BM+BN-2]
    s = _mm(qu, tl.trans(k), PREC, UPCAST) + tl.gather(band, skew, axis=1)
    return s, k, r


@triton.jit
def _hidden(MASK, q_row0, k_row0, q_len, k_len, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] True where the pair is hidden (or outside the matrix)."""
    offs_m = q_row0 + tl.arange(0, BM)
    offs_n = k_row0 + tl.arange(0, BN)
    inside = (offs_m < q_len)[:, None] & (offs_n < k_len)[None, :]
    return tl.load(MASK + offs_m[:, None] * k_len + offs_n[None, :], mask=inside, other=1) != 0


@triton.jit
def _load_queries(Q, U, VB, q_row0, z, h, q_len, sq_z, sq_t, DH: tl.constexpr, BM: tl.constexpr):
    """(q + u, q + vb) of one query tile in Q's dtype (the sums in fp32, rounded once)."""
    offs_m = q_row0 + tl.arange(0, BM)
    offs_d = tl.arange(0, DH)
    q = tl.load(Q + z * sq_z + offs_m[:, None] * sq_t + offs_d[None, :], mask=(offs_m < q_len)[:, None], other=0.0)
    u = tl.load(U + h * DH + offs_d).to(tl.float32)
    vb = tl.load(VB + h * DH + offs_d).to(tl.float32)
    qf = q.to(tl.float32)
    return (qf + u[None, :]).to(q.dtype), (qf + vb[None, :]).to(q.dtype)


@triton.jit
def _fwd(
    Q,
    K,
    V,
    R,
    U,
    VB,
    MASK,
    TILES,
    OUT,
    LSE,
    n_batch,
    q_len,
    k_len,
    r_rows,
    s0,
    scale,
    n_kt,
    sq_z,
    sq_t,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    ti = tl.program_id(0)
    z = tl.program_id(1)
    h = z // n_batch
    q_row0 = ti * BM
    qu, qv = _load_queries(Q, U, VB, q_row0, z, h, q_len, sq_z, sq_t, DH, BM)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DH], tl.float32)
    offs_d = tl.arange(0, DH)
    for tj in range(0, n_kt):
        if tl.load(TILES + ti * n_kt + tj) != 0:
            k_row0 = tj * BN
            s, k, r = _tile_scores(
                qu,
                qv,
                K,
                R,
                k_row0,
                s0 - q_row0 - (BM - 1) + k_row0,
                z,
                h,
                k_len,
                r_rows,
                sk_z,
                sk_t,
                sr_h,
                sr_t,
                DH,
                BM,
                BN,
                T,
                PREC,
                UPCAST,
            )
            s = tl.where(_hidden(MASK, q_row0, k_row0, q_len, k_len, BM, BN), float("-inf"), s * scale)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            offs_n = k_row0 + tl.arange(0, BN)
            v = tl.load(
                V + z * sk_z + offs_n[:, None] * sk_t + offs_d[None, :], mask=(offs_n < k_len)[:, None], other=0.0
            )
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC, UPCAST)
            m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past q_len: never stored
    offs_m = q_row0 + tl.arange(0, BM)
    rows_in = offs_m < q_len
    tl.store(
        OUT + z * sq_z + offs_m[:, None] * sq_t + offs_d[None, :],
        (acc / l_safe[:, None]).to(OUT.dtype.element_ty),
        mask=rows_in[:, None],
    )
    tl.store(LSE + z * q_len + offs_m, m_i + tl.log(l_safe), mask=rows_in)


@triton.jit
def _tile_dscore(
    qu,
    qv,
    K,
    V,
    R,
    MASK,
    DO,
    LSE,
    DELTA,
    q_row0,
    k_row0,
    r_row0,
    z,
    h,
    q_len,
    k_len,
    r_rows,
    scale,
    sq_z,
    sq_t,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(P [BM, BN], dScore [BM, BN], keys, values, band of R, dO tile) of one tile, recomputed from the saved LSE."""
    s, k, r = _tile_scores(
        qu, qv, K, R, k_row0, r_row0, z, h, k_len, r_rows, sk_z, sk_t, sr_h, sr_t, DH, BM, BN, T, PREC, UPCAST
    )
    s = tl.where(_hidden(MASK, q_row0, k_row0, q_len, k_len, BM, BN), float("-inf"), s * scale)
    offs_m = q_row0 + tl.arange(0, BM)
    rows_in = offs_m < q_len
    lse = tl.load(LSE + z * q_len + offs_m, mask=rows_in, other=0.0)
    delta = tl.load(DELTA + z * q_len + offs_m, mask=rows_in, other=0.0)
    p = tl.exp(s - lse[:, None])
    offs_d = tl.arange(0, DH)
    offs_n = k_row0 + tl.arange(0, BN)
    v = tl.load(V + z * sk_z + offs_n[:, None] * sk_t + offs_d[None, :], mask=(offs_n < k_len)[:, None], other=0.0)
    do = tl.load(DO + z * sq_z + offs_m[:, None] * sq_t + offs_d[None, :], mask=rows_in[:, None], other=0.0)
    dp = _mm(do, tl.trans(v), PREC, UPCAST)
    return p, p * (dp - delta[:, None]), k, v, r, do


@triton.jit
def _band_of(ds, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr):
    """dScore [BM, BN] scattered onto its band's skew: G[i, t] = ds[i, t - (BM-1) + i] where that is a key of the
    tile, else 0 ([BM, T])."""
    col = tl.arange(0, T)[None, :] - (BM - 1) + tl.arange(0, BM)[:, None]
    inside = (col >= 0) & (col < BN)
    return tl.where(inside, tl.gather(ds, tl.minimum(tl.maximum(col, 0), BN - 1), axis=1), 0.0)


@triton.jit
def _bwd_kv(
    Q,
    K,
    V,
    R,
    U,
    VB,
    MASK,
    TILES,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    n_batch,
    q_len,
    k_len,
    r_rows,
    s0,
    scale,
    n_qt,
    n_kt,
    sq_z,
    sq_t,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tj = tl.program_id(0)
    z = tl.program_id(1)
    h = z // n_batch
    k_row0 = tj * BN
    dk = tl.zeros([BN, DH], tl.float32)
    dv = tl.zeros([BN, DH], tl.float32)
    for ti in range(0, n_qt):
        if tl.load(TILES + ti * n_kt + tj) != 0:
            q_row0 = ti * BM
            qu, qv = _load_queries(Q, U, VB, q_row0, z, h, q_len, sq_z, sq_t, DH, BM)
            p, ds, k, v, r, do = _tile_dscore(
                qu,
                qv,
                K,
                V,
                R,
                MASK,
                DO,
                LSE,
                DELTA,
                q_row0,
                k_row0,
                s0 - q_row0 - (BM - 1) + k_row0,
                z,
                h,
                q_len,
                k_len,
                r_rows,
                scale,
                sq_z,
                sq_t,
                sk_z,
                sk_t,
                sr_h,
                sr_t,
                DH,
                BM,
                BN,
                T,
                PREC,
                UPCAST,
            )
            dv += _mm(tl.trans(p.to(do.dtype)), do, PREC, UPCAST)
            dk += _mm(tl.trans(ds.to(qu.dtype)), qu, PREC, UPCAST)
    offs_n = k_row0 + tl.arange(0, BN)
    offs_d = tl.arange(0, DH)
    keep = (offs_n < k_len)[:, None]
    tl.store(DK + z * sk_z + offs_n[:, None] * sk_t + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=keep)
    tl.store(DV + z * sk_z + offs_n[:, None] * sk_t + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=keep)


@triton.jit
def _bwd_q(
    Q,
    K,
    V,
    R,
    U,
    VB,
    MASK,
    TILES,
    DO,
    LSE,
    DELTA,
    DQC,
    DQP,
    n_batch,
    q_len,
    k_len,
    r_rows,
    s0,
    scale,
    n_kt,
    sq_z,
    sq_t,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    ti = tl.program_id(0)
    z = tl.program_id(1)
    h = z // n_batch
    q_row0 = ti * BM
    qu, qv = _load_queries(Q, U, VB, q_row0, z, h, q_len, sq_z, sq_t, DH, BM)
    dqc = tl.zeros([BM, DH], tl.float32)
    dqp = tl.zeros([BM, DH], tl.float32)
    for tj in range(0, n_kt):
        if tl.load(TILES + ti * n_kt + tj) != 0:
            k_row0 = tj * BN
            p, ds, k, v, r, do = _tile_dscore(
                qu,
                qv,
                K,
                V,
                R,
                MASK,
                DO,
                LSE,
                DELTA,
                q_row0,
                k_row0,
                s0 - q_row0 - (BM - 1) + k_row0,
                z,
                h,
                q_len,
                k_len,
                r_rows,
                scale,
                sq_z,
                sq_t,
                sk_z,
                sk_t,
                sr_h,
                sr_t,
                DH,
                BM,
                BN,
                T,
                PREC,
                UPCAST,
            )
            dqc += _mm(ds.to(k.dtype), k, PREC, UPCAST)
            dqp += _mm(_band_of(ds, BM, BN, T).to(r.dtype), r, PREC, UPCAST)
    offs_m = q_row0 + tl.arange(0, BM)
    offs_d = tl.arange(0, DH)
    at = z * q_len * DH + offs_m[:, None] * DH + offs_d[None, :]
    keep = (offs_m < q_len)[:, None]
    tl.store(DQC + at, dqc * scale, mask=keep)
    tl.store(DQP + at, dqp * scale, mask=keep)


@triton.jit
def _bwd_r(
    Q,
    K,
    V,
    R,
    U,
    VB,
    MASK,
    TILES,
    DO,
    LSE,
    DELTA,
    DRB,
    n_batch,
    q_len,
    k_len,
    r_rows,
    s0,
    scale,
    n_qt,
    n_kt,
    sq_z,
    sq_t,
    sk_z,
    sk_t,
    sr_h,
    sr_t,
    DH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """DRB [heads, n_qt + n_kt - 1, T, DH] fp32: diagonal d_idx = tj - ti + n_qt - 1 (BM == BN)."""
    d_idx = tl.program_id(0)
    h = tl.program_id(1)
    d = d_idx - (n_qt - 1)
    r_row0 = s0 - (BM - 1) + d * BN
    acc = tl.zeros([T, DH], tl.float32)
    ti_lo = tl.maximum(0, -d)
    ti_hi = tl.minimum(n_qt, n_kt - d)
    for b in range(0, n_batch):
        z = h * n_batch + b
        for ti in range(ti_lo, ti_hi):
            tj = ti + d
            if tl.load(TILES + ti * n_kt + tj) != 0:
                q_row0 = ti * BM
                qu, qv = _load_queries(Q, U, VB, q_row0, z, h, q_len, sq_z, sq_t, DH, BM)
                p, ds, k, v, r, do = _tile_dscore(
                    qu,
                    qv,
                    K,
                    V,
                    R,
                    MASK,
                    DO,
                    LSE,
                    DELTA,
                    q_row0,
                    tj * BN,
                    r_row0,
                    z,
                    h,
                    q_len,
                    k_len,
                    r_rows,
                    scale,
                    sq_z,
                    sq_t,
                    sk_z,
                    sk_t,
                    sr_h,
                    sr_t,
                    DH,
                    BM,
                    BN,
                    T,
                    PREC,
                    UPCAST,
                )
                acc += _mm(tl.trans(_band_of(ds, BM, BN, T).to(qv.dtype)), qv, PREC, UPCAST)
    offs_t = tl.arange(0, T)
    offs_d = tl.arange(0, DH)
    tl.store(DRB + ((h * (n_qt + n_kt - 1) + d_idx) * T + offs_t[:, None]) * DH + offs_d[None, :], acc * scale)
