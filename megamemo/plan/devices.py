"""DEVICES, the calibration table `megamemo plan`'s step-time model (steptime.py) reads: one row per device kind,
with its source.

The CPU row is measured on this machine (bench/calibrate_cpu.py: CPU_CALIBRATION); the GPU rows take peak FLOP/s,
memory bandwidth and links from the GPU catalogue (megamemo/runtime/gpus.py: NVIDIA's datasheets), GEMM efficiency
by width from published measurements where they exist and otherwise are stated assumptions (see GPU_EFFICIENCY), and
the host and elementwise figures measured on an H100 host (GPU_LAUNCH, GPU_ELEMENTWISE_BW, GPU_UNALIGNED_SLOWDOWN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megamemo.runtime.gpus import GPUS, PLANNED, Gpu, unknown_kind

ZERO_REDUCE_OLD_PARAMS = 8 * 2048 * 2048  # the one size calibrations before the size axis measured (33.6 M)

# Dense-GEMM efficiency (fraction of the datasheet tensor-core peak) by the narrowest dimension of the GEMM.
# Anchors: cuBLAS large GEMMs reach ~80% of peak on V100 fp16 and A100 bf16 (NVIDIA Deep Learning Performance
# Guide, "Matrix Multiplication Background": throughput falls as a dimension shrinks, tile and wave
# quantization); end to end (GEMMs, elementwise work, communication and bubble together) Narayanan et al. 2021
# (Megatron-LM, SC'21) Table 1 sustain 44-52% of A100 peak at hidden 2304-25600, and the Megatron-LM v1.0 release
# note (NVIDIA ADLR, 2020) 62.4 TFLOP/s = 48% of a DGX-2H V100's peak on a 1.2 B model (hidden 1536; 30% in
# Shoeybi et al. 2019). The points below 1024 are an ASSUMPTION shaped like the guide's curves, not a
# measurement: a GEMM 256 wide keeps about half the SMs' tiles busy, 128 (one head's width) a quarter.
# Host time per kernel of megamemo's eager step (python and module code, the dispatcher, the view ops between
# kernels, autograd's bookkeeping, cudaLaunchKernel): the host, not the GPU, sets it, so one figure for every GPU
# row. Public figures for the parts: the driver's launch alone about 2-4 us a kernel on V100 (NVIDIA Technical Blog,
# A. Gray, "Getting Started with CUDA Graphs", 2019); Python to kernel in eager PyTorch 5-25 us an op (J. Lin, "From
# PyTorch op to kernel launch", GPU kernel serving lesson 18). MEASURED on this workplace's H100 host (torch 2.11,
# 2026-11-26, bench/trace_vs_profile.py): a bare loop of in-place adds 9.7 us an op; megamemo's small
# LaMemo (4 layers, d 256) forward + backward, launch-bound, 18.1 ms of host time at micro-batch 1 and 21.2 ms at 8
# for its 656 / 663 traced kernels: 28-32 us a kernel (wall over traced kernels 24-55 us across lamemo, xl, rpe in
# bf16 and fp32). The figure is that, not the bare loop's: every kernel comes with about one view op and its module's
# python.
GPU_LAUNCH = 30e-6
# Eager PyTorch's elementwise kernels (strided copies, masked fills, reductions, softmax) move their bytes at a
# fraction of the datasheet bandwidth. MEASURED on the H100 (same runs, torch.profiler's kernel times against the
# op trace's bytes at 3.35 TB/s): the non-GEMM kernels took 1.63x (enwik8-base's model, micro-batch 40), 1.60x
# (wt103-base's, 64) and 1.73x / 1.63x (two layers of lamemo-1.3b's, micro-batch 1 / 4) of that (a plain copy
# reaches 3.0 TB/s there: KINDS.md). Assumed the same on the other GPUs.
GPU_ELEMENTWISE_BW = 0.6
# A GEMM whose matrices' leading dimension or offset is not a 16-byte multiple runs on cuBLAS's unaligned kernels
# (LaMemo's position products: klen + 1 columns, odd; any dimension like wt103's 410, 41, 2100, 267,735). MEASURED
# on the H100: 4.1x the aligned prediction for enwik8's 69 position products (33.6 against 8.2 ms), 4.3x for
# wt103's GEMMs (all unaligned), 4.5x for the 1.3b layers' 9; the aligned ones took 0.90-0.91x the prediction.
# Assumed the same on the other GPUs.
GPU_UNALIGNED_SLOWDOWN = 4.0
GPU_EFFICIENCY = ((64, 0.12), (128, 0.25), (256, 0.42), (512, 0.58), (1024, 0.68), (2048, 0.75), (4096, 0.8))


def log_interpolate(points, x: float) -> float:
    """y at x > points[0]'s x on the line through ((x, y), ...) sorted by x, linear in log(x) between two points;
    the last point's y past it."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


