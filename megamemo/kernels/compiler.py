"""Regional torch.compile of the model's layers (train.compile) and the TorchDynamo switch it needs.

Each decoder layer (XLLayer / LaMemoLayer, wherever it sits: the single model, its tensor-parallel form, a
pipeline stage) is compiled on its own with nn.Module.compile: parameter names, state_dict and the optimizer are
untouched, and the layers share one compiled graph (torch inlines the modules, so a 24-layer model compiles one
layer's graph, not 24). Fused elementwise kernels (LayerNorm, dropout, residuals, the fp32 score math,
interpolation) and fewer launches are what it buys; on the CPU it measured slower than megamemo's CPU kernels,
so `auto` is on for CUDA only.

Graphs per run, with static shapes (dynamic=None: a size that changes is made symbolic on its second value):
the first segment has no memory and the top layer skips its memory rows' o_net and feed-forward, so the layer
compiles for (no memory | memory) x (inner | top layer) = 4 graphs, 3 recompiles, when the memory reaches its
full length in one segment (mem_len <= tgt_len); a longer memory that grows over several segments adds one
recompile per layer kind when its length first changes again (then symbolic). `compile_stats()` counts them.

megamemo's command sets TORCHDYNAMO_DISABLE=1 when the user did not (cli.py: nothing is compiled by default,
and DeepSpeed's start-up would load inductor for nothing); `enable_compiler()` lifts it again for a run that
compiles, and says in one line why it cannot when the user set it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from megamemo.model.layers import LaMemoLayer, RelAttention, XLLayer
from megamemo.util.errors import MegamemoError

COMPILE = ("auto", "on", "off")  # train.compile
ENV = "TORCHDYNAMO_DISABLE"
SET_BY_MEGAMEMO = "MEGAMEMO_SET_TORCHDYNAMO_DISABLE"  # cli.py marks a TORCHDYNAMO_DISABLE it set itself


class CompilerUnavailable(MegamemoError, RuntimeError):
    """TorchDynamo is switched off by the user's environment."""


def resolve_compile(choice: str, device) -> bool:
    """Whether layers are compiled for a `train.compile` choice on a device (auto: CUDA only)."""
    if choice not in COMPILE:
        raise ValueError(f"train.compile: must be one of {', '.join(COMPILE)} (got {choice!r})")
    if choice == "auto":
        return torch.device(device).type == "cuda"
    return choice == "on"


def enable_compiler() -> None:
    """Lift megamemo's own TORCHDYNAMO_DISABLE=1 for this process (torch reads it at each torch.compile call).
    A TORCHDYNAMO_DISABLE=1 the user set is kept: CompilerUnavailable names it."""
    if os.environ.get(ENV) != "1":
        return
    if os.environ.get(SET_BY_MEGAMEMO) == "1":
        del os.environ[ENV]
        os.environ.pop(SET_BY_MEGAMEMO, None)
        return
    raise CompilerUnavailable(
        f"{ENV}=1 is set in the environment: torch.compile and FlexAttention's kernel need TorchDynamo (unset it)"
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (XLLayer, LaMemoLayer))]


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer of the model in place (nn.Module.compile); returns how many. The layers'
    code is one: raise the recompile limit above the graphs a run makes (training and evaluation lengths)."""
    enable_compiler()
    import torch._dynamo  # heavy (a second or more): only when something is compiled

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
    return len(layers)


def compile_attention_regions(model: nn.Module, backend: str = "inductor") -> int:
    """Under tensor parallelism, where a whole layer cannot be compiled (megatron-core's linears all-reduce with
    async_op=True, which dynamo cannot trace): compile the attention between the collectives instead, each
    RelAttention's causal and look-ahead functions (the scores, the position term, masking, softmax and the
    log-normaliser: the score-sized round trips, most of a layer's non-GEMM time). One compiled function per
    attention function, shared by the layers. Returns how many attention modules were given them."""
    enable_compiler()
    import torch._dynamo  # heavy (a second or more): only when something is compiled

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    modules = [m for m in model.modules() if isinstance(m, RelAttention)]
    for m in modules:
        m.causal, m.lookahead = _compiled(m.causal, backend), _compiled(m.lookahead, backend)
    return len(modules)


_COMPILED_FUNCTIONS: dict = {}


def _compiled(fn, backend: str):
    """torch.compile(fn) once per (function, backend); a function compiled already is returned as it is."""
    if uncompiled(fn) is not fn:
        return fn
    key = (fn, backend)
    if key not in _COMPILED_FUNCTIONS:
        _COMPILED_FUNCTIONS[key] = torch.compile(fn, backend=backend, dynamic=None)
    return _COMPILED_FUNCTIONS[key]


def uncompiled(fn):
    """The function a torch.compile wrapper compiles (fn itself when it is none)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def run_eagerly():
    """A context in which compiled layers run their eager code (torch.compiler.set_stance("force_eager")):
    validation and the checkpoint probe of a compiled run, whose other lengths and eval mode would each compile
    graphs of their own for a few calls."""
    return torch.compiler.set_stance("force_eager")


def compile_stats() -> dict:
    """{"graphs": graphs TorchDynamo compiled so far in this process, "recompiles": graphs beyond the first}. With
    compiled layers (one code, shared) the recompiles are the layer's; with FlexAttention alone, its kernel's."""
    from torch._dynamo.utils import counters  # heavy: only where compiles are counted

    graphs = int(counters["stats"].get("unique_graphs", 0))
    return {"graphs": graphs, "recompiles": max(0, graphs - 1)}
