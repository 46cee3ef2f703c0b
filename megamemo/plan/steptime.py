"""Predicted time of one training step for a layout (tp, pp, dp, ZeRO stage, micro-batch x grad_accum), beside
layouts.py's memory: what `megamemo plan` ranks layouts by (tokens/s per device) and what `--explain` prints.

Terms, per rank of the slowest pipeline stage (every term below is exposed: nothing overlaps unless it says so).
The stage's micro-batch is the model's own op trace (optrace.py: every kernel, forward and backward, of the rank's
share - its layers, the input side on the first stage, the output side on the last - at the layout's micro-batch).
On a GPU (Device.launch) it is priced op by op (opcost.py):
  compute       its GEMMs: FLOPs at the dtype's peak x efficiency(the narrower of the product's rows and columns:
                the GEMM efficiency table), or their bytes at memory bandwidth where slower; unaligned products
                (LaMemo's position terms, klen + 1 columns) Device.unaligned times slower;
  elementwise   every other kernel's bytes read and written at Device.elementwise_bw x the memory bandwidth;
  overhead      the launches: the host issues each kernel in Device.launch seconds, the device runs them in order
                as they come; what the simulated wall time of the step's micro-batches exceeds their kernels by (a
                small micro-batch waits on its host).
On a device without a launch figure (the CPU):
  compute       model FLOPs (model/flops.py) of the rank's share at peak x efficiency(GEMM width); the width is the
                narrowest dimension of a layer's dense GEMMs on the rank: min(d_model, heads x d_head / tp,
                d_inner / tp, rows x micro-batch). Where the device measured this layer shape's projections at the
                layout's tp and rows (the CPU: Device.layer_gemm, bench/calibrate_cpu.py's layer_gemm_rate), that
                rate replaces peak x efficiency: a width alone misses what a layer's 16-64 MiB weights cost a CPU
                core against narrow cached ones (measured here: 45 against 79 GFLOP/s at 64 rows).
  elementwise   the trace's non-GEMM bytes at the device's memory bandwidth.
  overhead      host time per layer and micro-batch (python, autograd, dispatch): Device.layer_overhead, measured,
                added to the kernels (the CPU runs both).
  tp_comm       per layer and micro-batch 4 all-reduces of the [rows, B, d_model] activations (2 forward, 2
                backward; bench/comm.py) + TP_EXTRA_ALLREDUCES for the vocab-parallel embedding and cross-entropy,
                each latency + 2 (tp-1)/tp bytes / bandwidth, on the critical path.
  pp_bubble     1F1B over p stages and m = grad_accum micro-batches: the step takes (m + p - 1) micro-batch slots,
                p - 1 of them idle: the bubble (p-1)/(m+p-1). On a CPU whose ranks share its cores, a rank
                computes `share` times slower while all compute (Device.contention: ranks / cores unless
                measured) and an idle stage's core serves the others: the step is max((m+p-1) t_alone, m t_shared).
  pp_p2p        per micro-batch slot, the activations and memory rows forward and their gradient back; and
                DeepSpeed's all-reduce of the tied embedding's gradient between the first and last stage.
  dp_comm       the gradient reduction over dp: DeepSpeed's ZeRO 0/1/2 all-reduce whole buckets (stage_1_and_2.py,
                use_multi_rank_bucket_allreduce) of parallel.reduce_bucket_size elements (parallel/zero.py), 2 (dp-1)/dp
                bytes in the dtype DeepSpeed reduces in (the model dtype, BF16_Optimizer's fp32 gradients cast to
                bf16 too: parallel/zero.py reduce_dtype), once per step at the accumulation boundary (ZeRO 2: every
                micro-batch). DeepSpeed overlaps it with the backward pass, bucket by bucket, only with
                parallel.overlap_comm (off by default) and only where it takes effect (ZeRO 1/2 without a pipeline, not
                bf16's BF16_Optimizer - bf16 ZeRO 1 at grad_accum > 1 -: parallel/zero.py overlaps_reduction): then all
                buckets but the last reduce behind the last micro-batch's backward (2/3 of its compute) and only the
                rest is exposed; on a CPU whose ranks share its cores nothing hides. `overlap_hides` is what overlap
                hides (overlapped) or would hide (not).
  zero_gather   ZeRO 1/2's extra collective: the updated parameters all-gathered after the optimizer step.
  On a CPU whose ranks share its cores, every collective (TP, DP, ZeRO's gather, p2p) is CPU work as well:
                measured in a group of g processes (sharing the cores max(1, g / cores) ways), it runs while all
                the node's ranks run theirs, so it takes share(node ranks) / share(g) times its measured time
                (TP2 x DP2 on 2 cores: two dp=2 groups reduce at once, 2x the 2-process measurement; DP4: 1x).
  reduce_copies the gradient reduction's own work beyond the all-reduce (reduce_copies_seconds): DeepSpeed's ZeRO
                1/2 copy the gradients into the bucket, average them and, at dp > 1, flatten the bucket's slices by
                owning rank into a fresh tensor and copy the rank's own back into its partition; once a step (ZeRO
                2: every micro-batch). Measured per parameter held at dp 1, 2 and 4 on the CPU (Device.zero_step,
                Device.zero_reduce, by the parameters a rank holds: it grows with dp and, at dp 4 on 2 cores, with
                size); DP_REDUCE_BYTES at memory bandwidth on a GPU.
  grad_accum    gradient accumulation: each micro-batch after the first adds its gradient into the accumulator,
                in fp32 for half precision with ZeRO 1/2 (accumulation_seconds); with one micro-batch a step
                (grad_accum 1) there is no such pass.
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

DEVICES, the calibration table (one row per device kind, with its source), is devices.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from megamemo.model.flops import forward_flops, model_flops, step_flops
from megamemo.parallel.zero import fp32_accumulation, overlaps_reduction, reduce_bucket, reduce_dtype
from megamemo.plan import opcost, optrace
from megamemo.plan.devices import Device, device, nearest_group
from megamemo.util.precision import HALF, element_bytes

TP_EXTRA_ALLREDUCES = 3  # per micro-batch: vocab-parallel embedding (fwd) and cross-entropy (max, sum)
DS_GATHER_BUCKET = 500_000_000  # DeepSpeed's allgather_bucket_size default (elements)
ADAM_BYTES_PER_PARAM = 36  # GPU Adam: grad read, fp32 master, m, v read + written, model copy written (fused)
# DeepSpeed's optimizer step around Adam, per parameter the rank owns (fp32): the gradient flattened into the
# partition (read + write), its norm (read), clipping (read + write), the updated master copied to the weights
# (read + write); and under dp > 1, per parameter it holds (reduce_copies_seconds): the gradient copied into the
# bucket, averaged, flattened for the all-reduce (a fresh tensor) and copied back (read + write each)
ZERO_STEP_BYTES_OWNED, DP_REDUCE_BYTES = 28, 32


@dataclass
class StepTime:
    layout: str
    terms: dict  # name -> seconds per step (exposed)
    tokens: int  # target tokens per step, all ranks
    world: int
    hfu_flops: float  # per step, all ranks: what the step executes (model/flops.py step_flops)
    mfu_flops: float  # per step, all ranks: PaLM's model FLOPs (model/flops.py model_flops)
    peak: float  # per device FLOP/s
    width: float  # the narrowest dense-GEMM dimension on a rank
    efficiency: float
    overlap_hides: float = 0.0  # of dp_comm, what ZeRO 1/2's overlap_comm hides or would hide (GPU, no pipeline)
    overlapped: bool = False  # whether it does (parallel.overlap_comm where it takes effect): not in dp_comm
    parts: list = dataclasses.field(default_factory=list)  # the slowest stage's micro-batch (opcost.Part)
    stage: int = 0  # which stage that is
    launch: float = 0.0  # host seconds a kernel (GPU)
    attention: str = "eager"  # the attention form priced (model.attention; auto is priced as eager)

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
    def hfu(self) -> float:
        return self.hfu_flops / (self.seconds * self.world * self.peak)

    @property
    def mfu(self) -> float:
        return self.mfu_flops / (self.seconds * self.world * self.peak)

    @property
    def dominant(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


def layer_and_rest_flops(m, micro: int) -> tuple[float, float]:
    """Forward FLOPs of one layer and of the rest (output layer, projections) for a micro-batch, from flops.py:
    f(n) = n per_layer + rest, so per_layer = f(2) - f(1) and rest = f(1) - per_layer."""
    f1 = forward_flops(dataclasses.replace(m, n_layer=1), micro)
    f2 = forward_flops(dataclasses.replace(m, n_layer=2), micro)
    return f2 - f1, 2 * f1 - f2


def reduce_copies_seconds(dev: Device, params: float, dp: int, zero: int) -> float:
    """One gradient reduction's work beyond its collective for a rank holding `params` parameters, on a device of
    its own (step_time scales it for shared cores). DeepSpeed's ZeRO 1/2 (stage_1_and_2.py; megamemo's config:
    reduce_scatter and use_multi_rank_bucket_allreduce on, overlap_comm as parallel.overlap_comm) copies each
    gradient into the bucket, averages it and at dp > 1 flattens the bucket's slices by owning rank into a fresh tensor
    for the all-reduce (average_tensor -> allreduce_and_scatter), then copies the rank's own back into its partition.
    Measured at dp's group size and the rank's size (Device.zero_reduce) or dp 1 (Device.zero_step) where it was; else
    DP_REDUCE_BYTES per parameter held at dp > 1 at memory bandwidth (ZeRO 0's engine flattens and copies back too), 0
    at dp 1."""
    if dev.zero_step and zero >= 1:
        rate = dev.reduce_rate(dp, params) if dp > 1 else None  # None without zero_reduce figures
        if rate is not None:
            return rate * params
        return dev.zero_step[0] * params
    return DP_REDUCE_BYTES * params / dev.mem_bw if dp > 1 else 0.0


def accumulation_seconds(dev: Device, cfg, params: float, tensors: int) -> float:
    """One gradient-accumulation pass: a micro-batch after the first adds its gradient of `params` parameters (in
    `tensors` tensors) into the accumulator. Half precision with ZeRO 1/2 accumulates in fp32 (DeepSpeed 0.19.8:
    ZeRO 1/2's grad_accum.add_(grad.to(fp32)), BF16_Optimizer's hp_grad.add_(lp.grad.to(fp32))): the gradient read
    and cast (2 B + 4 B written), the fp32 sum read and written with it (12 B), 2 kernels a tensor; otherwise
    autograd adds it into .grad in the model dtype (3 x its bytes, 1 kernel). The first micro-batch's gradient is
    moved into the accumulator by a copy every step makes, grad_accum 1 or not: not counted here. On a GPU the pass
    takes its bytes at bandwidth or its launches, whichever is longer."""
    p = cfg.precision
    pbytes = element_bytes(p.dtype)
    fp32 = p.dtype in HALF and fp32_accumulation(cfg.parallel, cfg.precision, cfg.train.grad_accum)
    seconds = (pbytes + 16 if fp32 else 3 * pbytes) * params / dev.mem_bw
    if dev.launch:
        seconds = max(seconds, (2 if fp32 else 1) * tensors * dev.launch)
    return seconds


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
    share = dev.share(width, gpus_per_node)  # CPU ranks sharing cores: each runs `share` times slower

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

    # the slowest stage's micro-batch slot: compute, elementwise work, launches, TP all-reduces
    slot, stage_terms = 0.0, None
    plans = [plan_fn(cfg, world, 1e9, s) for s in range(pp)]
    ops = optrace.trace(m, micro, tp, dtype)
    recompute = cfg.train.activation_checkpointing
    if dev.launch is not None:  # a GPU: the trace priced op by op, its launches simulated
        price = functools.partial(opcost.price, dev=dev, dtype=dtype, allow_tf32=cfg.precision.allow_tf32)
    else:  # flops.py's rate (measured or tabled) for the GEMMs, the trace's bytes
        price = functools.partial(opcost.price_at, rate=peak * eff, mem_bw=dev.mem_bw)
    for s in range(pp):
        layers = plans[s].layers
        fwd, bwd = ops.stage(layers, s == 0, s == pp - 1, recompute)
        if dev.launch is not None:
            cost = opcost.concat([price(fwd), price(bwd)])
            compute, elementwise = float(cost.gemm.sum()), float(cost.other.sum())
            wall = opcost.micro_batches(cost, ga, chained=pp == 1) / ga
            overhead = max(0.0, wall - compute - elementwise)
            achieved = float(fwd.flops.sum() + bwd.flops.sum()) / (peak * compute) if compute else 0.0
        else:  # flops.py at the measured (CPU) or tabled rate, the trace's bytes
            flops = 3 * (layers * per_layer + (rest if s == pp - 1 else 0)) / tp
            compute = flops / (peak * eff)
            elementwise = float(sum(x.bytes[~x.gemm].sum() for x in (fwd, bwd))) / dev.mem_bw
            host = layers * dev.layer_overhead
            # a CPU core runs its host work and its kernels one after the other
            overhead = host if dev.contention else max(0.0, host - compute - elementwise)
            achieved = eff
        n_ar = 4 * layers + (TP_EXTRA_ALLREDUCES if s in (0, pp - 1) else 0)
        tp_comm = n_ar * dev.collective(tp, act_bytes, False) * shared(tp)
        if compute + elementwise + overhead + tp_comm > slot:
            slot = compute + elementwise + overhead + tp_comm
            stage_terms = (compute, elementwise, overhead, tp_comm, s, achieved)
    assert stage_terms is not None, "no stage takes any time"
    compute, elementwise, overhead, tp_comm, worst, eff = stage_terms
    parts = opcost.parts(ops, plans[worst].layers, worst == 0, worst == pp - 1, recompute, price)
    work = (compute + elementwise + overhead) * share  # with every rank of the node busy
    busy = work * ga
    # 1F1B's critical path, a stage alone at full speed (an idle stage's core serves the others)
    piped = (ga + pp - 1) * work / share
    bubble = max(0.0, piped - busy) if pp > 1 else 0.0
    p2p = tied = 0.0
    if pp > 1:
        # stage boundaries: on more than one node, some boundary on the critical path is between nodes
        spans = world > gpus_per_node
        p2p = 2 * (ga + pp - 1) * dev.send((m.tgt_len + m.mem_len) * micro * m.d_model * pbytes, spans) * shared(2)
        if m.tie_weight:  # DeepSpeed's ReduceTiedGrads: the table's gradient between the first and last stage
            tied = dev.collective(2, m.n_token * m.embed_dim / tp * pbytes, spans) * shared(2)

    # data parallelism: gradient all-reduce, ZeRO's parameter all-gather, the optimizer
    params = plans[worst].params / pbytes  # the rank's parameters (elements)
    grad_bytes = params * pbytes
    reduction = (cfg.parallel, cfg.precision, cfg.train.grad_accum)  # what parallel/zero.py reads
    wire = params * element_bytes(reduce_dtype(cfg.precision))  # what DeepSpeed all-reduces in (zero.py)
    across = tp * dp > gpus_per_node
    buckets = max(1, math.ceil(params / reduce_bucket(*reduction)))
    per_reduction = buckets * dev.collective(dp, wire / buckets, across) * shared(dp)
    dp_comm = per_reduction * (ga if zero == 2 else 1)
    gathers = max(1, math.ceil(params / DS_GATHER_BUCKET))
    zero_gather = (
        gathers * dev.collective(dp, grad_bytes / gathers, across, gather=True) * shared(dp) if zero >= 1 else 0
    )
    owned = params / (dp if zero >= 1 else 1)
    opt_s = dev.optimizer_s_per_param or ADAM_BYTES_PER_PARAM / dev.mem_bw
    optimizer = (owned * opt_s + (ZERO_STEP_BYTES_OWNED * owned if zero >= 1 else 0) / dev.mem_bw) * share
    reductions = ga if zero == 2 else 1  # ZeRO 2 reduces every micro-batch, 0 and 1 at the boundary
    reduce_copies = reduce_copies_seconds(dev, params, dp, zero) * reductions
    if dev.zero_reduce and dp > 1 and zero >= 1:  # measured in a group of g processes alone: see `shared`
        reduce_copies *= shared(nearest_group(dev.zero_reduce, dp))
    else:
        reduce_copies *= share
    first_touch = 0.0
    if dev.zero_step and zero >= 1:  # measured: DeepSpeed's copies (at any dp, even 1) and step, fresh pages
        optimizer = dev.zero_step[1] * owned * share
    elif dev.first_touch_bw:
        fresh = grad_bytes + (4 * owned if zero >= 1 else 0) + (grad_bytes if dp > 1 else 0)  # + the flat copy
        first_touch = fresh / dev.first_touch_bw * share
    tensors = ops.param_tensors_layer * plans[worst].layers + (ops.param_tensors_rest if worst in (0, pp - 1) else 0)
    accumulate = accumulation_seconds(dev, cfg, params / (dp if zero == 2 else 1), tensors) * (ga - 1) * share
    hides = 0.0  # what ZeRO 1/2's overlap_comm hides: all buckets but the last, behind the last backward
    if zero in (1, 2) and pp == 1 and dp > 1 and not dev.contention:
        backward = 2 / 3 * compute  # the last micro-batch's backward
        exposed = max(per_reduction / buckets, per_reduction - backward)
        hides = dp_comm - exposed * (ga if zero == 2 else 1)
    overlapped = overlaps_reduction(*reduction)
    if overlapped:
        dp_comm -= hides
    terms = {
        "compute": compute * share * ga,
        "elementwise": elementwise * share * ga,
        "overhead": overhead * share * ga,
        "tp_comm": tp_comm * ga,
        "pp_bubble": bubble + (tp_comm * (pp - 1) if pp > 1 else 0.0),
        "pp_p2p": p2p + tied,
        "dp_comm": dp_comm,
        "reduce_copies": reduce_copies,
        "zero_gather": zero_gather,
        "grad_accum": accumulate,
        "optimizer": optimizer,
        "first_touch": first_touch,
    }
    return StepTime(
        f"tp={tp} pp={pp} dp={dp} zero={zero} micro_batch={micro} x grad_accum={ga}",
        terms,
        cfg.data.batch_size * m.tgt_len,
        world,
        step_flops(m, cfg.data.batch_size),
        model_flops(m, cfg.data.batch_size),
        peak,
        width,
        eff,
        overlap_hides=hides,
        overlapped=overlapped,
        parts=parts,
        stage=worst,
        launch=dev.launch or 0.0,
        attention="fused" if m.attention == "fused" else "eager",
    )


ATTENTION_PRICED = {
    "eager": "  attention priced: eager (model.attention eager or auto): its score matrices go to memory and back "
    "(the elementwise term); --set model.attention=fused prices the fused kernels",
    "fused": "  attention priced: fused (model.attention fused): one kernel a call forward, three backward, no score "
    "round trips (megamemo/plan/fused_trace.py; an estimate until a GPU measures the kernels)",
}


def explain(st: StepTime, kind) -> list[str]:
    """The breakdown of one layout, one line a term, and the slowest stage's micro-batch part by part."""
    dev = kind if isinstance(kind, Device) else device(kind)
    how = "achieved over the op trace's GEMMs" if dev.launch is not None else "narrowest dense-GEMM dimension on a rank"
    out = [
        f"predicted step ({dev.kind}): {st.layout}",
        f"  GEMM width {st.width:g} -> {st.efficiency:.0%} of peak {st.peak / 1e12:g} TFLOP/s ({how})",
    ]
    for name, s in st.terms.items():
        if s:
            out.append(f"  {name:<12}{s * 1e3:10.1f} ms  {s / st.seconds:6.1%}")
    out.append(
        f"  {'step':<12}{st.seconds * 1e3:10.1f} ms  -> {st.tokens_per_s:,.0f} tokens/s "
        f"({st.tokens_per_s_per_device:,.1f} per device), HFU {st.hfu:.1%}, MFU {st.mfu:.1%}; "
        f"dominant: {st.dominant}"
    )
    if st.overlap_hides:
        out.append(
            f"  (parallel.overlap_comm {'hides' if st.overlapped else 'would hide'} "
            f"{st.overlap_hides * 1e3:.1f} ms of dp_comm behind the backward pass)"
        )
    out.append(ATTENTION_PRICED[st.attention])
    out += explain_parts(st)
    out.append(f"  calibration: {dev.source}")
    return out


def explain_parts(st: StepTime) -> list[str]:
    """One micro-batch of the slowest stage, forward + backward, part by part (megamemo/plan/optrace.py)."""
    if not st.parts:
        return []
    out = [
        f"  one micro-batch of stage {st.stage}, forward + backward, by the model's op trace (each):",
        f"    {'part':<14}{'GEMM ms':>9}{'elementwise ms':>16}{'kernels':>9}{'GB moved':>10}{'TFLOP':>8}"
        f"  largest elementwise ops (ms)",
    ]
    total = [0.0] * 5
    for p in st.parts:
        label = {"input": "input side", "layer": f"layer (x{p.repeat})", "top": "top layer", "output": "output side"}[
            p.name
        ]
        ops = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in p.top_ops if s > 0)
        out.append(
            f"    {label:<14}{p.gemm_s * 1e3:9.2f}{p.other_s * 1e3:16.2f}{p.kernels:9.0f}{p.bytes / 1e9:10.2f}"
            f"{p.flops / 1e12:8.3f}  {ops}"
        )
        for i, x in enumerate((p.gemm_s, p.other_s, p.kernels, p.bytes, p.flops)):
            total[i] += x * p.repeat
    out.append(
        f"    {'micro-batch':<14}{total[0] * 1e3:9.2f}{total[1] * 1e3:16.2f}{total[2]:9.0f}"
        f"{total[3] / 1e9:10.2f}{total[4] / 1e12:8.3f}  elementwise / GEMM {total[1] / total[0]:.2f}"
        if total[0]
        else ""
    )
    if st.launch:
        out.append(
            f"    launches: {total[2]:,.0f} kernels x {st.launch * 1e6:g} us = "
            f"{total[2] * st.launch * 1e3:.1f} ms of host time a micro-batch (exposed beyond the kernels: the "
            f"overhead term)"
        )
    return out
