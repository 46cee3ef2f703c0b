"""Predicted time of one training step for a layout (tp, pp, dp, ZeRO stage, micro-batch x grad_accum), beside
layouts.py's memory: what `megamemo plan` ranks layouts by (tokens/s per device) and what `--explain` prints.

Terms, per rank of the slowest pipeline stage (every term below is exposed: nothing overlaps unless it says so):
  compute       model FLOPs (model/flops.py) of the rank's share - its stage's layers (+ the output layer on the
                last stage) over tp - at peak x efficiency(GEMM width); the width is the narrowest dimension of a
                layer's dense GEMMs on the rank: min(d_model, heads x d_head / tp, d_inner / tp, rows x micro-batch).
                Where the device measured this layer shape's projections at the layout's tp and rows (the CPU:
                Device.layer_gemm, bench/calibrate_cpu.py's layer_gemm_rate), that rate replaces peak x efficiency:
                a width alone misses what a layer's 16-64 MiB weights cost a CPU core against narrow cached ones
                (measured here: 45 against 79 GFLOP/s at 64 rows).
  elementwise   softmax, norms, activations, dropout: ELEMENTWISE_PASSES passes over the activation bytes layouts.py
                counts for one micro-batch, at the device's memory bandwidth.
  tp_comm       per layer and micro-batch 4 all-reduces of the [rows, B, d_model] activations (2 forward, 2
                backward; bench/comm.py) + TP_EXTRA_ALLREDUCES for the vocab-parallel embedding and cross-entropy,
                each latency + 2 (tp-1)/tp bytes / bandwidth, on the critical path.
  pp_bubble     1F1B over p stages and m = grad_accum micro-batches: the step takes (m + p - 1) micro-batch slots,
                p - 1 of them idle: the bubble (p-1)/(m+p-1). On a CPU whose ranks share its cores, a rank
                computes `share` times slower while all compute (Device.contention: ranks / cores unless
                measured) and an idle stage's core serves the others: the step is max((m+p-1) t_alone, m t_shared).
  pp_p2p        per micro-batch slot, the activations and memory rows forward and their gradient back; and
                DeepSpeed's all-reduce of the tied embedding's gradient between the first and last stage.
  overhead      host time per layer and micro-batch (kernel launches, autograd, python): Device.layer_overhead,
                exposed on a GPU only where it exceeds the layer's kernels, added on a CPU.
  dp_comm       the gradient reduction over dp: DeepSpeed's ZeRO 0/1/2 all-reduce whole buckets (stage_1_and_2.py,
                use_multi_rank_bucket_allreduce), 2 (dp-1)/dp bytes, once per step at the accumulation boundary
                (ZeRO 2: every micro-batch). DeepSpeed overlaps it with the backward pass, bucket by bucket
                (reduce_bucket_size), only with zero_optimization.overlap_comm, whose default is off below ZeRO 3
                and which megamemo's DeepSpeed config does not set (train/engine.py), and never under its pipeline
                engine (ReduceGrads after the last backward): exposed. `overlap_hides` says what it would hide.
  zero_gather   ZeRO 1/2's extra collective: the updated parameters all-gathered after the optimizer step.
  On a CPU whose ranks share its cores, every collective (TP, DP, ZeRO's gather, p2p) is CPU work as well:
                measured in a group of g processes (sharing the cores max(1, g / cores) ways), it runs while all
                the node's ranks run theirs, so it takes share(node ranks) / share(g) times its measured time
                (TP2 x DP2 on 2 cores: two dp=2 groups reduce at once, 2x the 2-process measurement; DP4: 1x).
  reduce_copies the gradient reduction's own work beyond the all-reduce (reduce_copies_seconds): DeepSpeed's ZeRO
                1/2 copy the gradients into the bucket, average them and, at dp > 1, flatten the bucket's slices by
                owning rank into a fresh tensor and copy the rank's own back into its partition; once a step (ZeRO
                2: every micro-batch). Measured per parameter held at dp 1, 2 and 4 on the CPU (Device.zero_step,
                Device.zero_reduce: it grows with dp, 2x at dp 4); DP_REDUCE_BYTES at memory bandwidth on a GPU.
  optimizer     Adam over the rank's partition (ZeRO 1/2: 1/dp of its parameters), and DeepSpeed's passes around
                it at memory bandwidth (ZERO_STEP_BYTES_OWNED).
  first_touch   CPU only: the gradients (ZeRO's flat fp32 partition, the flattened all-reduce bucket) are new
                allocations every step, above glibc's mmap threshold, so their pages are faulted in again.
                Where DeepSpeed's ZeRO work around a step was measured (the CPU: Device.zero_step, one process of
                its ZeRO 1 engine as train/engine.py builds it), optimizer = owned x parameters it owns and
                reduce_copies as above, first touch included; GPUs keep the byte model above (no measurement:
                ADAM_BYTES_PER_PARAM, ZERO_STEP_BYTES_OWNED, DP_REDUCE_BYTES).
Pipeline-stage and DP communication between nodes use the inter-node link when the group spans nodes (TP groups
stay inside a node: recommend.why_not).

DEVICES is the calibration table, one row per device kind, with its source. The CPU row is measured on this
machine (bench/calibrate_cpu.py); the GPU rows take peak FLOP/s and memory bandwidth from NVIDIA's datasheets
(megamemo/runtime/peak.py), GEMM efficiency by width from published measurements where they exist and otherwise are
stated assumptions (see GPU_EFFICIENCY), never measured here: no GPU was available to this work.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megamemo.model.flops import forward_flops, step_flops
from megamemo.runtime.peak import PEAK_TFLOPS
from megamemo.util.precision import element_bytes

ELEMENTWISE_PASSES = 4      # activation bytes: written forward, read backward, their gradient written and read
TP_EXTRA_ALLREDUCES = 3     # per micro-batch: vocab-parallel embedding (fwd) and cross-entropy (max, sum)
DS_REDUCE_BUCKET = 500_000_000      # DeepSpeed's reduce_bucket_size / allgather_bucket_size defaults (elements)
ADAM_BYTES_PER_PARAM = 36   # GPU Adam: grad read, fp32 master, m, v read + written, model copy written (fused)
# DeepSpeed's optimizer step around Adam, per parameter the rank owns (fp32): the gradient flattened into the
# partition (read + write), its norm (read), clipping (read + write), the updated master copied to the weights
# (read + write); and under dp > 1, per parameter it holds (reduce_copies_seconds): the gradient copied into the
# bucket, averaged, flattened for the all-reduce (a fresh tensor) and copied back (read + write each)
ZERO_STEP_BYTES_OWNED, DP_REDUCE_BYTES = 28, 32

# Dense-GEMM efficiency (fraction of the datasheet tensor-core peak) by the narrowest dimension of the GEMM.
# Anchors: cuBLAS large GEMMs reach ~80% of peak on V100 fp16 and A100 bf16 (NVIDIA Deep Learning Performance
# Guide, "Matrix Multiplication Background": throughput falls as a dimension shrinks, tile and wave
# quantization); end to end (GEMMs, elementwise work, communication and bubble together) Narayanan et al. 2021
# (Megatron-LM, SC'21) Table 1 sustain 44-52% of A100 peak at hidden 2304-25600, and the Megatron-LM v1.0 release
# note (NVIDIA ADLR, 2020) 62.4 TFLOP/s = 48% of a DGX-2H V100's peak on a 1.2 B model (hidden 1536; 30% in
# Shoeybi et al. 2019). The points below 1024 are an ASSUMPTION shaped like the guide's curves, not a
# measurement: a GEMM 256 wide keeps about half the SMs' tiles busy, 128 (one head's width) a quarter.
# ASSUMPTION: a LaMemo layer's forward + backward launches ~100 kernels (unfused attention with its shifts, norms,
# dropout, activations) at ~5 us each: a micro-batch whose layer computes in less is launch-bound
GPU_LAYER_OVERHEAD = 0.5e-3
GPU_EFFICIENCY = ((64, 0.12), (128, 0.25), (256, 0.42), (512, 0.58), (1024, 0.68), (2048, 0.75), (4096, 0.8))


@dataclass(frozen=True)
class Device:
    kind: str
    peak: dict                  # dtype -> FLOP/s per device
    efficiency: tuple           # ((narrowest GEMM dimension, fraction of peak), ...), log-interpolated
    mem_bw: float               # bytes/s
    link: tuple                 # (inside a node, between nodes) bytes/s per device
    latency: tuple              # (inside a node, between nodes) seconds per collective
    source: str
    allreduce: dict = field(default_factory=dict)   # measured {group size: (latency s, bytes/s)}; else link
    allgather: dict = field(default_factory=dict)   # the same for all-gather
    p2p: tuple | None = None    # measured (latency s, bytes/s) of a send; else link
    optimizer_s_per_param: float | None = None      # measured; else ADAM_BYTES_PER_PARAM / mem_bw
    first_touch_bw: float | None = None             # bytes/s of faulting fresh pages in (CPU)
    layer_overhead: float = 0.0     # host time a layer's forward + backward takes whatever its size (launches,
                                    # autograd, python): GPU hides it behind longer kernels, a CPU adds it
    contention: tuple = ()      # CPU: ((width, rate alone / rate with `ranks` busy), ...) measured
    ranks: int = 1              # CPU: the processes the contention was measured with
    # CPU: FLOP/s of one rank's share of a layer's dense projections measured at the layer's own shapes
    # {(tp, rows): FLOP/s} for layers of `layer_shape` (d_model, heads x d_head, d_inner); used instead of the
    # width table where the layout's (tp, rows) was measured
    layer_gemm: dict = field(default_factory=dict)
    layer_shape: tuple = ()
    # CPU: DeepSpeed's ZeRO 1/2 work around a step, measured (bench/calibrate_cpu.py): seconds per parameter the
    # rank holds (the gradients flattened into the bucket and partition, averaged, copied back) and per
    # parameter it owns (norm, clipping, Adam, the master copied back); replaces optimizer + first_touch
    zero_step: tuple | None = None
    # CPU: DeepSpeed's ZeRO 1 gradient reduction beyond its all-reduce in a group of dp processes {dp: s per
    # parameter held} (bench/calibrate_cpu.py; 2x the dp-1 figure at dp 4); replaces zero_step's held at dp > 1
    zero_reduce: dict = field(default_factory=dict)

    def layer_rate(self, m, tp: int, rows: int) -> float | None:
        """The measured FLOP/s of a layer's projections at this tp and row count, if this layer shape was."""
        if self.layer_shape != (m.d_model, m.n_head * m.d_head, m.d_inner):
            return None
        return self.layer_gemm.get((tp, rows))

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
        for (w0, e0), (w1, e1) in zip(pts, pts[1:]):
            if width <= w1:
                return e0 + (e1 - e0) * math.log2(width / w0) / math.log2(w1 / w0)
        return pts[-1][1]

    def collective(self, group: int, nbytes: float, across_nodes: bool, gather: bool = False) -> float:
        """Seconds of one all-reduce of nbytes (2 (n-1)/n of them cross a link) or all-gather of an nbytes result
        ((n-1)/n) over `group` ranks."""
        if group <= 1:
            return 0.0
        factor = (1 if gather else 2) * (group - 1) / group
        measured = self.allgather if gather else self.allreduce
        if measured:
            lat, bw = measured[_nearest(measured, group)]
        else:
            lat, bw = self.latency[across_nodes], self.link[across_nodes]
        return lat + factor * nbytes / bw

    def send(self, nbytes: float, across_nodes: bool) -> float:
        if self.p2p:
            return self.p2p[0] + nbytes / self.p2p[1]
        return self.latency[across_nodes] + nbytes / self.link[across_nodes]


