"""TRAMS memory selection: no selection is the plain model bit for bit; selection follows the metric; the selected
attention equals the plain model run on a memory holding just the selected rows (compressed positions)."""

import math

import pytest
import torch
from helpers.bounds import forward_bound, sum_bound, unit_roundoff
from helpers.eval_fixtures import one_thread  # noqa: F401 (autouse fixture)
from helpers.tiny import tiny_model

from megamemo.model import Memory, trams
from megamemo.model.trams import TramsConfig, key_scores, select_rows

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)

tiny = tiny_model


VARIANTS = ["xl", "lamemo", "lamemo_xlrpe", "lamemo_no_interp", "lamemo_no_lookahead", "rpe"]


def from_reference(mem_len: int, topk_num: int, remain_mem_num: int, metric: str = "code") -> TramsConfig:
    """The TramsConfig of the TRAMS scripts' arguments (mem_len 400, topk_num 50, remain_mem_num 150 by default). The
    reference selects only when topk_num != 0 (spec §6.2); with topk_num 0 (its baseline scripts: mem_len 200, topk 0,
    remain_mem_num left at 150) it takes the plain Transformer-XL path over all mem_len memory rows, whatever
    remain_mem_num says: every pool row attended (attend = recent = pool, topk 0)."""
    if topk_num == 0:
        return TramsConfig(pool=mem_len, attend=mem_len, recent=mem_len, metric=metric).validate()
    return TramsConfig(pool=mem_len, attend=topk_num + remain_mem_num, recent=remain_mem_num, metric=metric).validate()


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_without_selection_is_the_model_bit_for_bit(variant):
    """The inspectable forward (used by TRAMS and analyze) is the model's forward, memory included."""
    model = tiny(variant)
    data = torch.randint(0, 40, (30, 3), generator=torch.Generator().manual_seed(1))
    m1 = m2 = None
    with torch.no_grad():
        for s in range(6):
            x, y = data[4 * s : 4 * s + 4], data[4 * s + 1 : 4 * s + 5]
            same = s % 2 == 1 and variant != "rpe"  # (rpe has no memory: same_length would hide every key)
            n1, m1 = model(x, y, m1, mem_len=12, clamp_len=5, same_length=same)
            n2, m2 = trams.forward(model, x, y, m2, mem_len=12, clamp_len=5, same_length=same)
            assert torch.equal(n1, n2)
            assert m1.equal(m2)
        lp1, _ = model(x, None, m1)
        lp2, _ = trams.forward(model, x, None, m2)
        assert torch.equal(lp1, lp2)


@pytest.mark.parametrize("variant", ["xl", "lamemo"])
def test_pool_equal_to_attended_memory_is_the_plain_model(variant):
    model = tiny(variant)
    sel = TramsConfig(pool=12, attend=12, recent=5)
    data = torch.randint(0, 40, (40, 2), generator=torch.Generator().manual_seed(2))
    m1 = m2 = None
    with torch.no_grad():
        for s in range(8):  # the memory fills up to 12 rows and stays full
            x, y = data[4 * s : 4 * s + 4], data[4 * s + 1 : 4 * s + 5]
            n1, m1 = model(x, y, m1, mem_len=12)
            n2, m2 = trams.forward(model, x, y, m2, select=sel)
            assert torch.equal(n1, n2)
            assert m1.equal(m2)


def test_reference_arguments_with_topk_zero_attend_every_memory_row():
    """The TRAMS code selects only when topk_num != 0 (spec §6.2); its baseline (mem_len 200, topk_num 0,
    remain_mem_num left at its default 150) is the plain Transformer-XL over all mem_len rows. So
    from_reference(pool, 0, remain) is the plain model with mem_len = pool bit for bit - not a window of the
    `remain` newest rows, which scores differently here once the memory holds more than `remain` rows."""
    assert (lambda c: (c.pool, c.attend, c.recent, c.topk))(from_reference(400, 50, 150)) == (400, 200, 150, 50)
    assert from_reference(200, 0, 150).attend == 200
    model = tiny("xl", init_std=0.3)
    baseline, window = from_reference(12, 0, 5), TramsConfig(pool=12, attend=5, recent=5)
    assert (baseline.pool, baseline.attend, baseline.topk) == (12, 12, 0)
    data = torch.randint(0, 40, (40, 2), generator=torch.Generator().manual_seed(6))
    m1 = m2 = m3 = None
    differs = 0
    with torch.no_grad():
        for s in range(8):  # the memory fills up to 12 rows and stays full
            x, y = data[4 * s : 4 * s + 4], data[4 * s + 1 : 4 * s + 5]
            n1, m1 = model(x, y, m1, mem_len=12)
            n2, m2 = trams.forward(model, x, y, m2, select=baseline)
            n3, m3 = trams.forward(model, x, y, m3, select=window)
            assert torch.equal(n1, n2) and m1.equal(m2)
            # a difference beyond what two orders of the forward pass's fp32 sums explain (tests/helpers/bounds.py)
            differs += not torch.allclose(n1, n3, rtol=0, atol=forward_bound(model.cfg, float(n1.abs().max())))
    assert differs >= 5


