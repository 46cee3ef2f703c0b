"""Prices an op trace (optrace.py) on a device (devices.py): what one micro-batch of a pipeline stage costs a rank.

  GEMM          its FLOPs at the dtype's peak x efficiency(the narrower of its output's rows and columns: the
                GEMM efficiency table, tile occupancy), or its operands' and result's bytes at memory bandwidth,
                whichever is slower (a product with a short inner dimension - attention's d_head - is memory-bound);
                A GEMM on matrices whose leading dimension or offset is not a 16-byte multiple takes
                Device.unaligned times as long (cuBLAS's unaligned kernels);
  other ops     their bytes read and written at Device.elementwise_bw x the memory bandwidth;
  launches      the host issues kernels one after another, each `Device.launch` seconds (eager PyTorch: python,
                dispatcher, autograd, the driver); the device runs each as soon as it is issued and the one before
                it is done. A micro-batch whose kernels are shorter than their launches waits on the host: the
                exposed launch time is the simulated wall time less the kernels' own time. Micro-batches follow each
                other without a host sync (none in a step before the optimizer), so a device-bound micro-batch lets
                the host run ahead into the next.

A device without a launch figure (the CPU: its host is its device) is not priced here: steptime.py keeps its measured
rates and per-layer overhead and takes only the trace's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megamemo.plan.devices import Device
from megamemo.plan.optrace import Segment


@dataclass(frozen=True)
class Cost:
    """Seconds of one segment's kernels on a device, op by op."""

    gemm: np.ndarray  # the GEMMs' time (0 for other ops)
    other: np.ndarray  # the other ops' time (0 for GEMMs)
    host: np.ndarray  # launch time on the host

    @property
    def device(self) -> np.ndarray:
        return self.gemm + self.other


def gemm_peak(dev: Device, dtype: str, fp32: bool, allow_tf32: bool = False) -> float:
    """FLOP/s a GEMM runs at: the run's dtype, or for fp32 operands fp32 (TF32 where allowed and the device has it)."""
    if not fp32 or dtype == "fp32":
        key = "tf32" if dtype == "fp32" and allow_tf32 and "tf32" in dev.peak else dtype
        return dev.peak[key]
    return dev.peak["tf32" if allow_tf32 and "tf32" in dev.peak else "fp32"]


def price(seg: Segment, dev: Device, dtype: str, allow_tf32: bool = False) -> Cost:
    """Each op's device seconds and launch seconds on dev (see the module docstring)."""
    by_bw = seg.bytes / dev.mem_bw
    gemm = np.zeros(len(seg.names))
    for i in np.flatnonzero(seg.gemm):
        width = min(seg.rows[i], seg.cols[i])
        rate = gemm_peak(dev, dtype, bool(seg.fp32[i]), allow_tf32) * dev.eff(width)
        gemm[i] = max(seg.flops[i] / rate, by_bw[i]) * (1.0 if seg.aligned[i] else dev.unaligned)
    other = np.where(seg.gemm, 0.0, by_bw / dev.elementwise_bw)
    return Cost(gemm, other, seg.launches * (dev.launch or 0.0))


def price_at(seg: Segment, rate: float, mem_bw: float) -> Cost:
    """seg's GEMMs at `rate` FLOP/s, its other ops' bytes at mem_bw, no launches (a device measured as a whole
    layer's rate: the CPU)."""
    return Cost(
        np.where(seg.gemm, seg.flops / rate, 0.0), np.where(seg.gemm, 0.0, seg.bytes / mem_bw), np.zeros(len(seg.names))
    )


def run(cost: Cost, lag: float = 0.0) -> tuple[float, float]:
    """(wall seconds from the host's first launch to the device's last kernel end, the device's lag behind the
    host then) of kernels issued back to back, the device still busy for `lag` seconds when the first is issued.
    Kernel i starts at max(its issue time, the previous kernel's end): the last ends at
    max(lag + all kernels, max over i of (issue time of i + kernels i..n))."""
    if not len(cost.host):
        return lag, lag
    issued = np.cumsum(cost.host)
    rest = np.cumsum(cost.device[::-1])[::-1]
    end = max(lag + rest[0], float((issued + rest).max()))
    return end, end - issued[-1]


def micro_batches(cost: Cost, n: int, chained: bool = True) -> float:
    """Wall seconds of n micro-batches of `cost` back to back; chained: without a host sync between them (the host
    runs ahead into the next), else each from an idle queue (a pipeline stage waits on its neighbours)."""
    if not chained:
        return n * run(cost)[0]
    lag = 0.0
    for _ in range(n):
        end, lag = run(cost, lag)
    return (n - 1) * float(cost.host.sum()) + end


def concat(costs) -> Cost:
    costs = list(costs)
    return Cost(*(np.concatenate([getattr(c, k) for c in costs]) for k in ("gemm", "other", "host")))


@dataclass(frozen=True)
class Part:
    """One part of a stage's micro-batch (forward + backward) for `megamemo plan --explain`."""

    name: str
    repeat: int  # how many times the stage runs it (the lower layers: layers - 1 on the last stage)
    gemm_s: float  # each
    other_s: float
    kernels: float
    bytes: float
    flops: float
    top_ops: tuple  # ((aten op, seconds), ...) the largest non-GEMM ops by time


def parts(ops, layers: int, first: bool, last: bool, recompute: bool, price_fn) -> list[Part]:
    """The stage's parts (input side, lower layer, top layer, output side), each forward + backward with its memory
    update (optrace.Trace.stage), priced by price_fn(Segment) -> Cost."""
    lower = layers - 1 if last else layers
    out = []
    for part, n in (("input", int(first)), ("layer", lower), ("top", int(last)), ("output", int(last))):
        if not n:
            continue
        update = ops.memory_per_layer == (part in ("layer", "top")) and part != "output"
        segs = ([ops.segments["fwd", part]] if recompute and part in ("layer", "top") else []) + [
            ops.segments["fwd", part],
            *([ops.segments["fwd", "memory"]] if update else []),
            ops.segments["bwd", part],
        ]
        seg = type(segs[0]).concat(segs)
        cost = price_fn(seg)
        by_op: dict[str, float] = {}
        for name, s in zip(seg.names, cost.other, strict=True):
            by_op[name] = by_op.get(name, 0.0) + float(s)
        top = tuple(sorted(by_op.items(), key=lambda kv: -kv[1])[:4])
        out.append(
            Part(
                part,
                n,
                float(cost.gemm.sum()),
                float(cost.other.sum()),
                float(seg.launches.sum()),
                float(seg.bytes.sum()),
                float(seg.flops.sum()),
                top,
            )
        )
    return out
