"""The one memory-carrying segment scorer (megamemo/model/scoring.py) against statements that do not use it:
* Transformer-XL with a memory long enough to keep every past row is a causal model of the whole text: scored in
  segments it gives the per-token NLL of one forward over the concatenated segments;
* LaMemo: a hand loop over the segments (the model called segment by segment, memory passed on) gives the same
  sums, counts and final memory, from an empty or a given starting memory, for all or the first K segments;
* eval mode while it runs (dropout off), the caller's training mode afterwards, also after an error."""

from __future__ import annotations

import pytest
import torch
from helpers.bounds import forward_bound, sum_bound

from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.model.lengths import Lengths
from megamemo.model.scoring import score_segments

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)

L, B, N_SEG = 5, 3, 4


def _model(variant: str, **kw) -> MemTransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        variant=variant,
        n_token=40,
        n_layer=2,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        dropout=0.3,
        tgt_len=L,
        mem_len=kw.pop("mem_len", L),
        **kw,
    )
    return MemTransformerLM(cfg).train()


def _segments(seed: int = 1):
    text = torch.randint(0, 40, (N_SEG * L + 1, B), generator=torch.Generator().manual_seed(seed))
    return text, [(text[i : i + L], text[i + 1 : i + 1 + L]) for i in range(0, N_SEG * L, L)]


def test_xl_with_room_for_everything_equals_one_forward_over_the_whole_text():
    model = _model("xl", mem_len=N_SEG * L)
    text, segments = _segments()
    per_token = []
    s = score_segments(model, segments, on_segment=lambda sc, x, y, nll: per_token.append(nll))
    assert model.training  # given back as it came
    model.eval()
    with torch.no_grad():
        whole, _ = model(text[:-1], text[1:], mem_len=0)  # one segment: no memory at all
    # segment by segment against one pass: other shapes, so possibly other orders of the same sums (equal bit for bit
    # on this Xeon at both ISAs, which another CPU's GEMM blocking need not keep): fp32, two orders of a forward
    # pass over all N_SEG * L keys (tests/helpers/bounds.py) at max|nll|
    tol = forward_bound(model.cfg, float(whole.abs().max()), klen=N_SEG * L)
    assert torch.allclose(torch.cat(per_token), whole, atol=tol, rtol=0)
    assert (s.tokens, s.segments) == (N_SEG * L * B, N_SEG)
    # the fp64 total of the per-token values: each within tol, plus fp64's summation (2 N u64 sum|nll|)
    total = float(whole.double().sum())
    assert float(s.nll) == pytest.approx(total, rel=0, abs=s.tokens * tol + sum_bound(s.tokens, total, torch.float64))
    assert s.nll.dtype == torch.float64 and s.memory.length == N_SEG * L


@pytest.mark.parametrize("start", ["empty", "given"])
@pytest.mark.parametrize("limit", [None, 2])
def test_lamemo_equals_a_hand_loop(start, limit):
    model = _model("lamemo")
    _, segments = _segments()
    memory = None
    if start == "given":
        model.eval()
        with torch.no_grad():
            _, memory = model(*_segments(seed=7)[1][0])
        model.train()
    s = score_segments(model, segments, memory=memory, max_segments=limit)

    model.eval()
    mem, total, tokens = memory, 0.0, 0
    with torch.no_grad():
        for x, y in segments[:limit]:
            nll, mem = model(x, y, mem)
            total += sum(float(v) for v in nll.double().reshape(-1))
            tokens += nll.numel()
    assert (s.tokens, s.segments) == (tokens, len(segments[:limit]))
    # the same model calls on the same shapes: the same per-token values; only the fp64 sums' order may differ:
    # 2 N u64 of the (positive) total: 1.3e-14 relative for N = 60 tokens
    assert float(s.nll) == pytest.approx(total, rel=0, abs=sum_bound(tokens, total, torch.float64))
    assert s.mean == pytest.approx(total / tokens, rel=0, abs=sum_bound(tokens + 1, total / tokens, torch.float64))
    assert s.memory.equal(mem)


def test_lengths_reach_the_model_and_training_mode_comes_back_after_an_error():
    model = _model("xl")
    _, segments = _segments()
    s = score_segments(model, segments, lengths=Lengths(mem=2 * L))
    assert s.memory.length == 2 * L

    def broken(model, inp, tgt, mem):
        assert not model.training
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        score_segments(model, segments, forward=broken)
    assert model.training
    empty = score_segments(model, [])
    assert (empty.tokens, empty.segments, float(empty.nll)) == (0, 0, 0.0) and empty.mean != empty.mean


def test_a_forward_that_scores_nothing_adds_nothing():
    """A pipeline stage before the last returns an NLL with no elements (train/validate.py)."""
    model = _model("rpe")
    _, segments = _segments()
    s = score_segments(model, segments, forward=lambda m, x, y, mem: (torch.zeros(0), Memory({}, batch_size=B)))
    assert (s.tokens, s.segments, float(s.nll)) == (0, N_SEG, 0.0)
