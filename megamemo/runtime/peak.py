"""Peak FLOP/s of a device for MFU (model FLOPs utilisation): a table of NVIDIA datasheet figures by device name.

Sources (dense figures; NVIDIA's datasheets print the tensor-core numbers "with sparsity" for A100 as a second
figure and for H100/H200 only, so the dense figure used here is half of that one):
  - NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 / PCIe; V100S PCIe datasheet): single precision and
    "Tensor Performance" (fp16 in, fp32 accumulate). V100 has no bf16 or tf32 tensor cores.
  - NVIDIA A100 Tensor Core GPU datasheet (40GB/80GB, SXM and PCIe alike): FP32, TF32, BF16 and FP16 tensor core.
  - NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, H100 NVL; the earlier PCIe edition for H100 PCIe) and the
    NVIDIA H200 datasheet (H200 SXM / NVL: the H100 SXM / NVL compute figures).

The dtype key is what the matmuls run in: "fp32" unless torch lets fp32 matmuls use TF32
(torch.get_float32_matmul_precision() != "highest"; off by default), then "tf32"; "bf16" and "fp16" for those
precisions. A device or dtype not in the table has no peak (MFU "n/a"); MEGAMEMO_PEAK_TFLOPS=<per-device TFLOP/s>
sets one (another GPU, a CPU figure you measured).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

# TFLOP/s per device, dense
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100 SXM2": {"fp32": 15.7, "fp16": 125.0},
    "V100 PCIe": {"fp32": 14.0, "fp16": 112.0},
    "V100S PCIe": {"fp32": 16.4, "fp16": 130.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
}
PEAK_TFLOPS["H200 SXM"] = PEAK_TFLOPS["H100 SXM"]
PEAK_TFLOPS["H200 NVL"] = PEAK_TFLOPS["H100 NVL"]

# torch.cuda.get_device_name() -> table row; first match wins (e.g. "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200")
_NAMES = [
    (r"V100S", "V100S PCIe"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"),                 # SXM2, DGXS
    (r"A100", "A100"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100.*(PCIE|HBM2E)", "H100 PCIe"),
    (r"H100", "H100 SXM"),
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200 SXM"),
]

ENV = "MEGAMEMO_PEAK_TFLOPS"


def table_row(device_name: str) -> str | None:
    """The PEAK_TFLOPS row of a CUDA device name, or None for a device not in the table."""
    for pattern, row in _NAMES:
        if re.search(pattern, device_name, re.IGNORECASE):
            return row
    return None


def matmul_dtype(precision: str, fp32_matmul_precision: str = "highest") -> str:
    """The table's dtype key for a run's precision ("fp32" | "bf16" | "fp16")."""
    if precision == "fp32":
        return "fp32" if fp32_matmul_precision == "highest" else "tf32"
    return precision


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Per-device peak FLOP/s for a CUDA device name and a table dtype, or None when unknown."""
    row = table_row(device_name)
    tflops = PEAK_TFLOPS.get(row, {}).get(dtype) if row else None
    return None if tflops is None else tflops * 1e12


@dataclass
class Peak:
    flops: float | None     # per device, FLOP/s; None: unknown (MFU n/a)
    source: str             # what it is, for the start line: "A100 bf16 datasheet", "n/a (cpu)", ...


def device_peak(device, precision: str, environ=None) -> Peak:
    """The peak of the device a run uses (a torch.device or its string) at the run's precision."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        from megamemo.config.run import ConfigError

        try:
            tflops = float(env[ENV])
        except ValueError:
            tflops = float("nan")
        if not tflops > 0 or tflops == float("inf"):
            raise ConfigError(f"{ENV}: must be a positive number of TFLOP/s per device, got {env[ENV]!r}")
        return Peak(tflops * 1e12, f"{tflops:g} TFLOP/s ({ENV})")
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return Peak(None, f"n/a ({dev.type}: no datasheet peak; set {ENV})")
    name = torch.cuda.get_device_name(dev)
    dtype = matmul_dtype(precision, torch.get_float32_matmul_precision())
    flops = peak_flops(name, dtype)
    if flops is None:
        why = "not in megamemo/runtime/peak.py" if table_row(name) is None else f"no {dtype} figure"
        return Peak(None, f"n/a ({name}: {why}; set {ENV})")
    return Peak(flops, f"{flops / 1e12:g} TFLOP/s ({name} as {table_row(name)}, {dtype}, datasheet)")


def format_flops(x: float) -> str:
    """12345678 -> '12.3 MFLOP' (the caller adds '/s' or '/token')."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"
