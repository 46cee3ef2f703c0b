"""`apply_kernels(model, choice, device)`: put the CPU kernels into a built model, or take them out again.

Works on any module tree holding the model's layers: the single-device MemTransformerLM, its tensor-parallel
form (parallel/tensor.py wraps the split dropouts in ForkedDropout, whose inner dropout is swapped here) and a
pipeline's stages. Only parameter-free modules are replaced, so weights, state_dict and optimizer state are
untouched; the swap can be done before or after DeepSpeed wraps the model, and undone.
"""

from __future__ import annotations

import torch
from torch import nn

from megamemo.model.attention import causal_attention, lookahead_attention, mask_scores
from megamemo.model.layers import RelAttention, ReluDropout
from megamemo.util.errors import UsageError

from .compiler import CompilerUnavailable, enable_compiler, uncompiled
from .dropout import CpuDropout
from .flex import flex_causal_attention, flex_lookahead_attention
from .fused import FusedUnavailable, check_device, fused_causal_attention, fused_lookahead_attention
from .keyed import KeyedDropout
from .masking import add_mask_bias

KERNELS = ("auto", "plain", "cpu")
ATTENTIONS = ("auto", "eager", "flex", "fused")  # model.attention
_ATTENTION_FUNCTIONS = {
    "eager": (causal_attention, lookahead_attention),
    "flex": (flex_causal_attention, flex_lookahead_attention),
    "fused": (fused_causal_attention, fused_lookahead_attention),
}
_DROPOUTS = (nn.Dropout, ReluDropout, CpuDropout)  # exactly these types (no other library's subclass is touched)


def resolve_kernels(choice: str, device) -> str:
    """ "plain" or "cpu" for a `train.kernels` choice on a device (a torch.device or its type name). Raises a
    ValueError naming train.kernels for an unknown choice, or cpu kernels asked for on another device."""
    kind = torch.device(device).type
    if choice not in KERNELS:
        raise UsageError(f"train.kernels: must be one of {', '.join(KERNELS)} (got {choice!r})")
    if choice == "auto":
        return "cpu" if kind == "cpu" else "plain"
    if choice == "cpu" and kind != "cpu":
        raise UsageError(f"train.kernels: cpu kernels run on the CPU, this model runs on {kind} (use auto or plain)")
    return choice


def _swap(dropout: nn.Module, cpu: bool) -> nn.Module:
    """A dropout module (one of _DROPOUTS) as the CPU kernel or as torch's, its p, ReLU and mode kept."""
    relu = dropout.relu if isinstance(dropout, CpuDropout) else isinstance(dropout, ReluDropout)
    p = dropout.p
    assert isinstance(p, float | int), p
    new: nn.Module
    if cpu:
        new = CpuDropout(p, relu=relu)
    else:
        new = ReluDropout(p) if relu else nn.Dropout(p)
    return new.train(dropout.training)


def apply_kernels(model: nn.Module, choice: str = "auto", device="cpu") -> str:
    """In place: the model's dropouts and attention masking in the resolved form ("cpu": CpuDropout and
    add_mask_bias; "plain": nn.Dropout / ReluDropout and masked_fill). Returns the form applied."""
    path = resolve_kernels(choice, device)
    cpu = path == "cpu"
    for parent in list(model.modules()):
        if isinstance(parent, RelAttention):
            parent.masking = add_mask_bias if cpu else mask_scores
        for name, child in list(parent.named_children()):
            if type(child) in _DROPOUTS and isinstance(child, CpuDropout) != cpu:
                setattr(parent, name, _swap(child, cpu))
    return path


def kernels_in_use(model: nn.Module) -> str:
    """ "cpu", "plain" or "mixed": which form the model's dropouts and attention masking are in (keyed dropouts,
    megamemo/kernels/keyed.py, are the same on both paths and not counted)."""
    forms = {
        isinstance(m, CpuDropout)
        for m in model.modules()
        if isinstance(m, nn.Dropout) and not isinstance(m, KeyedDropout)
    }  # keyed ones: either path
    forms |= {m.masking is add_mask_bias for m in model.modules() if isinstance(m, RelAttention)}
    return "mixed" if len(forms) > 1 else ("cpu" if forms == {True} else "plain")


def resolve_attention(choice: str, device, generating: bool = False) -> str:
    """ "eager", "flex" or "fused" for an inference `--attention` choice (eval, generate, the probe): auto is flex on
    CUDA (where dynamo can run) and eager on the CPU (flex's CPU form is a reference implementation, forward only),
    and eager for generation (one query a step: a compiled kernel per new length would cost more than it saves).
    fused runs on CUDA, or on the CPU in Triton's interpreter (a ValueError naming --attention otherwise).
    Training resolves auto itself (megamemo/train/forms.py: a start-up check and timing)."""
    if choice not in ATTENTIONS:
        raise UsageError(f"--attention: must be one of {', '.join(ATTENTIONS)} (got {choice!r})")
    if choice == "fused":
        try:
            check_device(device)
        except FusedUnavailable as e:
            raise UsageError(f"--attention: {str(e).removeprefix('model.attention: ')}") from None
    if choice != "auto":
        return choice
    if generating or torch.device(device).type != "cuda":
        return "eager"
    try:
        enable_compiler()
    except CompilerUnavailable:
        return "eager"
    return "flex"


def apply_attention(model: nn.Module, form: str) -> str:
    """In place: every RelAttention of the model computes its attention in `form` ("eager": attention.py's
    functions; "flex": FlexAttention, megamemo/kernels/flex.py; "fused": the Triton kernels, kernels/fused.py).
    Weights and results are unchanged (flex and fused within rounding). "auto" is resolved by the caller (train: a
    start-up check and timing on CUDA; eval/generate: flex on CUDA)."""
    if form not in _ATTENTION_FUNCTIONS:
        raise ValueError(f"model.attention: apply_attention takes eager, flex or fused (got {form!r})")
    causal, lookahead = _ATTENTION_FUNCTIONS[form]
    for m in model.modules():
        if isinstance(m, RelAttention):
            m.causal, m.lookahead = causal, lookahead
    return form


def attention_in_use(model: nn.Module) -> str:
    """ "eager", "flex", "fused" or "mixed": which form the model's attention modules compute in (compiled
    attention regions count as their form)."""
    forms = {
        name
        for m in model.modules()
        if isinstance(m, RelAttention)
        for name, fns in _ATTENTION_FUNCTIONS.items()
        if uncompiled(m.causal) is fns[0]
    }
    return "mixed" if len(forms) != 1 else forms.pop()
