"""The one memory-carrying segment scorer (megamemo/model/scoring.py) against statements that do not use it:
  * Transformer-XL with a memory long enough to keep every past row is a causal model of the whole text: scored in
    segments it gives the per-token NLL of one forward over the concatenated segments;
  * LaMemo: a hand loop over the segments (the model called segment by segment, memory passed on) gives the same
    sums, counts and final memory, from an empty or a given starting memory, for all or the first K segments;
  * eval mode while it runs (dropout off), the caller's training mode afterwards, also after an error."""
from __future__ import annotations

import pytest
import torch

from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.model.lengths import Lengths
from megamemo.model.scoring import score_segments

L, B, N_SEG = 5, 3, 4


def _model(variant: str, **kw) -> MemTransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(variant=variant, n_token=40, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32,
                      dropout=0.3, tgt_len=L, mem_len=kw.pop("mem_len", L), **kw)
    return MemTransformerLM(cfg).train()


def _segments(seed: int = 1):
    text = torch.randint(0, 40, (N_SEG * L + 1, B), generator=torch.Generator().manual_seed(seed))
    return text, [(text[i:i + L], text[i + 1:i + 1 + L]) for i in range(0, N_SEG * L, L)]


def test_xl_with_room_for_everything_equals_one_forward_over_the_whole_text():
    model = _model("xl", mem_len=N_SEG * L)
    text, segments = _segments()
    per_token = []
    s = score_segments(model, segments, on_segment=lambda sc, x, y, nll: per_token.append(nll))
    assert model.training                                   # given back as it came
    model.eval()
    with torch.no_grad():
        whole, _ = model(text[:-1], text[1:], mem_len=0)    # one segment: no memory at all
    assert torch.allclose(torch.cat(per_token), whole, atol=1e-5, rtol=0)
    assert (s.tokens, s.segments) == (N_SEG * L * B, N_SEG)
    assert float(s.nll) == pytest.approx(float(whole.double().sum()), rel=1e-6)
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
    assert float(s.nll) == pytest.approx(total, rel=1e-12)
    assert s.mean == pytest.approx(total / tokens, rel=1e-12)
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
