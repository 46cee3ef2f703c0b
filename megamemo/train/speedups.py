"""How a training run's model computes, chosen once it is built on its device: the CPU kernels (train.kernels),
how dropout masks are drawn (train.dropout_masks), the attention form (model.attention) and compiled layers
(train.compile). None of them changes a weight or the model's identity; each says in the start-up line what it
chose, and a fallback says why in one line. The attention form and compiled layers are chosen together
(megamemo/train/forms.py: on CUDA `auto` times the forms that pass a start-up check against eager).
"""

from __future__ import annotations

from dataclasses import dataclass

from megamemo.config.run import ConfigError
from megamemo.kernels import DropoutKey, apply_dropout_masks, apply_kernels
from megamemo.kernels.compiler import compile_attention_regions, compile_layers
from megamemo.train.config import RunConfig
from megamemo.train.forms import choose_form


@dataclass(frozen=True)
class SpeedChoices:
    """What apply_speedups chose: the kernels ("cpu" | "plain"), the DropoutKey of keyed masks (None: stream
    masks), the attention form ("eager" | "flex" | "fused") and how many layers (or attention regions) were
    compiled (0: none)."""

    kernels: str
    dropout_key: DropoutKey | None
    attention: str
    compiled: int

    @property
    def uses_compiler(self) -> bool:
        """torch.compile ran for this run: compiled layers, or flex attention (compiled by torch itself)."""
        return bool(self.compiled) or self.attention == "flex"


def keyed_dropout(cfg: RunConfig, model, device, tp_rank: int = 0, columns=(0,)):
    """train.dropout_masks: keyed -> the run's DropoutKey, every dropout of the model keyed by it (this rank's
    TP rank offsets the split sites; columns: the first global column of each of its micro-batches); stream ->
    None, the model's dropouts as they are."""
    if cfg.train.dropout_masks != "keyed":
        return None
    key = DropoutKey(cfg.train.seed, columns, device)
    try:
        apply_dropout_masks(model, "keyed", key, tp_rank)
    except ValueError as e:
        raise ConfigError(f"train.dropout_masks: {e}") from None
    return key


def apply_speedups(cfg: RunConfig, model, device, micro: int, log, tp_rank: int = 0, columns=(0,)) -> SpeedChoices:
    """Kernels, dropout masks, attention form and compiled layers for the built model on its device.
    tp_rank, columns: see keyed_dropout."""
    try:
        kernels = apply_kernels(model, cfg.train.kernels, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    key = keyed_dropout(cfg, model, device, tp_rank, columns)
    form = choose_form(cfg, model, device, micro, log)
    compiled = 0
    if form.compiled and cfg.parallel.tp > 1:
        compiled = compile_attention_regions(model, cfg.train.compile_backend)
        log(
            f"[train] compile: attention regions under tensor parallelism (parallel.tp={cfg.parallel.tp}): "
            f"megatron-core's parallel linears all-reduce with async_op=True, which torch.compile cannot trace, so the "
            f"attention between the collectives is compiled instead of whole layers"
        )
    elif form.compiled:
        compiled = compile_layers(model, cfg.train.compile_backend)
    return SpeedChoices(kernels, key, form.attention, compiled)