def _gpu(kind, row, mem_bw, link, note):
    return Device(kind, {k: v * 1e12 for k, v in PEAK_TFLOPS[row].items()}, GPU_EFFICIENCY, mem_bw,
                  tuple(x * 1e9 for x in link), (15e-6, 30e-6),
                  f"{row} datasheet peak and memory bandwidth; link {link[0]:g} / {link[1]:g} GB/s per device "
                  f"(inside / between nodes: {note}); GEMM efficiency by width: GPU_EFFICIENCY (published anchors, "
                  f"assumed shape); NCCL latency 15 / 30 us, {GPU_LAYER_OVERHEAD * 1e3:g} ms of launches a layer "
                  f"(assumed)", layer_overhead=GPU_LAYER_OVERHEAD)


# CPU: measured on this machine (2 cores, AVX512, torch 2.13, one thread per process, fp32) by
# `bench/calibrate_cpu.py` within bench/plan_vs_step.py on 2026-11-25 at 13:30 and 13:39 UTC under the shared-machine
# lock (runs/plan_vs_step_25b and _25c calibration.json, load average 1.4-1.5 at their starts), the mean of the two:
# calibrations minutes apart differ by up to 25% (the layer's rate at 64 rows 39.6 and 46.9 GFLOP/s, ZeRO's
# 5.3 / 6.1 and 3.8 / 5.2 ns), which moves every prediction with them (README, "Scale rehearsal"). zero_reduce_ns:
# dp 2 from runs/plan_vs_step_25d (14:12), dp 4 the mean of that run's 10.35 and 9.34 at 13:56 UTC.
CPU_CALIBRATION = {
    "gemm": {32: 46.5, 64: 60.3, 128: 76.9, 256: 75.1, 512: 84.0, 1024: 82.9},   # GFLOP/s by min(T, n)
    "adam_ns": 0.88,                                  # torch's fused Adam step (optim.fused), per parameter
    "allreduce": {2: (2.93e-3, 1.42e9), 4: (5.54e-3, 0.95e9)},   # (latency s, bytes/s), bytes 2 (n-1)/n
    "allgather": {2: (0.06e-3, 0.42e9), 4: (2.29e-3, 0.36e9)},   # bytes (n-1)/n of the gathered tensor
    "p2p": (0.13e-3, 2.91e9),
    "fresh_page_gbs": 2.30,                           # allocate and fill
    "mem_gbs": 19.2,                                  # a fill of a reused 1 GiB tensor
    "ranks": 4, "cores": 2, "layer_overhead_ms": 1.79,
    # the rehearsal's (= lamemo-1.3b's) layer: its projections' GFLOP/s by "tp x rows" (calibrate_cpu.LAYER_POINTS)
    "layer_shape": (2048, 2048, 8192),
    "layer_gemm": {"1x64": 43.2, "1x128": 54.8, "1x256": 63.4, "2x64": 49.2, "2x128": 64.6, "2x256": 70.9,
                   "4x64": 65.2, "4x128": 72.6, "4x256": 70.8},
    "zero_ns": (4.56, 5.65),                          # DeepSpeed ZeRO 1 per parameter held, per parameter owned
    "zero_reduce_ns": {2: 6.73, 4: 9.85},   # its reduction beyond the all-reduce in dp processes at once, per held
}


