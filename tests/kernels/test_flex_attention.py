"""model.attention / --attention: FlexAttention (megamemo/kernels/flex.py) against the eager attention
(megamemo/model/attention.py) on the CPU, where FlexAttention runs forward only (torch 2.13 has no CPU backward:
its backward is checked on a GPU, bench/flex_check.py and the training start-up check):

  * the whole model's NLL and memory, every variant, with same_length and clamp_len, over segments with memory;
  * `megamemo eval --attention flex`, `megamemo generate --attention flex` and the conversion probe's replay;
  * the start-up check (kernels/form_check.py): it names what it saw and the training run skips flex in one
    line; an explicit `model.attention: flex` that cannot train is a config error; a form only when every rank's
    check agrees (two ranks that disagree, torch.distributed replaced by a two-rank stand-in);
  * the config: model.attention is not part of the model's identity (a checkpoint resumes under any form)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.bounds import forward_bound
from helpers.eval_fixtures import eval_record, one_thread, tiny_checkpoint  # noqa: F401 (one_thread: autouse)

from megamemo.config.run import ConfigError
from megamemo.kernels import apply as kernels_apply
from megamemo.kernels import apply_attention, attention_in_use, resolve_attention
from megamemo.kernels import flex as flex_module
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.attention import causal_attention, lookahead_attention
from megamemo.train.config import from_dict as load_dict

VARIANTS = ["lamemo", "lamemo_xlrpe", "lamemo_no_interp", "lamemo_no_lookahead", "xl", "rpe"]


@pytest.fixture
def flex_calls(monkeypatch):
    """How often FlexAttention ran (so that a test cannot pass on the eager path by mistake)."""
    calls = []
    real = flex_module.flex_relative
    monkeypatch.setattr(flex_module, "flex_relative", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("same_length", [False, True])
def test_flex_forward_equals_eager_for_every_variant(variant, same_length, flex_calls):
    cfg = ModelConfig(
        variant=variant,
        n_token=50,
        n_layer=3,
        d_model=32,
        n_head=2,
        d_head=16,
        d_inner=64,
        dropout=0.0,
        tgt_len=6,
        mem_len=10,
        same_length=same_length,
        clamp_len=12 if same_length else -1,
    )
    torch.manual_seed(0)
    eager = MemTransformerLM(cfg).eval()
    with torch.no_grad():
        for p in eager.parameters():  # sharper than the init: attention weights far from uniform
            p.mul_(6.0) if p.dim() == 2 else None
    flex = copy.deepcopy(eager)
    assert apply_attention(flex, "flex") == "flex" and attention_in_use(flex) == "flex"
    assert attention_in_use(eager) == "eager"
    data = torch.randint(0, 50, (6 * 4 + 1, 3), generator=torch.Generator().manual_seed(1))
    ma = mb = None
    with torch.no_grad():
        for s in range(4):  # memory grows 0 -> 6 -> 10 rows: every mask shape
            x, y = data[s * 6 : (s + 1) * 6], data[s * 6 + 1 : (s + 1) * 6 + 1]
            a, ma = eager(x, y, ma)
            b, mb = flex(x, y, mb)
            # FlexAttention's CPU form orders the attention's sums otherwise: fp32, two orders of the forward pass,
            # once per segment the memory carried (tests/helpers/bounds.py), at each compared value's size
            tol = (s + 1) * forward_bound(cfg, float(a.abs().max()))
            assert (a - b).abs().max() <= tol, (variant, s, (a - b).abs().max(), tol)
            for k in ma.tensors:
                tol = (s + 1) * forward_bound(cfg, float(ma.tensors[k].abs().max()))
                assert (ma.tensors[k] - mb.tensors[k]).abs().max() <= tol, (variant, s, k)
    calls_per_forward = cfg.n_layer * (2 if cfg.lamemo and cfg.variant != "lamemo_no_lookahead" else 1)
    assert len(flex_calls) >= 3 * calls_per_forward  # the first segment has no memory: no look-ahead


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_eval_and_generate_take_attention_flex(tmp_path, capsys, flex_calls, shards_by_size):
    """`megamemo eval --attention flex` scores as `--attention eager`; generate's greedy tokens are the same."""
    from megamemo.commands import generate

    ckpt, model = tiny_checkpoint(tmp_path / "ckpt")
    data = shards_by_size.get(20_000)
    got = {
        form: eval_record(
            ckpt,
            data,
            tmp_path / f"{form}.json",
            "--batch-size",
            "3",
            "--max-segments",
            "4",
            "--device",
            "cpu",
            "--attention",
            form,
        )
        for form in ("eager", "flex")
    }
    assert got["eager"]["tokens"] == got["flex"]["tokens"]
    # 4 segments, two orders of the forward pass's fp32 sums (tests/helpers/bounds.py): per token relative to its own
    # (positive) NLL, so relative to their mean too
    tol = 4 * forward_bound(model.cfg, got["eager"]["nll"])
    assert abs(got["eager"]["nll"] - got["flex"]["nll"]) <= tol, (got, tol)
    n_eval = len(flex_calls)
    assert n_eval > 0
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"The quick brown fox jumps over")
    ids = {}
    for form in ("eager", "flex"):
        js = tmp_path / f"gen-{form}.json"
        assert (
            generate.main(
                [
                    "--ckpt",
                    str(ckpt),
                    "--prompt-file",
                    str(prompt),
                    "--max-new-tokens",
                    "12",
                    "--greedy",
                    "--device",
                    "cpu",
                    "--attention",
                    form,
                    "--data",
                    str(data),
                    "--json",
                    str(js),
                    "--out",
                    str(tmp_path / f"{form}.txt"),
                ]
            )
            == 0
        )
        ids[form] = json.loads(js.read_text())["new_ids"]
    assert ids["eager"] == ids["flex"] and len(ids["flex"]) == 12
    assert len(flex_calls) > n_eval  # generate ran flex too


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_the_probe_replays_the_same_under_flex(tmp_path, flex_calls):
    from megamemo.checkpoint.probe_replay import single_device_nll

    _, model = tiny_checkpoint(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(3)
    segs = [
        (torch.randint(0, 256, (12, 2), generator=g), torch.randint(0, 256, (12, 2), generator=g), None)
        for _ in range(3)
    ]
    probe = {"segments": segs, "empty_start": True}
    eager = single_device_nll(model, None, probe)
    apply_attention(model, "flex")
    flex = single_device_nll(model, None, probe)
    # 3 segments: two orders of the forward pass's sums, once per segment the memory carried (tests/helpers/bounds.py)
    tol = 3 * forward_bound(model.cfg, max(float(a.abs().max()) for a in eager))
    assert flex_calls and max((a - b).abs().max().item() for a, b in zip(eager, flex, strict=True)) <= tol


def test_inference_auto_is_eager_on_the_cpu_and_for_generation():
    assert resolve_attention("auto", "cpu") == "eager"
    assert resolve_attention("auto", "cuda", generating=True) == "eager"
    assert resolve_attention("flex", "cpu") == "flex"
    with pytest.raises(ValueError, match="--attention: must be one of auto, eager, flex, fused"):
        resolve_attention("triton", "cpu")


# ---- the start-up check ----------------------------------------------------------------------------------------
def _layer_and_cfg(variant="lamemo"):
    cfg = ModelConfig(
        variant=variant,
        n_token=40,
        n_layer=2,
        d_model=32,
        n_head=2,
        d_head=16,
        d_inner=64,
        dropout=0.1,
        tgt_len=8,
        mem_len=8,
    )
    torch.manual_seed(0)
    return MemTransformerLM(cfg).layers[0].train(), cfg


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_start_up_check_compares_forward_and_backward(variant, monkeypatch):
    """With a "flex" that is eager itself the check agrees; with one whose position term is off by a little, it
    disagrees naming the worst quantity; the layer is left eager and in training mode either way."""
    from megamemo.kernels.form_check import flex_matches_eager

    layer, cfg = _layer_and_cfg(variant)
    monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "flex", (causal_attention, lookahead_attention))
    ok, line = flex_matches_eager(layer, cfg, 2, 8, 8)
    assert ok and "worst" in line and "tolerance 1e-04" in line, line

    def off(q, k, v, r, u, vb, *a, **kw):  # a wrong position bias: a plausible indexing slip
        return causal_attention(q, k, v, r, u, vb * 1.05, *a, **kw)

    monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "flex", (off, lookahead_attention))
    ok, line = flex_matches_eager(layer, cfg, 2, 8, 8)
    assert not ok and "flex vs eager at B=2 L=8 M=8 float32: worst" in line, line
    assert attention_in_use(layer) == "eager" and layer.training