def nearest_group(measured: dict, group: int) -> int:
    """The measured group size closest to `group` (ties: the larger)."""
    return min(measured, key=lambda s: (abs(s - group), -s))


@dataclass(frozen=True)
class Device:
    kind: str
    peak: dict  # dtype -> FLOP/s per device
    efficiency: tuple  # ((narrowest GEMM dimension, fraction of peak), ...), log-interpolated
    mem_bw: float  # bytes/s
    link: tuple  # (inside a node, between nodes) bytes/s per device
    latency: tuple  # (inside a node, between nodes) seconds per collective
    source: str
    allreduce: dict = field(default_factory=dict)  # measured {group size: (latency s, bytes/s)}; else link
    allgather: dict = field(default_factory=dict)  # the same for all-gather
    p2p: tuple | None = None  # measured (latency s, bytes/s) of a send; else link
    optimizer_s_per_param: float | None = None  # measured; else ADAM_BYTES_PER_PARAM / mem_bw
    first_touch_bw: float | None = None  # bytes/s of faulting fresh pages in (CPU)
    layer_overhead: float = 0.0  # CPU: host time a layer's forward + backward takes whatever its size (python,
    # autograd, the ops' own dispatch), measured, added to its compute
    launch: float | None = None  # GPU: host seconds per kernel launched (opcost.py simulates the launch queue)
    elementwise_bw: float = 1.0  # the fraction of mem_bw elementwise kernels move their bytes at
    unaligned: float = 1.0  # how many times slower a GEMM on unaligned matrices runs
    contention: tuple = ()  # CPU: ((width, rate alone / rate with `ranks` busy), ...) measured
    ranks: int = 1  # CPU: the processes the contention was measured with
    # CPU: FLOP/s of one rank's share of a layer's dense projections measured at the layer's own shapes
    # {(tp, rows): FLOP/s} for layers of `layer_shape` (d_model, heads x d_head, d_inner); used instead of the
    # width table where the layout's (tp, rows) was measured
    layer_gemm: dict = field(default_factory=dict)
    layer_shape: tuple = ()
    # CPU: DeepSpeed's ZeRO 1/2 work around a step, measured (bench/calibrate_cpu.py): seconds per parameter the
    # rank holds (the gradients flattened into the bucket and partition, averaged, copied back) and per
    # parameter it owns (norm, clipping, Adam, the master copied back); replaces optimizer + first_touch
    zero_step: tuple | None = None
    # CPU: DeepSpeed's ZeRO 1 gradient reduction beyond its all-reduce in a group of dp processes, by the
    # parameters a rank holds: {dp: ((params held, s per parameter held), ...)} (bench/calibrate_cpu.py: at dp 4
    # 2x the dp-1 figure at 54.5 M, 2-4x at 109 M); replaces zero_step's held at dp > 1
    zero_reduce: dict = field(default_factory=dict)

    def layer_rate(self, m, tp: int, rows: int) -> float | None:
        """The measured FLOP/s of a layer's projections at this tp and row count, if this layer shape was."""
        if self.layer_shape != (m.d_model, m.n_head * m.d_head, m.d_inner):
            return None
        return self.layer_gemm.get((tp, rows))

    def reduce_rate(self, dp: int, params: float) -> float | None:
        """Seconds per parameter held of the ZeRO reduction's own work (zero_reduce) at the nearest measured
        group size, interpolated in log(parameters) between the sizes measured there, the end figure outside."""
        if not self.zero_reduce:
            return None
        pts = sorted(self.zero_reduce[nearest_group(self.zero_reduce, dp)])
        return log_interpolate(pts, params) if params > pts[0][0] else pts[0][1]

    def share(self, width: float, ranks: int) -> float:
        """How many times slower a rank computes while all `ranks` on its node do (1: a device of its own)."""
        if not self.contention:
            return 1.0
        pts = self.contention
        ratio = min(pts, key=lambda p: abs(math.log2(p[0] / width)))[1]
        return max(1.0, ratio * ranks / self.ranks)

    def eff(self, width: float) -> float:
        pts = self.efficiency
        if width <= pts[0][0]:
            return pts[0][1] * width / pts[0][0]
        return log_interpolate(pts, width)

    def collective(self, group: int, nbytes: float, across_nodes: bool, gather: bool = False) -> float:
        """Seconds of one all-reduce of nbytes (2 (n-1)/n of them cross a link) or all-gather of an nbytes result
        ((n-1)/n) over `group` ranks."""
        if group <= 1:
            return 0.0
        factor = (1 if gather else 2) * (group - 1) / group
        measured = self.allgather if gather else self.allreduce
        if measured:
            lat, bw = measured[nearest_group(measured, group)]
        else:
            lat, bw = self.latency[across_nodes], self.link[across_nodes]
        return lat + factor * nbytes / bw

    def send(self, nbytes: float, across_nodes: bool) -> float:
        if self.p2p:
            return self.p2p[0] + nbytes / self.p2p[1]
        return self.latency[across_nodes] + nbytes / self.link[across_nodes]


