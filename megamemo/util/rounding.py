"""Rounding-error accounting for half-precision forwards, in the standard model of floating-point arithmetic.

Every operation that writes a bf16/fp16 tensor by arithmetic rounds each element with relative error at most u,
the dtype's unit roundoff (2^-8 for bf16, 2^-11 for fp16); data movement (views, copies, concatenation, gathers,
ReLU, max, eval-mode dropout) writes values it was given and rounds nothing, nor does a cast that does not narrow.
A GEMM additionally accumulates its K products (fp32 on CPUs and in cuBLAS) before that rounding, off by at most
K * 2^-24 relative. `RoundingCounter` counts the rounding operations of a forward on the run itself, so that a
bound can follow the model's depth and structure (tests/model/test_half_positions.py, checkpoint/probe_bound.py).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

ACCUMULATION_ROUNDOFF = 2.0**-24  # fp32 accumulators of bf16/fp16 GEMMs
# torch functions and Tensor methods (by name) that move, select or pass on values without rounding them; dropout
# is one in eval mode (the forwards counted here)
EXACT = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "narrow",
        "split",
        "chunk",
        "unbind",
        "select",
        "__getitem__",
        "__get__",
        "as_strided",
        "contiguous",
        "clone",
        "detach",
        "cat",
        "stack",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "masked_fill",
        "masked_fill_",
        "index_select",
        "index_copy",
        "gather",
        "where",
        "embedding",
        "dropout",
        "relu",
        "relu_",
        "max",
        "amax",
        "min",
        "amin",
        "pad",
        "zeros_like",
        "empty_like",
        "new_zeros",
        "new_empty",
        "fill_",
        "zero_",
    }
)
CASTS = frozenset({"to", "type", "bfloat16", "half", "float", "double", "type_as", "copy_"})  # round if they narrow


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the machine epsilon (2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32)."""
    return torch.finfo(dtype).eps / 2


def _narrows(src, out_dtype: torch.dtype) -> bool:
    if not isinstance(src, torch.Tensor) or src.dtype == out_dtype:
        return False
    return not src.is_floating_point() or torch.finfo(src.dtype).eps < torch.finfo(out_dtype).eps


class RoundingCounter(TorchFunctionMode):
    """Counts the torch calls made under it (the outermost ones: what a model's code calls, F.linear as one) that
    write a `dtype` tensor by rounding: arithmetic, or a cast that narrows. Any call not known to be exact counts,
    so an unknown one makes the count larger, never smaller. The calls run unchanged (same kernels, same results).
    A function mode, not a dispatch mode: entering one of those imports torch._dynamo (seconds)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.count = dtype, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if name not in EXACT and any(isinstance(o, torch.Tensor) and o.dtype == self.dtype for o in outs):
            src = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
            if name not in CASTS or _narrows(src, self.dtype):
                self.count += 1
        return out
