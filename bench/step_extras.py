"""What bench/gpu_step.py measures beside the forms' steps (its --forms auto, --optimizer and --profile-layer):

* auto_forms: the forms `model.attention: auto` times for a config's model on one device (megamemo/train/forms.py
  candidates), as gpu_step's form names, with the forms it leaves out and why;
* optimizer_row: the one-GPU optimizer step of the model: torch's AdamW (fused where the config says so, as
  megamemo/train/engine.py makes it) over fp32 master weights, the gradient-norm clip, and the copy back into the
  half-precision weights the step computes with. DeepSpeed's own wrapper adds its bookkeeping to this;
* profile_row: the top kernels of one compiled layer's forward + backward (torch.profiler), at the run's shapes,
  through the start-up check's inputs (megamemo/kernels/form_check.py); on the CPU, the top operators.
"""

from __future__ import annotations

import time

import torch


def form_name(attention: str, compiled: bool) -> str:
    """gpu_step's name of a form: eager, compiled, flex, compiled+flex, fused, compiled+fused."""
    if not compiled:
        return attention
    return "compiled" if attention == "eager" else f"compiled+{attention}"


def auto_forms(config: str, device, log=print) -> tuple[list[str], list[str]]:
    """(the forms auto would time for `config`'s model on one `device` (tp 1, pp 1: this bench's layout), eager
    first; "form: why not" for those it leaves out)."""
    from megamemo.train.config import load
    from megamemo.train.forms import candidates

    cfg = load(config, ["parallel.tp=1", "parallel.pp=1"], vocab_fallback=32000)  # the forms need no data
    forms, skipped = candidates(cfg, device, log)
    return [form_name(f.attention, f.compiled) for f in forms], skipped


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_row(base: torch.nn.Module, device, dtype, steps: int = 5, clip: float = 0.25, fused: bool = True) -> dict:
    """The optimizer step's time over every parameter of `base` (see the module docstring)."""
    master = [p.detach().to(device=device, dtype=torch.float32).requires_grad_() for p in base.parameters()]
    half = [p.detach().to(device=device, dtype=dtype) for p in master]
    g = torch.Generator(device="cpu").manual_seed(2)
    for p in master:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    opt = torch.optim.AdamW(master, lr=1e-4, fused=fused or None)

    def step():
        torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        torch._foreach_copy_(half, master)

    step()  # the optimizer's state is made here
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    row = {
        "form": "optimizer",
        "ms_per_step": ms,
        "params": sum(p.numel() for p in master),
        "what": f"AdamW{' (fused)' if fused else ''} over fp32 master weights + clip + copy to {str(dtype)[6:]}",
    }
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row  # master, half and opt are freed with this frame


def _device_time(e, cuda: bool) -> float:
    if not cuda:
        return e.self_cpu_time_total
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


def profile_row(model: torch.nn.Module, cfg, batch: int, form: str, top: int = 12) -> dict:
    """The top kernels (operators on the CPU) of layer 0 of `model`, forward + backward, by their own time."""
    from torch.profiler import ProfilerActivity, profile

    from megamemo.kernels.compiler import decoder_layers
    from megamemo.kernels.form_check import _inputs, _run

    layer = decoder_layers(model)[0]
    p = next(layer.parameters())
    device, cuda = p.device, p.device.type == "cuda"
    args, grads = _inputs(layer, cfg, batch, cfg.tgt_len, cfg.mem_len if cfg.has_memory else 0, device, p.dtype)
    for _ in range(2):  # warm: a compile for the layer's own inputs happens here
        _run(layer, args, grads)
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _run(layer, args, grads)
        _sync(device)
    events = [e for e in prof.key_averages() if _device_time(e, cuda) > 0]
    total = sum(_device_time(e, cuda) for e in events)
    events.sort(key=lambda e: -_device_time(e, cuda))
    kernels = [
        {
            "name": e.key[:140],
            "ms": _device_time(e, cuda) / 1e3,
            "calls": e.count,
            "share": _device_time(e, cuda) / total if total else None,
        }
        for e in events[:top]
    ]
    return {
        "form": "profile",
        "of": form,
        "batch": batch,
        "unit": "kernels" if cuda else "CPU operators",
        "total_ms": total / 1e3,
        "kernels": kernels,
    }
