"""Half-precision paths compute their positions in fp32 (issue 28, item 1).

DeepSpeed casts a model's parameters only, so training's sinusoids were always fp32; eval (`load_for_eval`), a
bf16/fp16 single checkpoint (`load_single`, used by eval and generate) and the conversion probe cast whole modules
instead, and before the fix they rounded the frequencies and the angles pos x inv_freq to half precision: at 1,536
positions an angle near 1,500 rad has bf16 steps of 8 rad, i.e. another position. Each test here fails on main at
670c926 (checked by reverting megamemo/model/positions.py, lm.py and pipeline.py).

The logits bound (test_half_logits_track_fp32_at_width): in the standard model of floating-point error every
operation that writes a half-precision tensor rounds it with relative error at most u (unit roundoff: 2^-8 for
bf16, 2^-11 for fp16) and, to first order, the relative errors of a chain of well-conditioned operations add. A
forward pass that writes N half-precision tensors by rounding (counted on the run itself: RoundingCounter,
megamemo/util/rounding.py) is therefore off by at most N * u relative, measured as RMS over the vocabulary-centred
log-probs (centring removes the log-normaliser, a constant per token). The weights are set so that the positional term
dominates the attention scores: the same model with half-precision angles is then off by O(1) relative, far beyond N *
u.
"""

from __future__ import annotations

import pytest
import torch

from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.positions import position_sequence, sinusoid
from megamemo.util.rounding import RoundingCounter, unit_roundoff

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def position_sensitive(cfg: ModelConfig, seed: int = 0) -> MemTransformerLM:
    """A model whose attention is dominated by the positional term (large v bias and r_net)."""
    torch.manual_seed(seed)
    model = MemTransformerLM(cfg).eval()
    with torch.no_grad():
        model.r_r_bias.normal_(0.0, 3.0)
        for layer in model.layers:
            layer.attn.r_net.weight.normal_(0.0, 0.1)
    return model


def _loaded(model, dtype):
    """What load_for_eval / load_single / the probe do: the whole module in `dtype`."""
    out = MemTransformerLM(model.cfg).to(dtype).eval()
    out.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    return out