def cpu_device(cal: dict) -> Device:
    """The "cpu" row from a calibration (bench/calibrate_cpu.py's JSON line; CPU_CALIBRATION)."""
    gemm = sorted((int(w), float(r) * 1e9) for w, r in cal["gemm"].items())
    peak = max(r for _, r in gemm)
    ar = {int(k): tuple(v) for k, v in cal["allreduce"].items()}
    # how much slower a rank computes while all `ranks` do: measured (--concurrent), else ranks / cores
    shared = {int(w): float(r) * 1e9 for w, r in cal.get("gemm_shared", {}).items()}
    nominal = cal["ranks"] / cal["cores"]
    return Device("cpu", {"fp32": peak}, tuple((w, r / peak) for w, r in gemm), mem_bw=cal["mem_gbs"] * 1e9,
                  link=(ar[2][1],) * 2, latency=(ar[2][0],) * 2,
                  source="measured on this machine by bench/calibrate_cpu.py (one thread per process; peak = the "
                         "fastest measured GEMM rate, so MFU is against that, not a datasheet)",
                  allreduce=ar, allgather={int(k): tuple(v) for k, v in cal["allgather"].items()},
                  p2p=tuple(cal["p2p"]), optimizer_s_per_param=cal["adam_ns"] * 1e-9,
                  first_touch_bw=cal["fresh_page_gbs"] * 1e9,
                  contention=tuple((w, r / shared[w] if w in shared else nominal) for w, r in gemm),
                  ranks=cal["ranks"],
                  layer_overhead=cal.get("layer_overhead_ms", 0.0) * 1e-3,
                  layer_gemm={tuple(int(x) for x in k.split("x")): float(r) * 1e9
                              for k, r in cal.get("layer_gemm", {}).items()},
                  layer_shape=tuple(cal.get("layer_shape", ())),
                  zero_step=tuple(x * 1e-9 for x in cal["zero_ns"]) if "zero_ns" in cal else None,
                  zero_reduce={int(dp): x * 1e-9 for dp, x in cal.get("zero_reduce_ns", {}).items()})


