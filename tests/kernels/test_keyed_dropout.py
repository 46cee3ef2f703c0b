"""Keyed dropout masks (train.dropout_masks: keyed; megamemo/kernels/keyed.py, issue 39).

What is checked here, in one process:
  * the generator is Philox-4x32-10: both torch forms against Random123's known-answer vectors;
  * a mask element is what the module docstring says it is: every element of a site's mask against an
    independent pure-Python statement (a second Philox, the coordinates packed by hand), on both paths;
  * the CPU byte-digit path and the traceable full path give the same masks (ties included);
  * the law: keep rate within a binomial bound per tensor; no correlation between neighbouring rows, columns,
    features, layers, sites and steps; other seeds other masks; no repeat across steps or micro-batches;
  * the point: a model cut into micro-batches of other columns drops what one micro-batch drops (stream masks do
    not); under tensor parallelism a rank drops its slice of a split site (ff_inner's features, att's and
    att_ahead's heads) and the whole of every other site, as the single device does; the layouts' own equalities
    are the training tests' (test_train_equivalence, test_train_parallel, test_train_runs, test_convert_parallel),
    which run keyed with dropout 0.1 and dropatt 0.1.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.bounds import backward_bound, forward_bound
from helpers.fixture_data import REPO

from megamemo.config.run import ConfigError
from megamemo.kernels import DropoutKey, apply_dropout_masks, dropout_masks_in_use
from megamemo.kernels.keyed import SITES, KeyedDropout, coordinates, keep_bytes, keep_full, site_word
from megamemo.kernels.philox import philox, philox_words32
from megamemo.kernels.sites import dropout_sites
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.train.config import load

# Random123's kat_vectors: counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_reference(ctr, key, rounds=10):
    """Philox-4x32 in Python integers, from the paper: the key is bumped before rounds 2..R."""
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) % 2**32, (k[1] + 0xBB67AE85) % 2**32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 % 2**32, (p0 >> 32) ^ c[3] ^ k[1], p0 % 2**32]
    return c


def keep_reference(p, seed, step, site, layer, head, column, row, feature) -> bool:
    """One element's keep, as the docstring of megamemo/kernels/keyed.py states it."""
    u = 0
    for level in range(4):
        c3 = (level << 30) | (SITES[site][0] << 26) | (layer << 16) | head
        out = philox_reference([feature // 16, row, column, c3], [seed, step])
        j = feature % 16
        u = (u << 8) | ((out[j // 4] >> (8 * (j % 4))) & 255)
    return u >= round(p * 2**32)


def test_philox_forms_give_random123s_known_answers():
    for ctr, key, want in KAT:
        words = [torch.tensor([w]) for w in ctr]
        assert [int(w) for w in philox(*words, *key)] == list(want)
        assert [int(w.view(torch.uint32)) for w in philox_words32(*words, *key)] == list(want)
        assert philox_reference(ctr, key) == list(want)
        # traced form with tensor keys (what torch.compile sees)
        assert [int(w) for w in philox(*words, *(torch.tensor(k) for k in key))] == list(want)


@pytest.mark.parametrize(
    "site,shape,split",
    [("ff_inner", (3, 2, 40), 1), ("att", (2, 2, 3, 20), 1), ("pos", (5, 24), 0), ("emb", (4, 3, 16), 0)],
)
def test_every_element_is_the_stated_function_of_its_coordinates(site, shape, split):
    """Module output on ones: 0 where dropped, 1/(1-p) where kept; kept exactly where the pure-Python statement
    keeps, with the TP rank's offset, the micro-batch's first column and the step - on both paths."""
    p, seed, step, layer = 0.3, 1234, 77, 3
    key = DropoutKey(seed, columns=[10, 14]).set(step=step, micro_batch=1)
    drop = KeyedDropout(p, key, site, layer, split=split).train()
    y = drop(torch.ones(shape))
    assert set(torch.unique(y).tolist()) <= {0.0, float(torch.tensor(1.0 / (1.0 - p)))}
    layout = SITES[site][1]
    want = torch.zeros(shape, dtype=torch.bool)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in shape)).tolist():
        if layout == "rows":
            t, b, f = idx
            coords = dict(head=0, column=14 + b, row=t, feature=split * shape[-1] + f)
        elif layout == "heads":
            h, b, i, j = idx
            coords = dict(head=split * shape[0] + h, column=14 + b, row=i, feature=j)
        else:
            t, f = idx
            coords = dict(head=0, column=0, row=t, feature=f)
        want[tuple(idx)] = keep_reference(p, seed, step, site, layer, **coords)
    assert torch.equal(y != 0, want)
    assert 0 < int(want.sum()) < want.numel()
    # the traceable form, keys as tensors (what a compiled layer and a GPU run)
    row, col, head, f0 = coordinates(layout, shape, torch.tensor(14), split, "cpu")
    full = keep_full(
        shape,
        p,
        torch.tensor(site_word(site, layer)),
        row,
        col,
        head,
        f0,
        torch.tensor(seed),
        torch.tensor(step),
        "cpu",
    )
    assert torch.equal(full, want)


@pytest.mark.parametrize("p", [0.1, 0.5, 1 / 256, 0.9, 0.123456789])
def test_byte_digits_and_full_words_give_one_mask(p):
    """The CPU byte-digit path (a second Philox draw only where the first digit ties with T's) and the full
    path (four digits for every element) agree, ties included (1M elements: ~4,000 first-digit ties, ~16
    second-digit ones); a feature offset that is no multiple of 16 too."""
    for layout, shape, split in (("rows", (128, 8, 1024), 0), ("rows", (9, 5, 56), 3), ("heads", (3, 4, 7, 45), 2)):
        row, col, head, f0 = coordinates(layout, shape, 6, split, "cpu")
        a = keep_bytes(shape, p, site_word("ff_inner", 5), row, col, head, f0, 99, 4)
        b = keep_full(shape, p, site_word("ff_inner", 5), row, col, head, f0, 99, 4, "cpu")
        assert torch.equal(a, b), (layout, p)


# ---- the law ------------------------------------------------------------------------------------------------
def _mask(step=3, seed=1111, site="ff_inner", layer=1, column=0, shape=(256, 16, 512), p=0.1):
    row, col, head, f0 = coordinates(SITES[site][1], shape, column, 0, "cpu")
    return keep_bytes(shape, p, site_word(site, layer), row, col, head, f0, seed, step, torch.float32)


def _corr(a, b) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_a_binomial_bound_per_tensor(p):
    """Each tensor's kept count k of n: |k - n(1-p)| <= 6 sqrt(n p (1-p)) (a false alarm about once in 5e8)."""
    for site, shape in (
        ("ff_inner", (256, 8, 1024)),
        ("emb", (32, 4, 64)),
        ("att", (4, 8, 32, 64)),
        ("pos", (64, 256)),
    ):
        for step in (0, 1, 1000):
            k, n = float(_mask(step=step, site=site, shape=shape, p=p).sum()), math.prod(shape)
            assert abs(k - n * (1 - p)) <= 6 * math.sqrt(n * p * (1 - p)), (site, step, k, n)


def test_no_correlation_between_neighbours_layers_sites_steps_and_seeds():
    """Pearson correlation of the mask with its neighbour along rows, columns and features (lags 1, 4 and 16:
    the next byte, the same byte of the next word, of the next Philox output), and with the mask of the next
    layer, another site, the next step, the next micro-batch's columns and another seed: each within 6 / sqrt(n)
    of 0 (n = 2M elements: 0.004)."""
    m = _mask()
    bound = 6 / math.sqrt(m.numel())
    for dim in (0, 1, 2):
        for lag in (1, 4, 16) if dim == 2 else (1, 2):
            a, b = m.narrow(dim, 0, m.size(dim) - lag), m.narrow(dim, lag, m.size(dim) - lag)
            assert abs(_corr(a, b)) < bound, (dim, lag, _corr(a, b))
    for other in (_mask(layer=2), _mask(site="attn_out"), _mask(step=4), _mask(column=16), _mask(seed=1112)):
        assert abs(_corr(m, other)) < bound


def test_masks_differ_across_seeds_and_never_repeat_across_steps_or_micro_batches():
    """A site's masks at 8 steps x 4 micro-batches (columns 0, 8, 16, 24) and 2 seeds: no two alike, and each
    pair agrees on p^2 + (1-p)^2 of its elements, as independent masks do (within 6 sigma)."""
    shape, p = (64, 8, 256), 0.1
    m = torch.stack(
        [
            _mask(step=s, column=c, seed=seed, shape=shape, p=p).reshape(-1)
            for s in range(8)
            for c in (0, 8, 16, 24)
            for seed in (1111, 2024)
        ]
    ).double()
    same = m @ m.T + (1 - m) @ (1 - m).T  # elements each pair agrees on
    n, agree = m.size(1), p * p + (1 - p) * (1 - p)
    off = ~torch.eye(len(m), dtype=torch.bool)
    worst = float((same - n * agree).abs()[off].max())
    assert worst <= 6 * math.sqrt(n * agree * (1 - agree)), worst


# ---- what keyed masks buy -----------------------------------------------------------------------------------
def _model(variant, seed=0):
    torch.manual_seed(seed)
    return MemTransformerLM(
        ModelConfig(
            variant=variant,
            n_token=40,
            n_layer=2,
            d_model=32,
            n_head=2,
            d_head=16,
            d_inner=64,
            dropout=0.1,
            dropatt=0.1,
            tgt_len=6,
            mem_len=6,
        )
    ).train()


def _train_two_segments(model, x, micro: int, keyed: bool):
    """Two segments (the second with memory) over the batch's columns cut into micro-batches of `micro`
    columns, as DP ranks and gradient accumulation cut it: -> (NLL [L, B] of both segments, gradients)."""
    B, L = x.size(1), 6
    key = None
    if keyed:
        key = DropoutKey(5, columns=list(range(0, B, micro)))
        apply_dropout_masks(model, "keyed", key)
    else:
        torch.manual_seed(3)
    mems, out = [None] * (B // micro), []
    for s in range(2):
        parts = []
        for k in range(B // micro):
            if key is not None:
                key.set(step=s, micro_batch=k)
            cols = slice(k * micro, (k + 1) * micro)
            nll, mems[k] = model(x[s * L : (s + 1) * L, cols], x[s * L + 1 : (s + 1) * L + 1, cols], mems[k])
            nll.sum().backward()
            parts.append(nll.detach())
        out.append(torch.cat(parts, 1))
    return torch.cat(out, 0), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_micro_batches_of_other_columns_drop_what_one_batch_drops(variant):
    """Dropout 0.1 and dropatt 0.1: four streams as one micro-batch, two of two, or four of one (DP 2, DP 4,
    gradient accumulation) give the same NLL and gradients with keyed masks; with stream masks they do not
    (each micro-batch draws its own masks from where the stream stands)."""
    x = torch.randint(0, 40, (13, 4), generator=torch.Generator().manual_seed(1))
    base = _model(variant)
    one, g_one = _train_two_segments(copy.deepcopy(base), x, 4, keyed=True)
    # the same masks on other batch shapes: other orders of the same fp32 sums. Two segments' forward passes for
    # the NLL; for a gradient the backward's, over 2 segments of 6 x 4 tokens summed across micro-batches
    # (tests/helpers/bounds.py)
    tol = 2 * forward_bound(base.cfg, float(one.abs().max()))
    for micro in (2, 1):
        got, g = _train_two_segments(copy.deepcopy(base), x, micro, keyed=True)
        torch.testing.assert_close(got, one, rtol=0, atol=tol)
        for n in g_one:
            g_tol = 2 * backward_bound(base.cfg, float(g_one[n].abs().max()), tokens=24)
            torch.testing.assert_close(g[n], g_one[n], rtol=0, atol=g_tol)
    s_one, _ = _train_two_segments(copy.deepcopy(base), x, 4, keyed=False)
    s_two, _ = _train_two_segments(copy.deepcopy(base), x, 2, keyed=False)
    assert float((s_one - s_two).abs().max()) > tol  # stream masks depend on the cut (beyond rounding)
    assert float((s_one - one).abs().max()) > tol  # and the dropout is on: keyed masks drop too


def test_every_dropout_has_a_site_and_the_swap_goes_both_ways():
    model = _model("lamemo")
    sites = dropout_sites(model)
    assert sorted({s for s, _ in sites.values()}) == sorted(SITES)
    assert {layer for _, layer in sites.values()} == {0, 1} and sites["layers.1.ff.drop_inner"] == ("ff_inner", 1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    apply_dropout_masks(model, "keyed", DropoutKey(1))
    assert dropout_masks_in_use(model) == "keyed" and model.state_dict().keys() == sd.keys()
    assert model.layers[0].ff.drop_inner.relu and model.layers[0].attn.dropatt.p == 0.1
    apply_dropout_masks(model, "stream")
    assert dropout_masks_in_use(model) == "stream"
    model.extra = torch.nn.Dropout(0.1)  # a dropout with no site: named, refused
    with pytest.raises(ValueError, match="no site for the dropout at 'extra'"):
        apply_dropout_masks(model, "keyed", DropoutKey(1))


@pytest.mark.parametrize("tp", [2, 4])
def test_under_tensor_parallelism_a_rank_drops_its_slice_of_a_split_site_and_all_of_the_others(tp):
    """The split each site gets, in one process: apply_dropout_masks with TP rank r offsets the sites tensor
    parallelism splits (ff_inner: the feed-forward's inner features; att, att_ahead: the heads) by rank r's slice
    and no other site. So rank r's dropout on its shard ([T, B, F / tp] features, [n / tp, B, Q, K] heads) drops
    what the single device drops on that slice, and on a whole tensor (emb, pos, out, attn_out, ff_out: every rank
    holds them whole) exactly what the single device drops."""
    from megamemo.kernels.keyed import SPLIT

    key = DropoutKey(9, columns=[3]).set(step=4)
    single = _model("lamemo")
    apply_dropout_masks(single, "keyed", key)
    sites = dropout_sites(single)
    shapes = {"rows": (5, 3, 64), "table": (9, 32), "heads": (4, 3, 5, 11)}
    split_sites = set()
    for r in range(tp):
        rank = _model("lamemo")
        apply_dropout_masks(rank, "keyed", key, tp_rank=r)
        mods = dict(rank.named_modules())
        for name, (site, _) in sites.items():
            layout = SITES[site][1]
            full = dict(single.named_modules())[name](torch.ones(shapes[layout])) != 0
            assert 0 < full.float().mean() < 1, (name, site)
            if site in ("ff_inner", "att", "att_ahead"):
                split_sites.add(site)
                n = shapes[layout][0 if layout == "heads" else -1] // tp
                part = full[r * n : (r + 1) * n] if layout == "heads" else full[..., r * n : (r + 1) * n]
                shard = torch.ones(part.shape)
            else:
                part, shard = full, torch.ones(full.shape)
            assert torch.equal(mods[name](shard) != 0, part), (r, name, site)
    assert split_sites == set(SPLIT) == {"ff_inner", "att", "att_ahead"}


def test_the_config_key_and_what_keyed_masks_allow():
    def cfg(*sets):
        return load(REPO / "configs/tiny-cpu.yaml", list(sets))

    assert cfg().train.dropout_masks == "stream"
    with pytest.raises(ConfigError, match="train.dropout_masks: must be stream or keyed"):
        cfg("train.dropout_masks=random")
    with pytest.raises(ConfigError, match=r"train.seed: keyed dropout masks take a seed in \[0, 2\^32\)"):
        cfg("train.dropout_masks=keyed", "train.seed=-1")
    # activation checkpointing under TP with dropout: recomputation replays keyed masks (a stream would not)
    with pytest.raises(ConfigError, match="train.activation_checkpointing: with parallel.tp > 1"):
        cfg("train.activation_checkpointing=true", "parallel.tp=2")
    assert cfg("train.activation_checkpointing=true", "parallel.tp=2", "train.dropout_masks=keyed").parallel.tp == 2


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_a_compiled_layer_draws_the_eager_masks_and_compiles_once():
    """train.compile: a decoder layer compiled (backend aot_eager: TorchDynamo and AOTAutograd trace the layer,
    keyed masks as integer ops on the key's tensor words; no code generated) drops what the eager byte-digit path
    drops: same NLL and gradients over three steps of two micro-batches, and no graph is added once the step and
    micro-batch change (they are tensor inputs, not constants of the graph)."""
    from torch._dynamo.utils import counters

    from megamemo.kernels.compiler import compile_layers

    x = torch.randint(0, 40, (7, 4), generator=torch.Generator().manual_seed(1))
    base = _model("lamemo")
    runs = {}
    for form in ("eager", "compiled"):
        model, key = copy.deepcopy(base), DropoutKey(7, columns=[0, 2])
        apply_dropout_masks(model, "keyed", key)
        if form == "compiled":
            compile_layers(model, "aot_eager")
        out, graphs = [], []
        for step in range(3):
            for k in range(2):
                key.set(step=step, micro_batch=k)
                nll, _ = model(x[:6, 2 * k : 2 * k + 2], x[1:, 2 * k : 2 * k + 2])
                nll.sum().backward()
                out.append(nll.detach())
            graphs.append(int(counters["stats"].get("unique_graphs", 0)))
        runs[form] = (torch.cat(out), {n: p.grad for n, p in model.named_parameters()}, graphs)
    # aot_eager runs the decomposed ops: the same sums, possibly fused or ordered otherwise (tests/helpers/bounds.py;
    # equal
    # bit for bit on this Xeon at both ISAs, another code path all the same); gradients over 3 steps x 2
    # micro-batches of 6 x 2 tokens
    want = runs["eager"][0]
    tol = forward_bound(base.cfg, float(want.abs().max()))
    torch.testing.assert_close(runs["compiled"][0], want, rtol=0, atol=tol)
    for n, g in runs["eager"][1].items():
        g_tol = 0.0 if g is None else 3 * backward_bound(base.cfg, float(g.abs().max()), tokens=24)
        torch.testing.assert_close(runs["compiled"][1][n], g, rtol=0, atol=g_tol)
    graphs = runs["compiled"][2]
    assert graphs[0] > 0 and graphs[1] == graphs[2], graphs  # compiled at step 0; steps 1 and 2 reuse it


def test_a_checkpoint_records_its_masks_and_a_switch_on_resume_is_one_line(tmp_path):
    """Old runs: a checkpoint from before train.dropout_masks existed (no record) was drawn from the streams: it
    resumes in stream mode without a word, and under keyed masks with one line saying so; a keyed checkpoint
    resumed with stream masks says that too."""
    from megamemo.checkpoint.layout import RunLayout, RunMeta
    from megamemo.checkpoint.state import Counters, StateRegistry
    from megamemo.checkpoint.store import CheckpointStore, read_marker, tag_for

    def store(**extra):
        meta = RunMeta({"n_layer": 2}, layout=RunLayout(world_size=1, dp=1, batch_size=4), precision="fp32", **extra)
        return CheckpointStore(
            tmp_path / "ckpt",
            0,
            1,
            3,
            meta,
            barrier=lambda: None,
            async_save=False,
            commit_timeout_s=30,
            log=lambda m: None,
        )

    for step, extra in ((2, {}), (4, {"dropout_masks": "keyed"})):
        reg = StateRegistry()
        reg.register("counters", Counters(step=step))
        store(**extra).save(step, reg)
    old, keyed = tmp_path / "ckpt" / tag_for(2), tmp_path / "ckpt" / tag_for(4)
    assert "dropout_masks" not in read_marker(old) and read_marker(keyed)["dropout_masks"] == "keyed"
    assert store(dropout_masks="stream").check_compatible(old)[2] == ""
    assert (
        store(dropout_masks="keyed").check_compatible(old)[2] == "dropout masks stream -> keyed (train.dropout_masks)"
    )
    assert (
        store(dropout_masks="stream").check_compatible(keyed)[2]
        == "dropout masks keyed -> stream (train.dropout_masks)"
    )
    assert store(dropout_masks="keyed").check_compatible(keyed)[2] == ""
