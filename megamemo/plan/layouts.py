"""What `megamemo plan` counts (megamemo/commands/plan.py; the report: report.py): per-rank memory of a run before
launching it - parameters, gradients, optimizer state
(by ZeRO stage), activations and recurrence-memory state for the chosen TP/PP/DP layout - and whether it fits.

    megamemo plan --config configs/lamemo-7b.yaml --nodes 4 --gpus-per-node 8 --gpu a100-80g [--tp 4 --pp 2]
    megamemo plan --config configs/rehearsal-1.3b-width.yaml --nodes 1 --gpus-per-node 4 --device cpu \
        --host-mem-gib 24 --tp 2 --pp 2          # CPU processes sharing the node's memory
    megamemo plan --config configs/lamemo-7b.yaml --nodes 8 --gpus-per-node 8 --gpu a100-80g   # no --tp/--pp:
                                                 # also the layouts that fit, best first (megamemo/plan/recommend.py)

Counts are analytic (from the model config, not from building the model), one column per pipeline stage: a stage
holds its layers (n_layer / pp, the first ones one more when it does not divide) and the shared position biases;
the first the embedding and, for LaMemo, the embedding FIFO; the last the output bias, a tied copy of the table
and the logits. A stage has up to pp - stage micro-batches in flight (DeepSpeed's 1F1B schedule). Activations
count the tensors that autograd keeps per layer for one micro-batch; with train.activation_checkpointing, each
layer's input plus one layer's activations (recomputed in the backward, one layer at a time). bf16 + ZeRO 1 runs
DeepSpeed's BF16_Optimizer, which adds a full fp32 gradient buffer per rank. Beyond weights,
gradients and Adam: DeepSpeed's ZeRO optimizer's fp32 master (a copy even of fp32 weights), its flat fp32
gradient partition and reduction bucket (parallel.reduce_bucket_size elements; two of them with
parallel.overlap_comm: parallel/zero.py), the new memory state held until the step commits, and on a CPU layout
the process itself (python + torch + DeepSpeed + megatron-core: CPU_BASELINE, measured) and the checkpoint's host
copy, kept between saves. bench/plan_vs_rss.py checks the CPU figures against every rank's measured peak resident
memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamemo.model.params import bias_params, input_params, layer_params, output_params
from megamemo.parallel.zero import (
    DS_REDUCE_BUCKET,
    bf16_optimizer,
    fp32_accumulation,
    overlaps_reduction,
    reduce_bucket,
)
from megamemo.util.precision import HALF

GiB = 1024**3
HEADROOM = 0.9  # keep 10% for the allocator, communication buffers and the framework
# resident memory of one training process before its model exists: python, torch, DeepSpeed, megatron-core, gloo
# (measured by bench/plan_vs_rss.py on this stack: MEGAMEMO_RSS_REPORT's `started` mark)
CPU_BASELINE = 0.38 * GiB


@dataclass
class Plan:
    layout: str
    params: float
    grads: float
    optimizer: float
    activations: float
    memory_state: float
    capacity: float
    zero_buffers: float = 0.0  # ZeRO's fp32 gradient partition + DeepSpeed's gradient bucket
    pending_memory: float = 0.0  # the new memory state, held until the step commits it
    baseline: float = 0.0  # the process itself (CPU: python + torch + DeepSpeed + megatron-core imported)
    snapshot: float = 0.0  # the checkpoint's host copy (device memory only on a CPU layout)
    on_host: bool = False  # a CPU layout: the snapshot is in the same memory
    stage: int = 0
    layers: int = 0  # the stage's model layers

    TERMS = (
        "params",
        "grads",
        "optimizer",
        "activations",
        "memory_state",
        "pending_memory",
        "zero_buffers",
        "baseline",
        "snapshot",
    )

    @property
    def total(self):
        """The peak: what lives throughout, plus the step's transients (gradients, ZeRO's buffers, activations).
        On a CPU layout the checkpoint's copy lives throughout too: its host buffers are kept from one save to the
        next (checkpoint/staging.py), so from the first save on they sit beside every step's transients."""
        return (
            self.params
            + self.optimizer
            + self.memory_state
            + self.pending_memory
            + self.baseline
            + (self.snapshot if self.on_host else 0)
            + self.grads
            + self.zero_buffers
            + self.activations
        )

    @property
    def fits(self):
        return self.total <= HEADROOM * self.capacity


def stage_layers(n_layer: int, pp: int, stage: int) -> int:
    """Layers of pipeline stage `stage`: n_layer / pp, the first stages one more when it does not divide."""
    return n_layer // pp + (1 if stage < n_layer % pp else 0)


