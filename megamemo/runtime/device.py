"""Which device a training process runs on, decided once and loudly.

The user's wish comes from the environment (the launchers set it; see launch/device.sh):
    MEGAMEMO_DEVICE = auto (default) | gpu | cpu
    DS_ACCELERATOR  = cuda | cpu      (DeepSpeed's own switch; launch/device.sh sets it from MEGAMEMO_DEVICE)
gpu (or DS_ACCELERATOR=cuda) requires a CUDA device; cpu (or DS_ACCELERATOR=cpu) runs gloo + DeepSpeed's CPU
accelerator even where GPUs exist. auto takes CUDA when torch sees a device, the CPU when the node has no NVIDIA
GPU at all, and stops when the node has NVIDIA GPUs that torch cannot use (a CPU-only torch, a driver too old
for torch's CUDA, a container started without --nv / --gpus): a job meant for GPUs never trains on the CPU
quietly. The decision is written back to DS_ACCELERATOR before DeepSpeed picks its accelerator.

Which GPU: a task sees either every GPU of its node (index = local rank) or only its own (--gpus-per-task=1 or
GPU binding: index 0). DeepSpeed reads LOCAL_RANK as the device index (engine and PipelineModule), so dist.init
exports the chosen index there.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

from megamemo.util.errors import MegamemoError

_ACCELERATOR = {"gpu": "cuda", "cpu": "cpu"}


class DeviceError(MegamemoError, RuntimeError):
    """The device the user asked for cannot be used; the message says why, in one line."""


def requested(env) -> str:
    """auto | gpu | cpu, from MEGAMEMO_DEVICE and DS_ACCELERATOR (which must not contradict each other)."""
    want = (env.get("MEGAMEMO_DEVICE") or "auto").strip().lower()
    want = {"cuda": "gpu"}.get(want, want)
    if want not in ("auto", "gpu", "cpu"):
        raise DeviceError(f"MEGAMEMO_DEVICE must be auto, gpu or cpu (got {env.get('MEGAMEMO_DEVICE')!r})")
    acc = (env.get("DS_ACCELERATOR") or "").strip().lower()
    if acc and acc not in ("cuda", "cpu"):
        raise DeviceError(f"DS_ACCELERATOR={acc}: megamemo trains on cuda or cpu")
    from_acc = {"cuda": "gpu", "cpu": "cpu"}.get(acc)
    if want == "auto":
        return from_acc or "auto"
    if from_acc and from_acc != want:
        raise DeviceError(f"MEGAMEMO_DEVICE={want} contradicts DS_ACCELERATOR={acc}: unset one of them")
    return want


def node_gpus() -> int:
    """NVIDIA GPUs the kernel driver lists on this node (also visible inside a container started without GPUs)."""
    try:
        return sum(1 for _ in Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return 0


def choose(want: str, cuda_devices: int, gpus_on_node: int, why_no_cuda: str) -> str:
    """'cuda' or 'cpu' for a wish (requested()), the CUDA devices torch sees and the node's NVIDIA GPUs."""
    if want == "cpu":
        return "cpu"
    if cuda_devices > 0:
        return "cuda"
    if want == "gpu":
        raise DeviceError(
            f"a GPU was asked for (MEGAMEMO_DEVICE=gpu / DS_ACCELERATOR=cuda) but {why_no_cuda}; "
            f"set MEGAMEMO_DEVICE=cpu to train on the CPU"
        )
    if gpus_on_node > 0:
        raise DeviceError(
            f"this node has {gpus_on_node} NVIDIA GPU(s) but {why_no_cuda}; set MEGAMEMO_DEVICE=cpu "
            f"to train on the CPU anyway"
        )
    return "cpu"


def pick_cuda_device(local_rank: int, local_world: int | None, visible: int) -> int:
    """The CUDA device index for a task: 0 when it sees one device (a GPU bound to it), its local rank when it
    sees at least one per task of its node, else an error naming the numbers."""
    if visible < 1:
        raise DeviceError("no CUDA device visible to this task")
    if visible == 1:
        return 0
    needed = max(local_rank + 1, local_world or 0)
    if visible >= needed:
        return local_rank
    tasks = f"{local_world} tasks on this node" if local_world else f"local rank {local_rank}"
    raise DeviceError(
        f"{tasks} but this task sees {visible} CUDA devices "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give every task "
        f"one GPU (--gpus-per-task=1) or every task all of the node's GPUs, one task per GPU"
    )


def cuda_devices(torch) -> tuple[int, str]:
    """(CUDA devices torch sees, the first line of the warning torch gave while looking, or '')."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = torch.cuda.device_count()
    return count, next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()), "")


def why_no_cuda(torch, said: str = "") -> str:
    """Why torch sees no CUDA device, as far as it can be told (`said`: torch's own warning, if any)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA one: see README, Install)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        + (f" ({said})" if said else " (a driver older than this CUDA needs, or a container without GPUs?)")
        + where
    )


def resolve(env=None) -> str:
    """Decide 'cuda' or 'cpu' for this process and set DS_ACCELERATOR to match. Raises DeviceError."""
    env = os.environ if env is None else env
    want = requested(env)
    count, said = cuda_devices(torch) if want != "cpu" else (0, "")
    kind = choose(want, count, node_gpus() if want == "auto" else 0, why_no_cuda(torch, said) if not count else "")
    accel = _ACCELERATOR["gpu" if kind == "cuda" else "cpu"]
    ds = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(ds, "ds_accelerator", None) if ds is not None else None
    if chosen is not None and chosen.device_name() != accel:
        raise DeviceError(
            f"DeepSpeed already runs on its {chosen.device_name()} accelerator, megamemo chose {accel} "
            f"(set DS_ACCELERATOR={accel} before starting)"
        )
    env["DS_ACCELERATOR"] = accel
    return kind


def torch_device(name: str | None) -> str:
    """The device an evaluating command runs on (eval, generate, analyze, harness: --device): "auto" is cuda where
    torch sees a CUDA device, else cpu, decided when the command runs; any other name is taken as given."""
    if name not in ("auto", None):
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- determinism (train.deterministic) ------------------------------------------------------------------------
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS reuses workspaces in a fixed order (needed by torch below)
    "NCCL_ALGO": "Ring",  # one reduction order whatever the message size
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP reductions (Hopper) are not run-to-run deterministic
}


def make_deterministic(env=None) -> dict:
    """torch's deterministic kernels (an op without one raises, naming itself), no cuDNN autotuning, and the
    environment above where the user has not set it; before any CUDA or NCCL work. Returns what it set."""
    env = os.environ if env is None else env
    added = {k: v for k, v in DETERMINISTIC_ENV.items() if k not in env}
    env.update(added)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return added


# ---- TF32 (precision.allow_tf32) ------------------------------------------------------------------------------
def set_tf32(allow: bool) -> None:
    """TF32 tensor-core products for fp32 matmuls and convolutions on CUDA, as the user allows (and off
    otherwise: torch's matmul default is off, cuDNN's on). No effect on the CPU or on bf16/fp16 products."""
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


def tf32_state() -> str:
    """The TF32 switches as this process's torch reports them now ("TF32 on" / "TF32 off"; the cuDNN switch named
    when it differs): what the run log records, so that a run shows what it ran with, not what it asked for."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    state = f"TF32 {'on' if matmul else 'off'}"
    return state if cudnn == matmul else f"{state}, cuDNN TF32 {'on' if cudnn else 'off'}"