def test_flex_cannot_train_on_the_cpu_so_auto_skips_it_in_one_line(monkeypatch):
    """The real FlexAttention on the CPU refuses a backward: the check says so; a run whose auto would time flex (a
    CUDA device of sm90, faked) skips it, naming why, and trains another form; an explicit flex is a config error
    naming the key."""
    from megamemo.kernels.form_check import flex_matches_eager
    from megamemo.train import forms

    layer, cfg = _layer_and_cfg()
    ok, line = flex_matches_eager(layer, cfg, 2, 8, 8)
    assert not ok and "flex failed at B=2 L=8 M=8 float32: NotImplementedError" in line, line
    monkeypatch.setattr(forms, "capability", lambda device: (9, 0))
    run = load_dict({"model": cfg.to_dict() | {"dropout": 0.1}, "train": {"compile": "off"}})
    model = MemTransformerLM(cfg)
    lines = []
    chosen = forms.choose_form(run, model, "cuda", 2, lines.append)  # the model itself is on the CPU
    assert chosen.attention in ("eager", "fused") and not chosen.compiled
    assert len(lines) == 1 and "skipped flex failed at B=2 L=8 M=8 float32: NotImplementedError" in lines[0], lines
    assert attention_in_use(model) == chosen.attention
    run.model.attention = "flex"
    with pytest.raises(ConfigError, match="model.attention: flex does not match eager here: flex failed"):
        forms.choose_form(run, model, "cuda", 2, lines.append)