def plan(cfg, world: int, gpu_gib: float, stage: int = 0, device: str = "gpu") -> Plan:
    """Bytes one rank of pipeline stage `stage` holds (stage 0: the largest). device "cpu": a CPU layout, whose
    capacity `gpu_gib` is the host memory one rank may use; it adds the process baseline and the checkpoint's host
    copy, and DeepSpeed's bucket counts only the pages it touches."""
    m, tp, pp = cfg.model, cfg.parallel.tp, cfg.parallel.pp
    dp, micro = cfg.layout(world)
    split, repl = layer_params(m)
    first, last = stage == 0, stage == pp - 1
    layers = stage_layers(m.n_layer, pp, stage)
    # every stage: its layers' shards and the shared position biases (a RelBias ahead of each layer's block);
    # the first stage the input embedding; the last the output side (under pp > 1 a tied copy of the table too).
    # Under TP everything but layer norms and fc2's bias is split (the softmax is then full and tied).
    params = (
        layers * (split / tp + repl)
        + (bias_params(m) + (input_params(m) if first or last else 0) + (output_params(m) if last else 0)) / tp
    )
    mixed = cfg.precision.dtype in HALF
    p_bytes = 2 if mixed else 4
    zero = cfg.parallel.zero_stage
    # fp32 master (DeepSpeed's ZeRO optimizer keeps one, a copy, even when the weights are fp32) + Adam moments
    opt_per_param = (4 + 8) if mixed or zero >= 1 else 8
    params_b = params * p_bytes
    grads_b = params * p_bytes / (dp if zero >= 2 else 1)
    opt_b = params * opt_per_param / (dp if zero >= 1 else 1)
    zero_b = 0.0
    reduction = (cfg.parallel, cfg.precision, cfg.train.grad_accum)  # what parallel/zero.py reads
    if bf16_optimizer(*reduction):
        # DeepSpeed's BF16_Optimizer (bf16 + ZeRO 1 with fp32 accumulation, train/engine.py): a full fp32 gradient
        # buffer on every rank (not partitioned) and its all-reduce buffer of up to reduce_bucket_size bf16 values
        bucket = DS_REDUCE_BUCKET if device != "cpu" else min(DS_REDUCE_BUCKET, params)
        zero_b = 4 * params + 2 * min(bucket, params)
    elif zero >= 1:
        # the flat fp32 gradient of the rank's partition (the optimizer's .grad), and the reduction bucket:
        # reduce_bucket_size elements, fp32 under ZeRO 1 accumulating in fp32 (its accumulator), else the model
        # dtype (ZeRO 2; ZeRO 1 accumulating in it: bf16 at grad_accum 1, parallel/zero.py), a second
        # one to fill while the first reduces under overlap_comm; on the CPU only the pages gradients are copied
        # into become resident
        size = reduce_bucket(*reduction)
        bucket = (size if device != "cpu" else min(size, params)) * (2 if overlaps_reduction(*reduction) else 1)
        zero_b = 4 * params / dp + bucket * (4 if zero == 1 and fp32_accumulation(*reduction) else p_bytes)

    L, M, B = m.tgt_len, (m.mem_len if m.has_memory else 0), micro
    klen = L + M
    rows = klen if m.lamemo else L  # LaMemo recomputes its memory rows in every layer
    n_loc, nd_loc, f_loc = m.n_head / tp, m.n_head * m.d_head / tp, m.d_inner / tp
    per_layer = (
        rows * B * m.d_model * 4  # layer input, attention out, LN out, FFN out
        + 2 * klen * B * nd_loc
        + 2 * rows * B * nd_loc  # k, v; q and context (XL: current rows only)
        + 2 * rows * B * f_loc
    )  # FFN hidden, activation
    per_layer_scores = 2 * B * n_loc * L * klen * 4 / p_bytes  # fp32 scores and probabilities
    if m.lamemo:
        per_layer_scores += 2 * B * n_loc * M * min(M, L) * 4 / p_bytes
    in_flight = min(pp - stage, cfg.train.grad_accum)  # micro-batches in flight on a stage (1F1B)
    logits = L * B * m.n_token / tp * 4 * (1 if last else 0)  # fp32 logits live on the last stage
    if cfg.train.activation_checkpointing:
        # each layer keeps only its input; the backward recomputes one layer at a time, holding its activations
        act = (layers * rows * B * m.d_model * p_bytes + logits) * in_flight + (per_layer + per_layer_scores) * p_bytes
    else:
        act = (layers * (per_layer + per_layer_scores) * p_bytes + logits) * in_flight

    streams = B * cfg.train.grad_accum
    if m.lamemo:
        state = streams * M * ((m.d_model * p_bytes if first else 0) + layers * n_loc * (m.d_head * p_bytes + 4))
    elif m.has_memory:
        state = streams * M * layers * m.d_model * p_bytes
    else:
        state = 0
    # the checkpoint's copy: the weights and Adam's state (and fp32 masters, in bf16/fp16: an fp32 run saves none,
    # its weights are them) of the stage's shard, written once over its data-parallel ranks - ZeRO's own partition,
    # or what every rank holds alike spread over them by size (checkpoint/pieces.py spread_writers) - and its memory
    snap = (params_b + params * (12 if mixed else 8)) / dp + state
    on_host = device == "cpu"
    return Plan(
        f"tp={tp} pp={pp} dp={dp} zero={zero} micro_batch={micro} x grad_accum={cfg.train.grad_accum}",
        params_b,
        grads_b,
        opt_b,
        act,
        state,
        gpu_gib * GiB,
        zero_buffers=zero_b,
        pending_memory=state,
        baseline=CPU_BASELINE if on_host else 0.0,
        snapshot=snap,
        on_host=on_host,
        stage=stage,
        layers=layers,
    )


def stage_plans(cfg, world: int, gib: float, device: str = "gpu") -> list[Plan]:
    """One plan per pipeline stage (every rank of a stage holds the same)."""
    return [plan(cfg, world, gib, stage, device) for stage in range(cfg.parallel.pp)]