CPU = cpu_device(CPU_CALIBRATION)
DEVICES = {
    "v100-16g": _gpu("v100-16g", "V100 SXM2", 900e9, (130, 12.5), "NVLink 2 hybrid cube mesh, 100 Gb/s IB"),
    "v100-32g": _gpu("v100-32g", "V100 SXM2", 900e9, (130, 12.5), "NVLink 2 hybrid cube mesh, 100 Gb/s IB"),
    "a100-40g": _gpu("a100-40g", "A100", 1555e9, (230, 25), "NVSwitch, 200 Gb/s HDR IB"),
    "a100-80g": _gpu("a100-80g", "A100", 2039e9, (230, 25), "NVSwitch, 200 Gb/s HDR IB"),
    "h100-80g": _gpu("h100-80g", "H100 SXM", 3350e9, (370, 50), "NVSwitch, 400 Gb/s NDR IB"),
    "cpu": CPU,
}


@dataclass
class StepTime:
    layout: str
    terms: dict                 # name -> seconds per step (exposed)
    tokens: int                 # target tokens per step, all ranks
    world: int
    model_flops: float          # per step, all ranks
    peak: float                 # per device FLOP/s
    width: float                # the narrowest dense-GEMM dimension on a rank
    efficiency: float
    overlap_hides: float = 0.0  # of dp_comm, what ZeRO 1/2's overlap_comm would hide (GPU, no pipeline)

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.world * self.peak)

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def device(kind: str) -> Device:
    if kind not in DEVICES:
        import difflib
        near = difflib.get_close_matches(kind, DEVICES, n=1)
        raise ValueError(f"unknown device kind {kind!r}" + (f" (did you mean {near[0]}?)" if near else "")
                         + f"; known: {', '.join(DEVICES)}")
    return DEVICES[kind]


