"""How a training run's model computes, chosen once it is built on its device: the CPU kernels (train.kernels),
how dropout masks are drawn (train.dropout_masks), the attention form (model.attention) and compiled layers
(train.compile). None of them changes a weight or the model's identity; each says in the start-up line what it
chose, and a fallback says why in one line.

model.attention: auto trains with FlexAttention only on CUDA, without attention dropout, and after the start-up
check (megamemo/kernels/flex_check.py: one layer of the run, its shapes and dtype, forward and backward against
eager) agrees on every rank; otherwise eager. flex asks for it: a CPU device, attention dropout or a
TORCHDYNAMO_DISABLE=1 of the user's are config errors, and a failed check stops the run naming what it saw.
"""
from __future__ import annotations

import torch

from megamemo.config.run import ConfigError
from megamemo.train.config import RunConfig


def _all_agree(ok: bool, device) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    t = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def choose_attention(cfg: RunConfig, model, device, micro: int, log) -> str:
    """Resolve model.attention for this run and put it into the model; returns "eager" or "flex"."""
    from megamemo.kernels import apply_attention
    from megamemo.kernels.compiler import CompilerUnavailable, decoder_layers, enable_compiler
    from megamemo.kernels.flex_check import flex_matches_eager

    choice, m = cfg.model.attention, cfg.model
    cuda = torch.device(device).type == "cuda"
    if choice == "eager" or (choice == "auto" and not cuda):
        return apply_attention(model, "eager")
    if choice == "auto" and cfg.train.deterministic:
        log("[train] attention: eager (train.deterministic: FlexAttention's backward adds the position term's "
            "gradients atomically, in no fixed order)")
        return apply_attention(model, "eager")
    if choice == "auto" and m.dropatt > 0:
        log(f"[train] attention: eager (model.dropatt={m.dropatt}: FlexAttention cannot drop attention weights)")
        return apply_attention(model, "eager")
    try:
        enable_compiler()
    except CompilerUnavailable as e:
        if choice == "flex":
            raise ConfigError(f"model.attention: flex: {e}") from None
        log(f"[train] attention: eager ({e})")
        return apply_attention(model, "eager")
    layers = decoder_layers(model)
    ok, line = True, "no decoder layer on this rank"
    if layers:
        ok, line = flex_matches_eager(layers[0], m, micro, m.tgt_len, m.mem_len if m.has_memory else 0)
    agreed = _all_agree(ok, device)
    if not agreed:
        if choice == "flex" and ok:             # (rank 0 says the error: its own check may have passed)
            raise ConfigError(f"model.attention: flex does not match eager on another rank (this rank's check: "
                              f"{line})")
        if choice == "flex":
            raise ConfigError(f"model.attention: flex does not match eager here: {line}")
        log(f"[train] attention: eager (FlexAttention's start-up check failed on "
            f"{'this rank' if not ok else 'another rank'}: {line})")
        return apply_attention(model, "eager")
    log(f"[train] attention: flex ({line})")
    return apply_attention(model, "flex")


def keyed_dropout(cfg: RunConfig, model, device, tp_rank: int = 0, columns=(0,)):
    """train.dropout_masks: keyed -> the run's DropoutKey, every dropout of the model keyed by it (this rank's
    TP rank offsets the split sites; columns: the first global column of each of its micro-batches); stream ->
    None, the model's dropouts as they are."""
    from megamemo.kernels import DropoutKey, apply_dropout_masks

    if cfg.train.dropout_masks != "keyed":
        return None
    key = DropoutKey(cfg.train.seed, columns, device)
    try:
        apply_dropout_masks(model, "keyed", key, tp_rank)
    except ValueError as e:
        raise ConfigError(f"train.dropout_masks: {e}") from None
    return key


def apply_speedups(cfg: RunConfig, model, device, micro: int, log, tp_rank: int = 0, columns=(0,)) -> dict:
    """Kernels, dropout masks, attention form and compiled layers for the built model on its device:
    {"kernels": "cpu"|"plain", "dropout_key": the DropoutKey of keyed masks (None: stream), "attention":
    "eager"|"flex", "compiled": layers compiled (0: none)}. tp_rank, columns: see keyed_dropout."""
    from megamemo.kernels import apply_kernels
    from megamemo.kernels.compiler import CompilerUnavailable, compile_layers, resolve_compile

    try:
        kernels = apply_kernels(model, cfg.train.kernels, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    key = keyed_dropout(cfg, model, device, tp_rank, columns)
    attention = choose_attention(cfg, model, device, micro, log)
    compiled = 0
    if resolve_compile(cfg.train.compile, device) and cfg.parallel.tp > 1:
        log(f"[train] compile: off under tensor parallelism (parallel.tp={cfg.parallel.tp}): megatron-core's parallel "
            f"linears all-reduce with async_op=True, which torch.compile cannot trace, so each layer would break "
            f"into several graphs, recompiled per memory length")
    elif resolve_compile(cfg.train.compile, device):
        try:
            compiled = compile_layers(model, cfg.train.compile_backend)
        except CompilerUnavailable as e:
            if cfg.train.compile == "on":
                raise ConfigError(f"train.compile: on: {e}") from None
            log(f"[train] compile: off ({e})")
    return {"kernels": kernels, "dropout_key": key, "attention": attention, "compiled": compiled}