def _gpu(kind: str, g: Gpu) -> Device:
    link = g.link
    if g.mem_bw is None or link is None:
        raise ValueError(f"runtime/gpus.py {kind}: a planned GPU needs its mem_bw and link figures")
    return Device(
        kind,
        {k: v * 1e12 for k, v in g.peak_tflops.items()},
        GPU_EFFICIENCY,
        g.mem_bw,
        tuple(x * 1e9 for x in link),
        (15e-6, 30e-6),
        f"{g.row} datasheet peak and memory bandwidth; link {link[0]:g} / {link[1]:g} GB/s per device "
        f"(inside / between nodes: {g.fabric}); GEMM efficiency by width: GPU_EFFICIENCY (published anchors, "
        f"assumed shape); NCCL latency 15 / 30 us, {GPU_LAUNCH * 1e6:g} us of host time a kernel "
        f"(GPU_LAUNCH, measured on an H100 host); elementwise kernels at {GPU_ELEMENTWISE_BW:g} of the "
        f"bandwidth, unaligned GEMMs {GPU_UNALIGNED_SLOWDOWN:g}x slower (measured on an H100)",
        launch=GPU_LAUNCH,
        elementwise_bw=GPU_ELEMENTWISE_BW,
        unaligned=GPU_UNALIGNED_SLOWDOWN,
    )


# CPU: measured on this machine (2 cores, AVX512, torch 2.13, one thread per process, fp32) by
# `bench/calibrate_cpu.py` within bench/plan_vs_step.py on 2026-11-25 at 13:30 and 13:39 UTC under the shared-machine
# lock (runs/plan_vs_step_25b and _25c calibration.json, load average 1.4-1.5 at their starts), the mean of the two:
# calibrations minutes apart differ by up to 25% (the layer's rate at 64 rows 39.6 and 46.9 GFLOP/s, ZeRO's
# 5.3 / 6.1 and 3.8 / 5.2 ns), which moves every prediction with them (README, "Scale rehearsal"). zero_reduce_ns:
# calibrate_cpu.zero_step_seconds_per_param at 13 and 26 weights, the mean of the measurements of 19:31-19:36 UTC
# (alone on the machine, load average 1.9-4.5; dp 4 at 26 weights twice) and of runs/plan_vs_step_f (19:48).
CPU_CALIBRATION = {
    "gemm": {32: 46.5, 64: 60.3, 128: 76.9, 256: 75.1, 512: 84.0, 1024: 82.9},  # GFLOP/s by min(T, n)
    "adam_ns": 0.88,  # torch's fused Adam step (optim.fused), per parameter
    "allreduce": {2: (2.93e-3, 1.42e9), 4: (5.54e-3, 0.95e9)},  # (latency s, bytes/s), bytes 2 (n-1)/n
    "allgather": {2: (0.06e-3, 0.42e9), 4: (2.29e-3, 0.36e9)},  # bytes (n-1)/n of the gathered tensor
    "p2p": (0.13e-3, 2.91e9),
    "fresh_page_gbs": 2.30,  # allocate and fill
    "mem_gbs": 19.2,  # a fill of a reused 1 GiB tensor
    "ranks": 4,
    "cores": 2,
    "layer_overhead_ms": 1.79,
    # the rehearsal's (= lamemo-1.3b's) layer: its projections' GFLOP/s by "tp x rows" (calibrate_cpu.LAYER_POINTS)
    "layer_shape": (2048, 2048, 8192),
    "layer_gemm": {
        "1x64": 43.2,
        "1x128": 54.8,
        "1x256": 63.4,
        "2x64": 49.2,
        "2x128": 64.6,
        "2x256": 70.9,
        "4x64": 65.2,
        "4x128": 72.6,
        "4x256": 70.8,
    },
    "zero_ns": (4.56, 5.65),  # DeepSpeed ZeRO 1 per parameter held, per parameter owned
    # its reduction beyond the all-reduce in dp processes at once, ns per parameter held, by parameters held
    "zero_reduce_ns": {2: {54_525_952: 6.08, 109_051_904: 4.92}, 4: {54_525_952: 9.75, 109_051_904: 11.86}},
}


