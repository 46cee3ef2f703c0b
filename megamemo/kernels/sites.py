"""`apply_dropout_masks(model, mode, key, tp_rank)`: every dropout of a built model drawn from the RNG streams
("stream": nn.Dropout / ReluDropout, which apply_kernels may then make CPU kernels) or keyed by its coordinates
("keyed": KeyedDropout, megamemo/kernels/keyed.py).

Works on any module tree holding the model's layers, as apply_kernels does: the single-device MemTransformerLM,
its tensor-parallel form (a split dropout sits inside a wrapper, ForkedDropout's `inner`) and a pipeline's
stages. Each dropout is told its site by where it sits:
    inside a decoder layer (XLLayer / LaMemoLayer, whose `index` is the layer):
        attn.drop -> attn_out    attn.dropatt -> att    attn.dropatt_ahead -> att_ahead
        ff.drop_inner -> ff_inner    ff.drop -> ff_out
    outside one (the model, a pipeline's embedding and pipe layers):
        drop -> emb    drop_pos -> pos    drop_out -> out
A dropout anywhere else is an error naming it (a site without coordinates would not be layout-invariant).
"""

from __future__ import annotations

from torch import nn

from megamemo.model.layers import LaMemoLayer, ReluDropout, XLLayer

from .dropout import CpuDropout
from .keyed import SPLIT, DropoutKey, KeyedDropout

MODES = ("stream", "keyed")  # train.dropout_masks
_IN_LAYER = {
    "attn.drop": "attn_out",
    "attn.dropatt": "att",
    "attn.dropatt_ahead": "att_ahead",
    "ff.drop_inner": "ff_inner",
    "ff.drop": "ff_out",
}
_OUTSIDE = {"drop": "emb", "drop_pos": "pos", "drop_out": "out"}
_DROPOUTS = (nn.Dropout, ReluDropout, CpuDropout, KeyedDropout)  # exactly these types


def _relu(d: nn.Dropout) -> bool:
    return d.relu if isinstance(d, (CpuDropout, KeyedDropout)) else isinstance(d, ReluDropout)


def dropout_sites(model: nn.Module) -> dict[str, tuple[str, int]]:
    """{module path of each dropout: (site, layer)} (module docstring); an unplaceable dropout is an error."""
    layers = {name: m.index for name, m in model.named_modules() if isinstance(m, (XLLayer, LaMemoLayer))}
    out = {}
    for name, m in model.named_modules():
        if type(m) not in _DROPOUTS:
            continue
        path = name[: -len(".inner")] if name.endswith(".inner") else name  # a wrapper's place is the site's
        owner = max((n for n in layers if path.startswith(n + ".")), key=len, default=None)
        if owner is not None:
            site, layer = _IN_LAYER.get(path[len(owner) + 1 :]), layers[owner]
        else:
            site, layer = _OUTSIDE.get(path.rpartition(".")[2]), 0
        if site is None:
            raise ValueError(
                f"keyed dropout: no site for the dropout at {name!r} (known: "
                f"{', '.join(sorted(_IN_LAYER))} in a layer; {', '.join(sorted(_OUTSIDE))} outside)"
            )
        out[name] = (site, layer)
    return out


def apply_dropout_masks(model: nn.Module, mode: str, key: DropoutKey | None = None, tp_rank: int = 0) -> str:
    """In place: every dropout of the model in `mode`'s form ("keyed": KeyedDropout with `key`, the split sites
    offset by this TP rank; "stream": nn.Dropout / ReluDropout, the model as built). p, train/eval mode and the
    state_dict are kept. Returns the mode."""
    if mode not in MODES:
        raise ValueError(f"train.dropout_masks: must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "keyed" and key is None:
        raise ValueError("apply_dropout_masks: keyed masks need the run's DropoutKey")
    sites = dropout_sites(model)
    modules = dict(model.named_modules())
    for name, (site, layer) in sites.items():
        old = modules[name]
        new: nn.Module
        if mode == "keyed":
            assert key is not None  # checked above
            new = KeyedDropout(old.p, key, site, layer, relu=_relu(old), split=tp_rank if site in SPLIT else 0)
        elif isinstance(old, KeyedDropout):
            new = ReluDropout(old.p) if old.relu else nn.Dropout(old.p)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(
            modules[parent] if parent else model, child, new.to(key.words.device if key else "cpu").train(old.training)
        )
    return mode


def dropout_masks_in_use(model: nn.Module) -> str:
    """ "keyed", "stream" or "mixed": how the model's dropouts draw their masks."""
    forms = {isinstance(m, KeyedDropout) for m in model.modules() if isinstance(m, nn.Dropout)}
    return "mixed" if len(forms) > 1 else ("keyed" if forms == {True} else "stream")
