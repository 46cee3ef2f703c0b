"""The GPU catalogue: one entry per kind of GPU with every fact megamemo uses about it - the name a device reports
(matched for its peak: MFU, runtime/peak.py), dense peak FLOP/s by matmul dtype, memory, memory bandwidth and the
fabric between devices (`megamemo plan`: plan/devices.py, plan/layouts.py). Adding a GPU is one entry here.

Peak FLOP/s, dense (NVIDIA's datasheets print the tensor-core numbers "with sparsity" for A100 as a second figure
and for H100/H200 only, so the dense figure used here is half of that one):
  - NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 / PCIe; V100S PCIe datasheet): single precision and
    "Tensor Performance" (fp16 in, fp32 accumulate). V100 has no bf16 or tf32 tensor cores.
  - NVIDIA A100 Tensor Core GPU datasheet (40GB/80GB, SXM and PCIe alike): FP32, TF32, BF16 and FP16 tensor core.
  - NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, H100 NVL; the earlier PCIe edition for H100 PCIe) and the
    NVIDIA H200 datasheet (H200 SXM / NVL: the H100 SXM / NVL compute figures).
Memory bandwidth, datasheets: NVIDIA Tesla V100 (SXM2, 16 and 32 GB HBM2) 900 GB/s; NVIDIA A100 Tensor Core GPU
(40GB SXM HBM2 1,555 GB/s, 80GB SXM HBM2e 2,039 GB/s); NVIDIA H100 Tensor Core GPU (H100 SXM 80GB HBM3 3.35 TB/s);
NVIDIA H200 Tensor Core GPU (H200 SXM 141GB HBM3e 4.8 TB/s, NVLink 900 GB/s as H100 SXM's: the H100 SXM links; 140
GiB is what torch reports of it, 143,771 MiB). The links are per device, inside a node and between nodes (the fabric
named beside them). An entry without memory (the PCIe and NVL forms) gives its peak only: `megamemo plan` offers the
kinds with memory (PLANNED).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    row: str                        # the datasheet's name for it: what a device name is matched to ("H100 SXM")
    names: str                      # regex over torch.cuda.get_device_name() (case-insensitive)
    peak_tflops: dict               # dtype ("fp32", "tf32", "bf16", "fp16") -> dense TFLOP/s per device
    memory_gib: float | None = None     # device memory; None: a peak-only entry (not planned)
    mem_bw: float | None = None         # bytes/s
    link: tuple | None = None           # GB/s per device: (inside a node, between nodes)
    fabric: str = ""                    # what the links are


V100_SXM2 = {"fp32": 15.7, "fp16": 125.0}
A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
H100_SXM = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}
H100_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}
V100_FABRIC, A100_FABRIC, H100_FABRIC = ("NVLink 2 hybrid cube mesh, 100 Gb/s IB", "NVSwitch, 200 Gb/s HDR IB",
                                         "NVSwitch, 400 Gb/s NDR IB")

# kind -> entry. A device name is matched against the entries in this order, the first match wins (e.g. "Tesla
# V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100
# PCIe", "NVIDIA H100 NVL", "NVIDIA H200"): the narrower patterns come first.
GPUS: dict[str, Gpu] = {
    "v100s-pcie": Gpu("V100S PCIe", r"V100S", {"fp32": 16.4, "fp16": 130.0}),
    "v100-pcie": Gpu("V100 PCIe", r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0}),
    "v100-16g": Gpu("V100 SXM2", r"V100", V100_SXM2, 16, 900e9, (130, 12.5), V100_FABRIC),   # SXM2, DGXS
    "v100-32g": Gpu("V100 SXM2", r"V100", V100_SXM2, 32, 900e9, (130, 12.5), V100_FABRIC),
    "a100-40g": Gpu("A100", r"A100", A100, 40, 1555e9, (230, 25), A100_FABRIC),
    "a100-80g": Gpu("A100", r"A100", A100, 80, 2039e9, (230, 25), A100_FABRIC),
    "h100-nvl": Gpu("H100 NVL", r"H100.*NVL", H100_NVL),
    "h100-pcie": Gpu("H100 PCIe", r"H100.*(PCIE|HBM2E)", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    "h100-80g": Gpu("H100 SXM", r"H100", H100_SXM, 80, 3350e9, (370, 50), H100_FABRIC),
    "h200-nvl": Gpu("H200 NVL", r"H200.*NVL", H100_NVL),
    "h200": Gpu("H200 SXM", r"H200", H100_SXM, 140, 4800e9, (370, 50), H100_FABRIC),
}
PLANNED = tuple(kind for kind, g in GPUS.items() if g.memory_gib is not None)   # what `megamemo plan --gpu` takes


def unknown_kind(kind: str, known) -> ValueError:
    """The one error for a device kind that is not in a table: the nearest known kind, and all of them."""
    near = difflib.get_close_matches(kind, list(known), n=1)
    return ValueError(f"unknown device kind {kind!r}" + (f" (nearest: {near[0]})" if near else "")
                      + f"; known: {', '.join(known)}")


def gpu(kind: str, known=PLANNED) -> Gpu:
    """The entry of `kind`, one of `known` (default: the kinds `megamemo plan` takes); else unknown_kind's error."""
    if kind not in known:
        raise unknown_kind(kind, known)
    return GPUS[kind]


def by_device_name(device_name: str) -> Gpu | None:
    """The entry of a CUDA device name (torch.cuda.get_device_name()), or None for a GPU not in the catalogue."""
    for g in GPUS.values():
        if re.search(g.names, device_name, re.IGNORECASE):
            return g
    return None
