"""The precisions megamemo trains, converts and evaluates in, by the names configs and flags use: the one table
from a name to its torch dtype and its bytes per element. torch is imported only when a dtype is asked for (the
config and `megamemo plan` use the names without it)."""

from __future__ import annotations

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NAMES = tuple(BYTES)  # ("fp32", "bf16", "fp16"): config choices and --dtype flags
HALF = ("bf16", "fp16")  # the mixed-precision ones (fp32 master weights, half compute)


def _check(name: str) -> None:
    if name not in BYTES:
        raise ValueError(f"unknown precision {name!r} (one of {', '.join(NAMES)})")


def torch_dtype(name: str):
    import torch  # lazy: the planner and the CLI flags read names and sizes without torch (module docstring)

    _check(name)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def element_bytes(name: str) -> int:
    _check(name)
    return BYTES[name]
