"""train.activation_checkpointing (issue 28, item 6): recomputed layers train exactly like kept ones, and
`megamemo plan` counts what it saves.

Memory is measured on the CPU as the bytes of the distinct storages autograd saves in the forward
(torch.autograd.graph.saved_tensors_hooks); with recomputation the backward also holds one layer's activations at a
time, measured as the no-recomputation figure over the number of layers."""

from __future__ import annotations

import pytest
import torch
from helpers.fixture_data import REPO

from megamemo.config.run import ConfigError
from megamemo.kernels import DropoutKey, apply_dropout_masks
from megamemo.model import MemTransformerLM
from megamemo.plan.layouts import plan
from megamemo.train.config import load


def _cfg(variant, recompute, dropout=0.2, extra=()):
    sets = [
        f"model.variant={variant}",
        "model.n_layer=4",
        "model.d_model=64",
        "model.n_head=2",
        "model.d_head=32",
        "model.d_inner=128",
        "model.tgt_len=16",
        "model.mem_len=16",
        "data.batch_size=4",
        "model.n_token=64",
        f"model.dropout={dropout}",
        f"train.activation_checkpointing={str(recompute).lower()}",
        *extra,
    ]
    return load(REPO / "configs/tiny-cpu.yaml", sets)


def _two_segments(cfg, recompute, masks="stream"):
    """Train-mode forward of two segments (the second with memory), backward: (nll, grads, memory). masks:
    train.dropout_masks (keyed: at steps 0 and 1 of seed 5)."""
    torch.manual_seed(0)
    model = MemTransformerLM(cfg.model).train()
    model.recompute_layers = recompute
    key = None
    if masks == "keyed":
        key = DropoutKey(5)
        apply_dropout_masks(model, "keyed", key)
    x = torch.randint(
        0,
        cfg.model.n_token,
        (2 * cfg.model.tgt_len + 1, cfg.data.batch_size),
        generator=torch.Generator().manual_seed(1),
    )
    L = cfg.model.tgt_len
    torch.manual_seed(5)  # the dropout masks of both runs
    _, mem = model(x[:L], x[1 : L + 1])
    if key is not None:
        key.set(step=1)
    nll, mem = model(x[L : 2 * L], x[L + 1 : 2 * L + 1], mem)
    nll.mean().backward()
    return nll.detach(), {n: p.grad for n, p in model.named_parameters()}, mem


@pytest.mark.parametrize(
    "variant,masks", [("lamemo", "stream"), ("xl", "stream"), ("lamemo", "keyed"), ("xl", "keyed")]
)
def test_recomputed_layers_train_exactly_like_kept_ones(variant, masks):
    """Same NLL, gradients and new memory, bit for bit, with dropout 0.2 (and dropatt 0.2): the recomputation
    replays the dropout masks (stream: from the saved RNG state; keyed: they are functions of coordinates) and
    does not advance memory a second time."""
    extra = ("model.dropatt=0.2",)
    kept = _two_segments(_cfg(variant, False, extra=extra), False, masks)
    redo = _two_segments(_cfg(variant, True, extra=extra), True, masks)
    assert torch.equal(kept[0], redo[0])
    for n, g in kept[1].items():
        assert torch.equal(g, redo[1][n]), n
    assert sorted(kept[2].tensors) == sorted(redo[2].tensors)
    for n, t in kept[2].tensors.items():
        assert torch.equal(t, redo[2].tensors[n]), n


def _saved_bytes(cfg, recompute) -> int:
    torch.manual_seed(0)
    model = MemTransformerLM(cfg.model).train()
    model.recompute_layers = recompute
    L, B = cfg.model.tgt_len, cfg.data.batch_size
    x = torch.randint(0, cfg.model.n_token, (L, B), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, mem = model(x, x)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x, mem)
    return sum(storages.values())


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_plan_counts_activation_checkpointing(variant):
    """The plan's activation figure shrinks by the measured factor, within 25%."""
    extra = (
        "model.d_model=256",
        "model.n_head=4",
        "model.d_head=64",
        "model.d_inner=1024",
        "model.tgt_len=64",
        "model.mem_len=64",
        "data.batch_size=8",
        "model.n_token=256",
    )
    off, on = _cfg(variant, False, 0.1, extra), _cfg(variant, True, 0.1, extra)
    saved_off, saved_on = _saved_bytes(off, False), _saved_bytes(on, True)
    measured = (saved_on + saved_off / off.model.n_layer) / saved_off
    planned = plan(on, 1, 80).activations / plan(off, 1, 80).activations
    assert measured < 0.5 and 0.75 <= planned / measured <= 1.25, (planned, measured)


def test_checkpointing_with_tensor_parallel_dropout_is_a_config_error_with_stream_masks():
    """The TP stream is not replayed by the recomputation; keyed masks are (tests/train/test_train_parallel.py trains
    TP 2 with recomputation and keyed dropout to the one-process losses)."""
    with pytest.raises(ConfigError, match="train.activation_checkpointing: with parallel.tp > 1 and model.dropout"):
        _cfg("lamemo", True, 0.1, ("parallel.tp=2",))
    assert _cfg("lamemo", True, 0.1, ("parallel.tp=2", "train.dropout_masks=keyed")).train.activation_checkpointing