@pytest.fixture
def two_ranks(monkeypatch):
    """torch.distributed as a world of two whose other rank contributes `peer["values"]` to every all_reduce:
    all_reduce applies its op (SUM by default, as torch's) to this rank's tensor and the other's."""
    import torch.distributed as dist

    peer = {"values": None}
    ops = (
        (dist.ReduceOp.MIN, torch.minimum),
        (dist.ReduceOp.MAX, torch.maximum),
        (dist.ReduceOp.SUM, torch.add),
        (dist.ReduceOp.PRODUCT, torch.mul),
    )

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        reduce = next(f for o, f in ops if o == op)
        t.copy_(reduce(t, torch.tensor(peer["values"], dtype=t.dtype)))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return peer


def test_a_form_trains_only_when_every_ranks_start_up_check_agrees(two_ranks, monkeypatch):
    """Two ranks: an explicit flex trains only when both checks pass, and one refused by the other rank's check
    says it was the other rank's; under auto a form that failed on the other rank is never chosen, however fast it
    is here. (The "flex" and "fused" here are the eager functions, which pass this rank's check on the CPU.)"""
    from megamemo.train import forms

    two_ranks["values"] = [1.0, float("inf")]
    assert forms._all_ranks([2.0, 0.5], "cpu") == [2.0, float("inf")]
    monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "flex", (causal_attention, lookahead_attention))
    cfg = _layer_and_cfg()[1]
    run = load_dict({"model": cfg.to_dict() | {"dropout": 0.0, "attention": "flex"}})
    model, lines = MemTransformerLM(run.model), []
    two_ranks["values"] = [0.0]  # the other rank's check passed
    assert forms.choose_form(run, model, "cpu", 2, lines.append).attention == "flex"
    assert lines == ["[train] attention: flex (checked against eager on one layer)"], lines
    two_ranks["values"] = [1.0]  # this rank's check passes, the other rank's does not
    with pytest.raises(
        ConfigError,
        match=r"model.attention: flex does not match eager on another rank \(this "
        r"rank's check: flex vs eager at B=2 L=8 M=8 float32: worst",
    ):
        forms.choose_form(run, model, "cpu", 2, lines.append)

    monkeypatch.setattr(forms, "capability", lambda device: (9, 0))
    monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "fused", (causal_attention, lookahead_attention))
    run = load_dict({"model": cfg.to_dict() | {"dropout": 0.0}, "train": {"compile": "off"}})
    two_ranks["values"] = [0.0, float("inf"), float("inf")]  # eager, then fused and flex failed there
    lines = []
    assert forms.choose_form(run, MemTransformerLM(run.model), "cuda", 2, lines.append).attention == "eager"
    assert "skipped fused: failed on another rank; skipped flex: failed on another rank" in lines[0], lines


def test_auto_keeps_eager_with_attention_dropout_and_leaves_flex_out_under_determinism(monkeypatch):
    from megamemo.train import forms

    monkeypatch.setattr(forms, "capability", lambda device: (9, 0))
    cfg = _layer_and_cfg()[1]
    run, lines = load_dict({"model": cfg.to_dict() | {"dropatt": 0.1}, "train": {"compile": "off"}}), []
    assert forms.choose_form(run, MemTransformerLM(run.model), "cuda", 2, lines.append).attention == "eager"
    assert len(lines) == 1 and "model.dropatt=0.1" in lines[0], lines
    run, lines = load_dict({"model": cfg.to_dict(), "train": {"deterministic": True, "compile": "off"}}), []
    assert forms.choose_form(run, MemTransformerLM(run.model), "cuda", 2, lines.append).attention != "flex"
    assert len(lines) == 1 and "skipped flex: train.deterministic" in lines[0], lines


# ---- config -----------------------------------------------------------------------------------------------------
def test_attention_config_is_validated_and_not_part_of_the_identity():
    base = ModelConfig(variant="lamemo", n_token=40, mem_len=8, tgt_len=8).to_dict()
    with pytest.raises(ValueError, match="model.attention: must be one of auto, eager, flex, fused"):
        ModelConfig.from_dict(base | {"attention": "triton"})
    with pytest.raises(ConfigError, match="model.attention: flex cannot drop attention weights"):
        load_dict({"model": base | {"attention": "flex", "dropatt": 0.1}})
    fingerprints = {
        load_dict({"model": base | {"attention": a}}).model_fingerprint() for a in ("auto", "eager", "flex")
    }
    assert len(fingerprints) == 1
    assert load_dict({"model": base | {"d_model": 32}}).model_fingerprint() not in fingerprints
