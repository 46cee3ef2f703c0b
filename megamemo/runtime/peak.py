"""Peak FLOP/s of a device for MFU (model FLOPs utilisation): the datasheet figure of the GPU catalogue's entry
(megamemo/runtime/gpus.py) that the device's name matches.

The dtype key is what the matmuls run in: "fp32" unless torch lets fp32 matmuls use TF32
(torch.get_float32_matmul_precision() != "highest"; off by default), then "tf32"; "bf16" and "fp16" for those
precisions. A device or dtype not in the catalogue has no peak (MFU "n/a"); MEGAMEMO_PEAK_TFLOPS=<per-device
TFLOP/s> sets one (another GPU, a CPU figure you measured).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megamemo.config.run import ConfigError
from megamemo.runtime.gpus import by_device_name

ENV = "MEGAMEMO_PEAK_TFLOPS"


def table_row(device_name: str) -> str | None:
    """The catalogue row (the datasheet's name) of a CUDA device name, or None for a device not in it."""
    g = by_device_name(device_name)
    return None if g is None else g.row


def matmul_dtype(precision: str, fp32_matmul_precision: str = "highest") -> str:
    """The table's dtype key for a run's precision ("fp32" | "bf16" | "fp16")."""
    if precision == "fp32":
        return "fp32" if fp32_matmul_precision == "highest" else "tf32"
    return precision


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Per-device peak FLOP/s for a CUDA device name and a table dtype, or None when unknown."""
    g = by_device_name(device_name)
    tflops = None if g is None else g.peak_tflops.get(dtype)
    return None if tflops is None else tflops * 1e12


@dataclass
class Peak:
    flops: float | None  # per device, FLOP/s; None: unknown (MFU n/a)
    source: str  # what it is, for the start line: "A100 bf16 datasheet", "n/a (cpu)", ...


def device_peak(device, precision: str, environ=None) -> Peak:
    """The peak of the device a run uses (a torch.device or its string) at the run's precision."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        try:
            tflops = float(env[ENV])
        except ValueError:
            tflops = float("nan")
        if not tflops > 0 or tflops == float("inf"):
            raise ConfigError(f"{ENV}: must be a positive number of TFLOP/s per device, got {env[ENV]!r}")
        return Peak(tflops * 1e12, f"{tflops:g} TFLOP/s ({ENV})")
    dev = torch.device(device)
    if dev.type != "cuda":
        return Peak(None, f"n/a ({dev.type}: no datasheet peak; set {ENV})")
    name = torch.cuda.get_device_name(dev)
    dtype = matmul_dtype(precision, torch.get_float32_matmul_precision())
    flops = peak_flops(name, dtype)
    if flops is None:
        why = "not in megamemo/runtime/gpus.py" if table_row(name) is None else f"no {dtype} figure"
        return Peak(None, f"n/a ({name}: {why}; set {ENV})")
    return Peak(flops, f"{flops / 1e12:g} TFLOP/s ({name} as {table_row(name)}, {dtype}, datasheet)")


def format_flops(x: float) -> str:
    """12345678 -> '12.3 MFLOP' (the caller adds '/s' or '/token')."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"