def layer_and_rest_flops(m, micro: int) -> tuple[float, float]:
    """Forward FLOPs of one layer and of the rest (output layer, projections) for a micro-batch, from flops.py:
    f(n) = n per_layer + rest, so per_layer = f(2) - f(1) and rest = f(1) - per_layer."""
    f1 = forward_flops(dataclasses.replace(m, n_layer=1), micro)
    f2 = forward_flops(dataclasses.replace(m, n_layer=2), micro)
    return f2 - f1, 2 * f1 - f2


def _nearest(measured: dict, group: int) -> int:
    """The measured group size closest to `group` (ties: the larger)."""
    return min(measured, key=lambda s: (abs(s - group), -s))


def reduce_copies_seconds(dev: Device, params: float, dp: int, zero: int) -> float:
    """One gradient reduction's work beyond its collective for a rank holding `params` parameters, on a device of
    its own (step_time scales it for shared cores). DeepSpeed's ZeRO 1/2 (stage_1_and_2.py; megamemo's config:
    reduce_scatter and use_multi_rank_bucket_allreduce on, overlap_comm off) copies each gradient into the bucket,
    averages it and at dp > 1 flattens the bucket's slices by owning rank into a fresh tensor for the all-reduce
    (average_tensor -> allreduce_and_scatter), then copies the rank's own back into its partition. Measured at
    dp's group size (Device.zero_reduce) or dp 1 (Device.zero_step) where it was; else DP_REDUCE_BYTES per
    parameter held at dp > 1 at memory bandwidth (ZeRO 0's engine flattens and copies back too), 0 at dp 1."""
    if dev.zero_step and zero >= 1:
        if dp > 1 and dev.zero_reduce:
            return dev.zero_reduce[_nearest(dev.zero_reduce, dp)] * params
        return dev.zero_step[0] * params
    return DP_REDUCE_BYTES * params / dev.mem_bw if dp > 1 else 0.0


