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
named beside them). An entry without memory (H200 NVL) gives its peak only: `megamemo plan` offers the kinds with
memory (PLANNED).

Issue 50's additions, datasheet figures (dense = half the "with sparsity" figure where only that one is printed):
  - H100 PCIe (NVIDIA H100 Tensor Core GPU datasheet, PCIe column): 80 GB HBM2e at 2.0 TB/s; FP32 51, TF32 756*,
    BF16/FP16 1,513* TFLOPS. H100 NVL (same datasheet, NVL column): 94 GB HBM3 at 3.9 TB/s; FP32 60, TF32 835*,
    BF16/FP16 1,671*.
  - B200 (NVIDIA HGX B200 / DGX B200 datasheets, per GPU: the 8-GPU figures over 8): 180 GB HBM3e at 7.7 TB/s;
    FP32 75, TF32 2.2 P*, BF16/FP16 4.5 P* TFLOPS; NVLink 5 at 1.8 TB/s a GPU (900 GB/s each way).
  - L40S (NVIDIA L40S datasheet): 48 GB GDDR6 at 864 GB/s; FP32 91.6, TF32 183, BF16/FP16 362.05 TFLOPS dense (366*
    and 733* with sparsity); PCIe Gen4 x16, no NVLink.
  Memory: the datasheet's GB taken as GiB, as the A100/H100 entries do. Links, ASSUMED (no datasheet gives a
  collective's bandwidth): inside a node the fabric's one-way rate at the fraction the SXM entries use (H100: 370
  of NVLink 4's 450 GB/s, 82%) - B200 740 of 900; PCIe Gen5 x16's 64 GB/s -> 50 (H100 PCIe and NVL: the NVL
  bridge joins pairs only, so a collective over more crosses PCIe), Gen4's 32 -> 25 (L40S); between nodes a NIC
  per GPU of 400 Gb/s (B200, as DGX B200's ConnectX-7) = 50 GB/s, 200 Gb/s (H100 PCIe/NVL) = 25, 100 Gb/s (L40S)
  = 12.5. Change them where a cluster differs.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    row: str  # the datasheet's name for it: what a device name is matched to ("H100 SXM")
    names: str  # regex over torch.cuda.get_device_name() (case-insensitive)
    peak_tflops: dict  # dtype ("fp32", "tf32", "bf16", "fp16") -> dense TFLOP/s per device
    memory_gib: float | None = None  # device memory; None: a peak-only entry (not planned)
    mem_bw: float | None = None  # bytes/s
    link: tuple | None = None  # GB/s per device: (inside a node, between nodes)
    fabric: str = ""  # what the links are


V100_SXM2 = {"fp32": 15.7, "fp16": 125.0}
A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
H100_SXM = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}
H100_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}
V100_FABRIC, A100_FABRIC, H100_FABRIC = (
    "NVLink 2 hybrid cube mesh, 100 Gb/s IB",
    "NVSwitch, 200 Gb/s HDR IB",
    "NVSwitch, 400 Gb/s NDR IB",
)

# kind -> entry. A device name is matched against the entries in this order, the first match wins (e.g. "Tesla
# V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100
# PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA B200", "NVIDIA L40S"): the narrower patterns come first.
GPUS: dict[str, Gpu] = {
    "v100s-pcie": Gpu("V100S PCIe", r"V100S", {"fp32": 16.4, "fp16": 130.0}),
    "v100-pcie": Gpu("V100 PCIe", r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0}),
    "v100-16g": Gpu("V100 SXM2", r"V100", V100_SXM2, 16, 900e9, (130, 12.5), V100_FABRIC),  # SXM2, DGXS
    "v100-32g": Gpu("V100 SXM2", r"V100", V100_SXM2, 32, 900e9, (130, 12.5), V100_FABRIC),
    "a100-40g": Gpu("A100", r"A100", A100, 40, 1555e9, (230, 25), A100_FABRIC),
    "a100-80g": Gpu("A100", r"A100", A100, 80, 2039e9, (230, 25), A100_FABRIC),
    "h100-nvl": Gpu("H100 NVL", r"H100.*NVL", H100_NVL, 94, 3900e9, (50, 25), "PCIe Gen5 (NVL bridge pairs), 200 Gb/s"),
    "h100-pcie": Gpu(
        "H100 PCIe",
        r"H100.*(PCIE|HBM2E)",
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
        80,
        2000e9,
        (50, 25),
        "PCIe Gen5 x16, 200 Gb/s",
    ),
    "h100-80g": Gpu("H100 SXM", r"H100", H100_SXM, 80, 3350e9, (370, 50), H100_FABRIC),
    "h200-nvl": Gpu("H200 NVL", r"H200.*NVL", H100_NVL),
    "h200": Gpu("H200 SXM", r"H200", H100_SXM, 140, 4800e9, (370, 50), H100_FABRIC),
    "b200": Gpu(
        "B200",
        r"B200",
        {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0},
        180,
        7700e9,
        (740, 50),
        "NVLink 5 NVSwitch, 400 Gb/s IB",
    ),
    "l40s": Gpu(
        "L40S",
        r"L40S",
        {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
        48,
        864e9,
        (25, 12.5),
        "PCIe Gen4 x16, 100 Gb/s",
    ),
}
PLANNED = tuple(kind for kind, g in GPUS.items() if g.memory_gib is not None)  # what `megamemo plan --gpu` takes


def unknown_kind(kind: str, known) -> ValueError:
    """The one error for a device kind that is not in a table: the nearest known kind, and all of them."""
    near = difflib.get_close_matches(kind, list(known), n=1)
    return ValueError(
        f"unknown device kind {kind!r}" + (f" (nearest: {near[0]})" if near else "") + f"; known: {', '.join(known)}"
    )


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