def test_selection_follows_the_metric_on_constructed_keys():
    """W_Q = identity, so K' = k: the code metric ranks by ||k||*|sum k| (signs ignored), the paper's by
    sum k / sqrt(d) (signed). The newest `recent` rows are always kept, whatever their score."""
    d = 4
    w_q = torch.eye(d)
    rows = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # 0: sum 4, norm 2     -> code 8,   paper 2
            [-3.0, -3.0, -3.0, -3.0],  # 1: sum -12, norm 6  -> code 72,  paper -6
            [5.0, -5.0, 0.0, 0.0],  # 2: sum 0, norm 7.07  -> code 0,   paper 0
            [0.5, 0.5, 0.5, 0.0],  # 3: sum 1.5           -> code 1.3, paper 0.75
            [2.0, 2.0, 0.0, 0.0],  # 4: sum 4, norm 2.83  -> code 11.3, paper 2
            [0.0, 0.0, 0.0, 0.0],  # 5: recent (score 0, kept anyway)
            [-9.0, 9.0, 0.0, 0.0],  # 6: recent
        ]
    )
    k = rows.view(1, 1, 7, d)
    code = select_rows(k, w_q, TramsConfig(pool=7, attend=4, recent=2, metric="code"))
    paper = select_rows(k, w_q, TramsConfig(pool=7, attend=4, recent=2, metric="paper"))
    assert code.tolist() == [[[1, 4, 5, 6]]]
    assert paper.tolist() == [[[0, 4, 5, 6]]]
    expect = [math.sqrt(4) * 4, 6 * 12, 0.0, math.sqrt(0.75) * 1.5, math.sqrt(8) * 4]
    # halves and small integers: every sum, square and halving is exact in fp32, in any order; the code metric's
    # sqrt and product round twice (u each) against the fp64 value's one rounding to fp32: 3 u relative
    assert torch.allclose(key_scores(rows[:5], "code"), torch.tensor(expect), rtol=3 * unit_roundoff(), atol=0)
    assert torch.equal(key_scores(rows[:5], "paper"), rows[:5].sum(1) / 2)
    # memory no longer than the attended size: nothing is selected away
    assert select_rows(k[:, :, :4], w_q, TramsConfig(pool=7, attend=4, recent=2)) is None


def test_reformulated_key_uses_each_heads_query_weight():
    """K'_j = W_Q^(h)^T k_j^(h), so q_i.k_j = x_i.K'_j for every head."""
    g = torch.Generator().manual_seed(3)
    n, dh, d = 3, 4, 6
    w_q = torch.randn(n * dh, d, generator=g)
    x_q, x_k = torch.randn(5, d, generator=g), torch.randn(7, d, generator=g)
    w_k = torch.randn(n * dh, d, generator=g)
    q = (x_q @ w_q.T).view(5, n, dh).transpose(0, 1)  # [n, 5, dh]
    k = (x_k @ w_k.T).view(7, n, dh).transpose(0, 1)  # [n, 7, dh]
    kp = trams.reformulated_keys(k[:, None], w_q)[:, 0]  # [n, 7, d] (head-major [n, B=1, 7, d])
    # the same triple product associated two ways, fp32: each is two reductions (d and dh terms) of products whose
    # magnitudes add up to |x_q| |W_q|^T |W_k| |x_k|^T, so the two differ by 2 (d + dh) u of that, entry by entry
    # (measured 7.6e-6 at most, the bound's smallest entry is 2.3e-5)
    a_q = (x_q.abs() @ w_q.abs().T).view(5, n, dh).transpose(0, 1)
    a_k = (x_k.abs() @ w_k.abs().T).view(7, n, dh).transpose(0, 1)
    tol = sum_bound(d + dh, 1.0) * (a_q @ a_k.transpose(-1, -2))
    assert ((q @ k.transpose(-1, -2) - x_q @ kp.transpose(-1, -2)).abs() <= tol).all()
    # different heads select differently: per-head selection
    sel = select_rows(k[:, None], w_q, TramsConfig(pool=7, attend=3, recent=1))
    assert sel.shape == (n, 1, 3) and (sel[..., -1] == 6).all()