def gemm_width(m, tp: int, micro: int) -> int:
    rows = m.tgt_len + (m.mem_len if m.lamemo else 0)
    return min(m.d_model, m.n_head * m.d_head // tp, m.d_inner // tp, rows * micro)


def step_time(cfg, world: int, kind, gpus_per_node: int, plan_fn) -> StepTime:
    """The predicted step of cfg's layout on `world` devices of `kind` (a DEVICES key or a Device; gpus_per_node
    per node). plan_fn: layouts.plan (passed in), whose per-stage plans give each stage's layers, parameters and
    activations."""
    dev = kind if isinstance(kind, Device) else device(kind)
    m, par = cfg.model, cfg.parallel
    tp, pp, zero, ga = par.tp, par.pp, par.zero_stage, cfg.train.grad_accum
    dp, micro = cfg.layout(world)
    dtype, pbytes = cfg.precision.dtype, element_bytes(cfg.precision.dtype)
    if dtype not in dev.peak:
        raise ValueError(f"precision.dtype: {dev.kind} has no {dtype} figure (has {', '.join(dev.peak)})")
    peak = dev.peak[dtype]
    width = gemm_width(m, tp, micro)
    share = dev.share(width, gpus_per_node)   # CPU ranks sharing cores: each runs `share` times slower

    def shared(group: int) -> float:
        """A CPU's collectives are CPU work too (gloo on loopback: copies and sums): measured in a group of `group`
        processes alone (sharing the cores `group` ways), they run while every rank of the node runs its own
        group's: `share` over the measurement's own sharing. 1 on a GPU (no contention)."""
        return share / dev.share(width, group)
    per_layer, rest = layer_and_rest_flops(m, micro)
    rows = m.tgt_len + (m.mem_len if m.lamemo else 0)
    measured = dev.layer_rate(m, tp, rows * micro)
    eff = measured / peak if measured else dev.eff(width)
    act_bytes = rows * micro * m.d_model * pbytes

    # the slowest stage's micro-batch slot: compute, elementwise work, TP all-reduces
    slot, stage_terms = 0.0, None
    plans = [plan_fn(cfg, world, 1e9, s) for s in range(pp)]
    for s in range(pp):
        layers = plans[s].layers
        flops = 3 * (layers * per_layer + (rest if s == pp - 1 else 0)) / tp
        compute = flops / (peak * eff)
        in_flight = min(pp - s, ga)
        elementwise = ELEMENTWISE_PASSES * plans[s].activations / in_flight / dev.mem_bw
        n_ar = 4 * layers + (TP_EXTRA_ALLREDUCES if s in (0, pp - 1) else 0)
        tp_comm = n_ar * dev.collective(tp, act_bytes, False) * shared(tp)
        host = layers * dev.layer_overhead
        # a GPU runs the launches ahead of its kernels (exposed only beyond them); a CPU core does both
        overhead = host if dev.contention else max(0.0, host - compute - elementwise)
        if compute + elementwise + overhead + tp_comm > slot:
            slot = compute + elementwise + overhead + tp_comm
            stage_terms = (compute, elementwise, overhead, tp_comm, s)
    compute, elementwise, overhead, tp_comm, worst = stage_terms
    work = (compute + elementwise + overhead) * share    # with every rank of the node busy
    busy = work * ga
    # 1F1B's critical path, a stage alone at full speed (an idle stage's core serves the others)
    piped = (ga + pp - 1) * work / share
    bubble = max(0.0, piped - busy) if pp > 1 else 0.0
    p2p = tied = 0.0
    if pp > 1:
        # stage boundaries: on more than one node, some boundary on the critical path is between nodes
        spans = world > gpus_per_node
        p2p = 2 * (ga + pp - 1) * dev.send((m.tgt_len + m.mem_len) * micro * m.d_model * pbytes, spans) * shared(2)
        if m.tie_weight:   # DeepSpeed's ReduceTiedGrads: the table's gradient between the first and last stage
            tied = dev.collective(2, m.n_token * m.embed_dim / tp * pbytes, spans) * shared(2)

    # data parallelism: gradient all-reduce, ZeRO's parameter all-gather, the optimizer
    params = plans[worst].params / pbytes                # the rank's parameters (elements)
    grad_bytes = params * pbytes
    across = tp * dp > gpus_per_node
    buckets = max(1, math.ceil(params / DS_REDUCE_BUCKET))
    per_reduction = buckets * dev.collective(dp, grad_bytes / buckets, across) * shared(dp)
    dp_comm = per_reduction * (ga if zero == 2 else 1)
    zero_gather = (buckets * dev.collective(dp, grad_bytes / buckets, across, gather=True) * shared(dp)
                   if zero >= 1 else 0)
    owned = params / (dp if zero >= 1 else 1)
    opt_s = dev.optimizer_s_per_param or ADAM_BYTES_PER_PARAM / dev.mem_bw
    optimizer = (owned * opt_s + (ZERO_STEP_BYTES_OWNED * owned if zero >= 1 else 0) / dev.mem_bw) * share
    reductions = ga if zero == 2 else 1      # ZeRO 2 reduces every micro-batch, 0 and 1 at the boundary
    reduce_copies = reduce_copies_seconds(dev, params, dp, zero) * reductions
    if dev.zero_reduce and dp > 1 and zero >= 1:     # measured in a group of g processes alone: see `shared`
        reduce_copies *= shared(_nearest(dev.zero_reduce, dp))
    else:
        reduce_copies *= share
    first_touch = 0.0
    if dev.zero_step and zero >= 1:     # measured: DeepSpeed's copies (at any dp, even 1) and step, fresh pages
        optimizer = dev.zero_step[1] * owned * share
    elif dev.first_touch_bw:
        fresh = grad_bytes + (4 * owned if zero >= 1 else 0) + (grad_bytes if dp > 1 else 0)   # + the flat copy
        first_touch = fresh / dev.first_touch_bw * share
    hides = 0.0     # what ZeRO 1/2's overlap_comm would hide: all buckets but the last, behind the last backward
    if zero in (1, 2) and pp == 1 and dp > 1 and not dev.contention:
        backward = 2 / 3 * compute                       # the last micro-batch's backward
        exposed = max(per_reduction / buckets, per_reduction - backward)
        hides = dp_comm - exposed * (ga if zero == 2 else 1)
    terms = {"compute": compute * share * ga, "elementwise": elementwise * share * ga,
             "overhead": overhead * share * ga,
             "tp_comm": tp_comm * ga, "pp_bubble": bubble + (tp_comm * (pp - 1) if pp > 1 else 0.0),
             "pp_p2p": p2p + tied, "dp_comm": dp_comm, "reduce_copies": reduce_copies, "zero_gather": zero_gather,
             "optimizer": optimizer,
             "first_touch": first_touch}
    return StepTime(f"tp={tp} pp={pp} dp={dp} zero={zero} micro_batch={micro} x grad_accum={ga}", terms,
                    cfg.data.batch_size * m.tgt_len, world, step_flops(m, cfg.data.batch_size), peak, width, eff,
                    overlap_hides=hides)


def explain(st: StepTime, kind) -> list[str]:
    """The breakdown of one layout, one line a term."""
    dev = kind if isinstance(kind, Device) else device(kind)
    out = [f"predicted step ({dev.kind}): {st.layout}",
           f"  GEMM width {st.width:g} (narrowest dense-GEMM dimension on a rank) -> {st.efficiency:.0%} of peak "
           f"{st.peak / 1e12:g} TFLOP/s"]
    for name, s in st.terms.items():
        if s:
            out.append(f"  {name:<12}{s * 1e3:10.1f} ms  {s / st.seconds:6.1%}")
    out.append(f"  {'step':<12}{st.seconds * 1e3:10.1f} ms  -> {st.tokens_per_s:,.0f} tokens/s "
               f"({st.tokens_per_s_per_device:,.1f} per device), MFU {st.mfu:.1%}; dominant: {st.dominant}")
    if st.overlap_hides:
        out.append(f"  (zero_optimization.overlap_comm would hide {st.overlap_hides * 1e3:.1f} ms of dp_comm "
                   f"behind the backward pass)")
    out.append(f"  calibration: {dev.source}")
    return out