def positions_seen(model, run):
    """The sinusoid table each layer's r_net receives while `run()` executes."""
    seen = []
    hooks = [
        layer.attn.r_net.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
        for layer in model.layers
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.fixture(scope="module")
def at_width():
    """d_model 1024, 1,536 positions: (config, fp32 model, input, its vocabulary-centred log-probs)."""
    L = 1536
    cfg = ModelConfig(
        variant="xl",
        n_token=64,
        n_layer=1,
        d_model=1024,
        n_head=16,
        d_head=64,
        d_inner=2048,
        dropout=0.0,
        tgt_len=L,
        mem_len=0,
        init_std=0.05,
    )
    ref_model = position_sensitive(cfg)
    x = torch.randint(0, cfg.n_token, (L, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(x)[0]
    return cfg, ref_model, x, ref - ref.mean(-1, keepdim=True)


def relative_error(out, ref_c) -> float:
    """RMS of the difference of vocabulary-centred log-probs, relative to the RMS of fp32's."""
    out_c = out - out.mean(-1, keepdim=True)
    return ((out_c - ref_c).pow(2).mean().sqrt() / ref_c.pow(2).mean().sqrt()).item()


def run_counted(model, x, dtype, replace_positions=None):
    """-> (log-probs fp32, positions the first layer's r_net saw, number of rounding operations)."""
    seen = []

    def hook(module, args):
        seen.append(args[0].detach().clone())
        return None if replace_positions is None else (replace_positions,)

    handle = model.layers[0].attn.r_net.register_forward_pre_hook(hook)
    counter = RoundingCounter(dtype)
    try:
        with torch.no_grad(), counter:
            out = model(x)[0].float()
    finally:
        handle.remove()
    return out, seen[0], counter.count


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_logits_track_fp32_at_width(at_width, name):
    """bf16 and fp16 models see fp32's positions (rounded once, at the end) and their log-probs stay within
    N * u of fp32's."""
    cfg, ref_model, x, ref_c = at_width
    dtype = HALF[name]
    out, seen, count = run_counted(_loaded(ref_model, dtype), x, dtype)
    want = sinusoid(position_sequence(x.size(0), 0, -1, None), cfg.d_model)
    assert seen.dtype == dtype and torch.equal(seen, want.to(dtype)), f"{name}: positions are not fp32's rounded once"
    assert 10 <= count <= 100, count  # the count is of the model's arithmetic (18 here), not of noise
    rel, bound = relative_error(out, ref_c), count * unit_roundoff(dtype)
    assert rel <= bound, (
        f"{name}: log-probs off by {rel:.4f} relative (RMS), bound N*u = {count}*"
        f"{unit_roundoff(dtype):.2e} = {bound:.4f}"
    )


def test_half_angles_fail_the_bound(at_width):
    """The bound above can fail: the same bf16 model given the positions `model.to(bf16)` computed before the fix
    (the inv_freq buffer rounded to bf16, then fp32 positions times it, the result cast to bf16) is off by more
    than N * u."""
    cfg, ref_model, x, ref_c = at_width
    dtype = torch.bfloat16
    pos = position_sequence(x.size(0), 0, -1, None)
    angles = torch.outer(pos, (1.0 / (10000 ** (torch.arange(0.0, cfg.d_model, 2.0) / cfg.d_model))).to(dtype))
    old = torch.cat([angles.sin(), angles.cos()], -1).to(dtype)
    assert (old.float() - sinusoid(pos, cfg.d_model)).abs().max() > 1.0
    out, _, count = run_counted(_loaded(ref_model, dtype), x, dtype, replace_positions=old)
    assert relative_error(out, ref_c) > count * unit_roundoff(dtype)


# ---- every path that casts a whole module: the positions its r_net sees are fp32's, rounded once ----------------
# Narrow (d_model 64) and 600 positions: the old bug shows at any width once positions pass 256 (bf16 keeps 8 bits).
# n_head * d_head (32) != d_model (64) makes r_net the only Linear of shape 64 -> 32 (see RNetInputs).
PATH_CFG = dict(
    variant="xl",
    n_token=32,
    n_layer=1,
    d_model=64,
    n_head=2,
    d_head=16,
    d_inner=64,
    dropout=0.0,
    tgt_len=600,
    mem_len=0,
)


class RNetInputs:
    """Records what every r_net (Linear d_model -> n_head*d_head) of any model receives inside the block, also for
    models a path builds itself."""

    def __init__(self, cfg):
        self.shape, self.seen = (cfg.d_model, cfg.n_head * cfg.d_head), []

    def __enter__(self):
        def hook(module, args):
            if isinstance(module, torch.nn.Linear) and (module.in_features, module.out_features) == self.shape:
                self.seen.append(args[0].detach().clone())

        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def assert_fp32_positions(seen, cfg, L, dtype):
    want = sinusoid(position_sequence(L, 0, -1, None), cfg.d_model).to(dtype)
    assert seen, "no r_net call was seen"
    for s in seen:
        assert s.dtype == dtype and torch.equal(s, want), (
            f"positions differ from fp32's by up to {(s.float() - want.float()).abs().max():.3f}"
        )


def path_model():
    cfg = ModelConfig(**PATH_CFG)
    return (
        cfg,
        position_sensitive(cfg),
        torch.randint(0, cfg.n_token, (cfg.tgt_len, 1), generator=torch.Generator().manual_seed(2)),
    )


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_load_single_and_eval_half(tmp_path, name):
    """load_single (eval and generate on a bf16/fp16 single checkpoint) and load_for_eval(--dtype)."""
    from megamemo.checkpoint.single import load_single, save_single
    from megamemo.interop.load import open_model as load_for_eval

    cfg, model, x = path_model()
    dtype = HALF[name]
    save_single(tmp_path / "half", cfg, model.state_dict(), dtype=dtype)
    save_single(tmp_path / "fp32", cfg, model.state_dict())
    loaded = [load_single(tmp_path / "half")[0], load_for_eval(tmp_path / "fp32", "cpu", name)[0]]
    for m in loaded:
        assert next(m.parameters()).dtype == dtype
        with RNetInputs(cfg) as rec, torch.no_grad():
            m(x)
        assert_fp32_positions(rec.seen, cfg, x.size(0), dtype)


def test_conversion_probe_half():
    """The probe of `convert to-single` replays a bf16 run with the model cast to bf16."""
    from megamemo.checkpoint.probe_replay import check_probe

    cfg, model, x = path_model()
    with torch.no_grad():
        nll = model(x, x)[0]
    probe = {"empty_start": True, "segments": [(x, x, nll)], "columns": [0, 1], "path": "probe"}
    with RNetInputs(cfg) as rec:
        res = check_probe(model, None, probe, "bf16")
    assert_fp32_positions(rec.seen, cfg, x.size(0), torch.bfloat16)
    assert res["max_abs_diff"] <= res["tolerance"]["max"]


def test_pipeline_stage_half():
    """A pipeline stage's layer cast to bf16 (DeepSpeed casts parameters only; this proves the layer itself keeps
    its positions fp32 whoever casts it)."""
    from megamemo.parallel.pipeline import LayerPipe, RelBiasPipe, StageContext, stage_meta

    cfg, model, x = path_model()
    ctx = StageContext(cfg)
    bias, layer = RelBiasPipe(cfg, ctx), LayerPipe(cfg, ctx, 0)
    for m in (bias, layer):
        for p in m.parameters():
            torch.nn.init.normal_(p, 0.0, 0.05)
    bias, layer = bias.to(torch.bfloat16), layer.to(torch.bfloat16)
    rows = torch.randn(x.size(0), 1, cfg.d_model, dtype=torch.bfloat16)
    with RNetInputs(cfg) as rec, torch.no_grad():
        layer(bias((rows, stage_meta(0, 0, x.size(0), "cpu"))))
    assert_fp32_positions(rec.seen, cfg, x.size(0), torch.bfloat16)
