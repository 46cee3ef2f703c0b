"""megamemo/plan/optrace.py: the model's op trace over meta tensors - its GEMM FLOPs against model/flops.py's count
(forward and backward), its bytes against a small op sequence counted by hand, and the rules that build a stage
or a micro-batch from the traced pieces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megamemo.model import ModelConfig
from megamemo.model.flops import forward_flops
from megamemo.plan.optrace import FIELDS, _run, local_config, record, trace

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.


def small(variant="lamemo", L=16, M=16, **kw) -> ModelConfig:
    base = dict(
        variant=variant,
        n_token=96,
        n_layer=3,
        d_model=32,
        n_head=4,
        d_head=8,
        d_inner=64,
        dropout=0.1,
        tgt_len=L,
        mem_len=M,
    )
    return ModelConfig(**{**base, **kw})


def test_elementwise_bytes_of_a_small_op_sequence_by_hand():
    """[4, 8, 16] bf16 scores (512 elements: 1 KiB in bf16, 2 KiB in fp32) cast to fp32, masked by a [16] bool mask,
    softmax, back to bf16, transposed and made contiguous, dropout, summed; then the backward. Every kernel's bytes
    read and written, by hand; views (transpose, expand) launch nothing."""
    x = torch.empty(4, 8, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    mask = torch.empty(16, dtype=torch.bool, device="meta")

    def fn():
        s = x.float().masked_fill(mask, float("-inf"))
        y = torch.softmax(s, -1).to(torch.bfloat16).transpose(0, 1).contiguous()
        F.dropout(y, 0.1, True).sum().backward()

    seg = record(fn)
    assert list(zip(seg.names, seg.read, seg.write, strict=True)) == [
        ("_to_copy", 1024, 2048),  # bf16 in, fp32 out
        ("masked_fill", 2048 + 16, 2048),  # the scores and the 16-byte mask, broadcast: read once
        ("_softmax", 2048, 2048),
        ("_to_copy", 2048, 1024),  # back to bf16
        ("clone", 1024, 1024),  # contiguous() of the transposed view
        ("native_dropout", 1024, 1024 + 512),  # CUDA's one kernel: the output and its bool mask
        ("sum", 1024, 2),
        ("ones_like", 0, 2),  # backward(): the loss's gradient, written only
        ("native_dropout_backward", 2 + 512, 1024),  # the gradient expanded from one element, and the mask
        ("_to_copy", 1024, 2048),  # the cast's backward: bf16 gradient to fp32
        ("_softmax_backward_data", 2048 + 2048, 2048),  # the gradient and the saved probabilities
        ("masked_fill", 2048 + 16, 2048),  # masked positions' gradient zeroed
        ("_to_copy", 2048, 1024),  # x's gradient, bf16
    ]
    assert not seg.gemm.any() and (seg.launches == 1).all()
    # an index op reads the rows it gathers, not its whole table: 6 ids (int64) of a [100, 16] bf16 table
    table = torch.empty(100, 16, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(6, dtype=torch.long, device="meta")
    seg = record(lambda: F.embedding(ids, table))
    assert list(zip(seg.names, seg.read, seg.write, strict=True)) == [("embedding", 6 * 8 + 6 * 16 * 2, 6 * 16 * 2)]


def extra_and_rnet(m: ModelConfig, B: int) -> tuple[float, float, float]:
    """What the trace counts beyond flops.py (tests/model/test_flops.py's two known differences, per direction, and what
    a fused kernel recomputes): E, the position products' extra row of R (rel_shift: klen + 1 and M + 1 rows),
    2 (L or M) H B a product in the forward (twice in the backward); R, r_net's input gradient, which the backward
    does not compute (the sinusoids need none): 2 P d H a layer, P = klen (+ M for LaMemo's future distances); and
    S, Transformer-XL's fused attention kernel (scaled_dot_product_attention: no normaliser, no dropout), whose
    backward recomputes the content scores: 2 L klen H B a layer (torch's flop formula counts it)."""
    L, H, d = m.tgt_len, m.n_head * m.d_head, m.d_model
    M = m.mem_len if m.has_memory else 0
    klen = L + M
    if not m.lamemo:
        return m.n_layer * 2 * L * H * B, m.n_layer * 2 * klen * d * H, m.n_layer * 2 * L * klen * H * B
    la = m.variant != "lamemo_no_lookahead"
    e = m.n_layer * (2 * L * H * B + (2 * M * H * B if la else 0)) - (2 * M * H * B if la and M <= L else 0)
    return e, m.n_layer * 2 * (klen + M) * d * H, 0


@pytest.mark.parametrize(
    "variant,L,M,tp,B",
    [
        ("lamemo", 16, 16, 1, 1),
        ("lamemo", 16, 16, 2, 3),
        ("lamemo", 8, 24, 1, 2),
        ("lamemo_no_lookahead", 16, 16, 1, 2),
        ("lamemo_xlrpe", 16, 8, 4, 5),
        ("xl", 16, 24, 1, 2),
        ("xl", 16, 16, 2, 4),
        ("rpe", 16, 16, 1, 3),
    ],
)
def test_the_traces_gemm_flops_are_flops_py_forward_and_backward(variant, L, M, tp, B):
    """A stage of every layer (input side, lower layers, top layer, output side): forward = flops.py's forward + E,
    backward = 2 x flops.py's forward + 2E - R + S, all over tp on a tensor-parallel rank (extra_and_rnet). B 3 and
    5 are interpolated from traces at 2 and 4 streams."""
    m = small(variant, L, M)
    fwd, bwd = trace(m, B, tp, "bf16").stage(m.n_layer, True, True)
    e, r, s = extra_and_rnet(m, B)
    f = forward_flops(m, B)
    assert fwd.flops.sum() == pytest.approx((f + e) / tp, rel=1e-12)
    assert bwd.flops.sum() == pytest.approx((2 * f + 2 * e - r + s) / tp, rel=1e-12)


def test_a_micro_batch_is_interpolated_exactly():
    """Micro-batch 3 and 6 from the traces at 2 and 4 streams equal their own traces, op by op."""
    m = small("lamemo")
    local = local_config(m, 2)
    for B in (3, 6):
        got, direct = trace(m, B, 2, "fp16"), _run(local, B, torch.float16)
        for k, seg in direct.segments.items():
            assert got.segments[k].names == seg.names
            for f in FIELDS:
                np.testing.assert_allclose(getattr(got.segments[k], f), getattr(seg, f), rtol=1e-12)


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_a_stage_of_n_layers_is_the_trace_of_an_n_layer_model(variant):
    """The 2-layer trace's lower layer repeated (Transformer-XL's memory update with each layer): a 5-layer model's
    whole trace - its FLOPs exactly; its bytes and kernels but for the shared position biases' gradients, which
    autograd sums in a few more small adds in a deeper model (3 kernels and 576 bytes of 7.5 MB here) - and with
    activation checkpointing every layer's forward once more in the backward."""
    m = small(variant)
    five = _run(dataclasses.replace(local_config(m, 1), n_layer=5), 2, torch.bfloat16)
    updates = 5 if five.memory_per_layer else 1  # the 5-layer run kept one update's ops

    def whole(f):
        return sum(getattr(s, f).sum() * (updates if k == ("fwd", "memory") else 1) for k, s in five.segments.items())

    ops = trace(m, 2, 1, "bf16")
    fwd, bwd = ops.stage(5, True, True)
    assert whole("flops") == pytest.approx(fwd.flops.sum() + bwd.flops.sum(), rel=1e-12)
    for f, tol in (("bytes", 1e-3), ("launches", 1e-2)):
        assert whole(f) == pytest.approx(getattr(fwd, f).sum() + getattr(bwd, f).sum(), rel=tol)
    again = ops.stage(5, True, True, recompute=True)[1]
    layers = 4 * ops.segments["fwd", "layer"].flops.sum() + ops.segments["fwd", "top"].flops.sum()
    assert again.flops.sum() == pytest.approx(bwd.flops.sum() + layers, rel=1e-12)
    # a middle pipeline stage: lower layers only, no embedding or output side
    mid_fwd, _ = ops.stage(2, False, False)
    assert mid_fwd.flops.sum() == pytest.approx(2 * ops.segments["fwd", "layer"].flops.sum(), rel=1e-12)


def test_kernels_are_cudas_dropout_and_attention_not_the_meta_decompositions():
    xl = trace(small("xl"), 2, 1, "bf16")
    names = [n for s in xl.segments.values() for n in s.names]
    assert "_scaled_dot_product_efficient_attention" in names
    assert "_scaled_dot_product_efficient_attention_backward" in names
    assert "native_dropout" in names and "bernoulli_" not in names
    quiet = trace(small("lamemo", dropout=0.0), 2, 1, "bf16")
    assert not any("dropout" in n for s in quiet.segments.values() for n in s.names)


def test_lamemos_position_products_are_unaligned_gemms():
    """klen + 1 = 33 and M + 1 = 17 columns of R (rel_shift's extra row): an odd row length in bf16, not a 16-byte
    multiple; the projections (d 32, 4 x 8 heads, d_inner 64) and the content products are aligned. A lower layer's
    forward: the causal and the look-ahead position products."""
    ops = trace(small("lamemo"), 2, 1, "bf16")
    fwd = ops.segments["fwd", "layer"]
    unaligned = fwd.gemm & ~fwd.aligned
    assert unaligned.sum() == 2 and set(np.array(fwd.names)[unaligned]) == {"bmm"}
    assert sorted(fwd.cols[unaligned]) == [17, 33]
    assert fwd.gemm.sum() > 2


# ---- model.attention: fused (megamemo/plan/fused_trace.py) ------------------------------------------------------
def test_fused_tiles_by_hand():
    """64 x 64 tiles with a visible pair. Causal, L = M = 128 (klen 256): queries 0-63 see keys up to 191 (3 key
    tiles), queries 64-127 up to 255 (4); L = 64 after M = 65 rows: query 63 sees key 128, the first of the third key
    tile. Look-ahead, M = nk = 128: memory query i sees keys k >= i (key k sits at
    position k + 1), so queries 0-63 touch both key tiles, 64-127 only the second."""
    from megamemo.plan.fused_trace import causal_tiles, lookahead_tiles

    assert causal_tiles(128, 256) == 7 and causal_tiles(128, 128) == 3 and causal_tiles(100, 100) == 3
    assert causal_tiles(64, 129) == 3
    assert lookahead_tiles(128, 128) == 3 and lookahead_tiles(128, 64) == 2 and lookahead_tiles(64, 64) == 1


def test_fused_attention_is_priced_without_score_round_trips():
    """The fused form's layer: one forward and one backward attention record a call, with the kernels' FLOPs by
    hand, and no op that reads or writes a [L, klen] score matrix, where the eager layer has several."""
    from megamemo.plan.fused_trace import causal_tiles, lookahead_tiles

    cfg = small(L=128, M=128, n_head=2, d_head=16, n_layer=2)  # one lower layer, then the top
    eager, fused = (_run(dataclasses.replace(cfg, attention=a), 2, torch.bfloat16) for a in ("eager", "fused"))
    scores = 2 * cfg.n_head * 128 * 256 * 2  # one bf16 [B, n, L, klen] tensor
    for tr, n_big in ((eager, lambda k: k > 0), (fused, lambda k: k == 0)):
        fwd, bwd = tr.segments["fwd", "layer"], tr.segments["bwd", "layer"]
        big = int(
            ((fwd.write >= scores) | (fwd.read >= scores)).sum() + ((bwd.write >= scores) | (bwd.read >= scores)).sum()
        )
        assert n_big(big), (big, fwd.names)
    fwd, bwd = fused.segments["fwd", "layer"], fused.segments["bwd", "layer"]
    pairs = 2 * cfg.n_head * (causal_tiles(128, 256) + lookahead_tiles(128, 128)) * 64 * 64  # B 2, 64 x 64 tiles
    # in 2 * d_head per pair: forward content 1 + position band 2 + PV 1; backward 6 + 7 + 6 (fused_trace.py)
    assert list(fwd.names).count("fused_attention_fwd") == 2 and list(bwd.names).count("fused_attention_bwd") == 2
    got = fwd.flops[np.array(fwd.names) == "fused_attention_fwd"].sum()
    assert got == 2 * cfg.d_head * pairs * 4
    got = bwd.flops[np.array(bwd.names) == "fused_attention_bwd"].sum()
    assert got == 2 * cfg.d_head * pairs * 19