def cpu_device(cal: dict) -> Device:
    """The "cpu" row from a calibration (bench/calibrate_cpu.py's JSON line; CPU_CALIBRATION)."""
    gemm = sorted((int(w), float(r) * 1e9) for w, r in cal["gemm"].items())
    peak = max(r for _, r in gemm)
    ar = {int(k): tuple(v) for k, v in cal["allreduce"].items()}
    # how much slower a rank computes while all `ranks` do: measured (--concurrent), else ranks / cores
    shared = {int(w): float(r) * 1e9 for w, r in cal.get("gemm_shared", {}).items()}
    nominal = cal["ranks"] / cal["cores"]
    return Device(
        "cpu",
        {"fp32": peak},
        tuple((w, r / peak) for w, r in gemm),
        mem_bw=cal["mem_gbs"] * 1e9,
        link=(ar[2][1],) * 2,
        latency=(ar[2][0],) * 2,
        source="measured on this machine by bench/calibrate_cpu.py (one thread per process; peak = the "
        "fastest measured GEMM rate, so MFU is against that, not a datasheet)",
        allreduce=ar,
        allgather={int(k): tuple(v) for k, v in cal["allgather"].items()},
        p2p=tuple(cal["p2p"]),
        optimizer_s_per_param=cal["adam_ns"] * 1e-9,
        first_touch_bw=cal["fresh_page_gbs"] * 1e9,
        contention=tuple((w, r / shared[w] if w in shared else nominal) for w, r in gemm),
        ranks=cal["ranks"],
        layer_overhead=cal.get("layer_overhead_ms", 0.0) * 1e-3,
        layer_gemm={tuple(int(x) for x in k.split("x")): float(r) * 1e9 for k, r in cal.get("layer_gemm", {}).items()},
        layer_shape=tuple(cal.get("layer_shape", ())),
        zero_step=tuple(x * 1e-9 for x in cal["zero_ns"]) if "zero_ns" in cal else None,
        zero_reduce={int(dp): _sizes(x) for dp, x in cal.get("zero_reduce_ns", {}).items()},
    )


def _sizes(ns) -> tuple:
    """zero_reduce_ns of one group size: {parameters held: ns per parameter} -> ((params, s), ...); a single
    figure (calibrations before the size axis) was measured at ZERO_REDUCE_OLD_PARAMS."""
    if isinstance(ns, dict):
        return tuple(sorted((int(n), float(x) * 1e-9) for n, x in ns.items()))
    return ((ZERO_REDUCE_OLD_PARAMS, float(ns) * 1e-9),)


CPU = cpu_device(CPU_CALIBRATION)
DEVICES = {**{kind: _gpu(kind, GPUS[kind]) for kind in PLANNED}, "cpu": CPU}


def device(kind: str) -> Device:
    if kind not in DEVICES:
        raise unknown_kind(kind, DEVICES)
    return DEVICES[kind]