@pytest.mark.parametrize("metric", ["code", "paper"])
def test_selected_attention_equals_the_model_on_the_selected_memory(metric):
    """One head: TRAMS's output equals the plain model given, per layer and stream, a memory holding only the
    rows the metric picks (computed here from the layer inputs) - i.e. selection + compressed positions."""
    model = tiny("xl", n_head=1, d_head=16, n_layer=2, init_std=0.3)  # sharp attention
    sel = TramsConfig(pool=12, attend=7, recent=3, metric=metric)
    data = torch.randint(0, 40, (60, 3), generator=torch.Generator().manual_seed(4))
    mem = None
    checked = 0
    with torch.no_grad():
        for s in range(8):
            x, y = data[4 * s : 4 * s + 4], data[4 * s + 1 : 4 * s + 5]
            if mem is not None and mem.length > sel.attend:
                sub = {}
                for li, layer in enumerate(model.layers):
                    hid = mem[f"hid.{li}"]  # [M, B, d] this layer's memory rows
                    w = layer.attn.qkv.weight
                    k = hid @ w[16:32].T  # keys of the one head [M, B, dh]
                    kp = k @ w[:16]  # K' = W_Q^T k  [M, B, d]
                    s_ = kp.norm(dim=-1) * kp.sum(-1).abs() if metric == "code" else kp.sum(-1) / 4.0
                    M = hid.size(0)
                    cand = s_[: M - sel.recent]  # [C, B]
                    rows = []
                    for b in range(hid.size(1)):
                        top = sorted(cand[:, b].topk(sel.topk).indices.tolist())
                        rows.append(hid[top + list(range(M - sel.recent, M)), b])
                    sub[f"hid.{li}"] = torch.stack(rows, 1)
                expect, _ = model(x, y, Memory(sub), mem_len=sel.attend)
                got, _ = trams.forward(model, x, y, mem, select=sel)
                # the selection path against the plain model on the selected rows: other shapes and gathers, the
                # same sums in other orders: two orders of a forward pass over the attended keys
                # (tests/helpers/bounds.py)
                tol = forward_bound(model.cfg, float(expect.abs().max()), klen=4 + sel.attend)
                assert torch.allclose(got, expect, rtol=0, atol=tol), ((got - expect).abs().max(), tol)
                plain, _ = model(x, y, mem, mem_len=sel.pool)
                assert not torch.allclose(got, plain, rtol=0, atol=tol)  # selection did change something
                checked += 1
            _, mem = trams.forward(model, x, y, mem, select=sel)
    assert checked >= 4


def test_lamemo_selection_keeps_every_pool_row_refreshed():
    """For LaMemo, selection only narrows what current tokens attend: the caches of all pool rows are those of
    plain LaMemo with mem_len = pool at the first step where selection is active."""
    model = tiny("lamemo", init_std=0.3)
    sel = TramsConfig(pool=12, attend=6, recent=2)
    data = torch.randint(0, 40, (40, 2), generator=torch.Generator().manual_seed(5))
    mem = None
    with torch.no_grad():
        for s in range(5):
            x, y = data[4 * s : 4 * s + 4], data[4 * s + 1 : 4 * s + 5]
            before = mem
            got, mem = trams.forward(model, x, y, before, select=sel)
            plain, pmem = model(x, y, before, mem_len=12)
            assert mem.length == pmem.length <= 12
            assert torch.equal(mem["emb"], pmem["emb"])
            if before is not None and before.length > sel.attend:
                # current tokens saw fewer keys: different predictions, but memory rows were refreshed the same
                # way at layer 0 (their look-ahead does not depend on the selection below layer 0)
                # beyond two orders of the forward pass's fp32 sums (tests/helpers/bounds.py), for both comparisons
                assert not torch.allclose(got, plain, rtol=0, atol=forward_bound(model.cfg, float(plain.abs().max())))
                M = before.length
                want = pmem["ctx.0"][: M - 4]
                tol = forward_bound(model.cfg, float(want.abs().max()))
                assert torch.allclose(mem["ctx.0"][: M - 4], want, rtol=0, atol=tol)
                return
    raise AssertionError("selection never became active")


def test_bad_trams_config_is_rejected():
    with pytest.raises(ValueError, match="recent"):
        TramsConfig(pool=10, attend=12, recent=2).validate()
    with pytest.raises(ValueError, match="metric"):
        TramsConfig(pool=10, attend=5, recent=2, metric="cosine").validate()
    with pytest.raises(ValueError, match="memory"):
        trams.forward(
            tiny("rpe"), torch.zeros(4, 1, dtype=torch.long), None, select=TramsConfig(pool=8, attend=4, recent=2)
        )
