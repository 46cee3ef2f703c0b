"""What DeepSpeed 0.19.8 does with a run's gradient-reduction settings (parallel.overlap_comm and
parallel.reduce_bucket_size): which of its optimizers reduces the gradients, in buckets of how many elements, and
whether the reduction overlaps the backward pass. The run config's rules across sections (train/config.py), the
DeepSpeed config (train/engine.py ds_config) and `megamemo plan` (plan/steptime.py, plan/layouts.py) all ask here,
handing over the parallel and precision sections and train.grad_accum explicitly.

Read from DeepSpeed 0.19.8 (runtime/engine.py, runtime/zero/stage_1_and_2.py, runtime/zero/config.py):
  - ZeRO 1 and 2 run its ZeRO optimizer (stage_1_and_2.py), which reads zero_optimization.reduce_bucket_size
    (default 5e8 elements) and overlap_comm (default off below ZeRO 3). With overlap_comm a hook on every
    parameter puts its gradient into a bucket as the backward pass produces it and reduces each full bucket on
    a side stream while the backward goes on (ZeRO 1: in the last micro-batch's backward, at the accumulation
    boundary; ZeRO 2: in every micro-batch's), with two bucket buffers instead of one.
  - bf16 on ZeRO 1 with fp32 gradient accumulation (data_types.grad_accum_dtype fp32: fp32_accumulation below)
    runs its BF16_Optimizer instead (engine.py _do_optimizer_sanity_check), which all-reduces after the backward
    pass in 5e8-element buckets: neither setting reaches it. Neither bf16.immediate_grad_update (BF16_Optimizer's
    own hooks, which accumulate into its fp32 buffer, still reduced after the backward) nor any other bf16 key
    changes that; only the model dtype's accumulation (or ZeRO 2, or a CPU offload) gives the ZeRO optimizer.
  - Every one of them puts the model dtype on the wire (engine.py communication_data_type: bf16 / fp16 / fp32,
    data_types.communication_data_type unset): BF16_Optimizer flattens its fp32 gradients and casts them to bf16
    for the all-reduce (engine.py allreduce_bucket); the ZeRO optimizer reduces its bucket in that dtype too
    (stage_1_and_2.py gradient_reduction_w_predivide). tests/train/test_cluster_step.py records it.
  - ZeRO 0 has no ZeRO optimizer: the engine all-reduces after the backward pass (buffered_allreduce_fallback,
    5e8 elements): neither setting reaches it.
  - Under pipeline parallelism the engine turns overlap_comm off with a warning ("Pipeline parallelism does not
    support overlapped communication"); reduce_bucket_size still applies.
DeepSpeed ignores a setting that cannot take effect without a word; megamemo refuses it by name instead.

precision.grad_accum_dtype auto (fp32_accumulation): fp32 wherever ZeRO accumulates half-precision gradients, except
bf16 on ZeRO 1 at train.grad_accum 1 without a pipeline. There one micro-batch a step leaves nothing to accumulate,
and fp32 would only choose BF16_Optimizer, whose reduction waits for the backward pass; the model dtype gives the
ZeRO optimizer, which reduces the same bf16 values (bucket by bucket, overlapped with parallel.overlap_comm) and
steps the same fp32 master weights.
"""

from __future__ import annotations

DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default and its non-ZeRO all-reduce bucket


def fp32_accumulation(parallel, precision, grad_accum: int) -> bool:
    """Whether DeepSpeed accumulates the gradients in fp32 (data_types.grad_accum_dtype fp32; else the model
    dtype): precision.grad_accum_dtype fp32, or auto for half precision on ZeRO 1/2 but bf16 on ZeRO 1 at
    train.grad_accum 1 without a pipeline (see above)."""
    p, zero = precision, parallel.zero_stage
    if p.dtype == "fp32" or p.grad_accum_dtype == "model" or zero == 0:
        return False
    one_micro_batch = grad_accum == 1 and parallel.pp == 1
    return not (p.grad_accum_dtype == "auto" and p.dtype == "bf16" and zero == 1 and one_micro_batch)


def bf16_optimizer(parallel, precision, grad_accum: int) -> bool:
    """Whether DeepSpeed runs its BF16_Optimizer (bf16 on ZeRO 1 with fp32 accumulation)."""
    return parallel.zero_stage == 1 and precision.dtype == "bf16" and fp32_accumulation(parallel, precision, grad_accum)


def reduce_dtype(precision) -> str:
    """The dtype DeepSpeed all-reduces the gradients in: the model dtype, with every optimizer (see above)."""
    return precision.dtype


def zero_optimizer(parallel, precision, grad_accum: int) -> bool:
    """Whether DeepSpeed reduces the gradients with its ZeRO 1/2 optimizer (the one that reads reduce_bucket_size
    and overlap_comm)."""
    return parallel.zero_stage in (1, 2) and not bf16_optimizer(parallel, precision, grad_accum)


def reduce_bucket(parallel, precision, grad_accum: int) -> int:
    """Elements per gradient-reduction bucket: parallel.reduce_bucket_size where the ZeRO optimizer reads it, else
    DeepSpeed's 5e8."""
    size = parallel.reduce_bucket_size
    return size if size is not None and zero_optimizer(parallel, precision, grad_accum) else DS_REDUCE_BUCKET


def _without_zero_optimizer(parallel) -> str:
    if parallel.zero_stage == 0:
        return "needs parallel.zero_stage 1 or 2 (ZeRO 0 all-reduces after the backward pass, in its own buckets)"
    return (
        "not with precision.dtype bf16 on ZeRO 1 with fp32 gradient accumulation (train.grad_accum > 1, or "
        "precision.grad_accum_dtype fp32): DeepSpeed 0.19.8 runs its BF16_Optimizer there, which all-reduces "
        "after the backward pass (use parallel.zero_stage 2, or precision.grad_accum_dtype model)"
    )


def overlap_problem(parallel, precision, grad_accum: int) -> str | None:
    """Why DeepSpeed would not overlap the gradient reduction with the backward pass, or None."""
    if not zero_optimizer(parallel, precision, grad_accum):
        return _without_zero_optimizer(parallel)
    if parallel.pp > 1:
        return "not with parallel.pp > 1 (DeepSpeed's pipeline engine turns overlap_comm off)"
    return None


def overlaps_reduction(parallel, precision, grad_accum: int) -> bool:
    """Whether the gradient reduction overlaps the backward pass: parallel.overlap_comm where it takes effect."""
    return parallel.overlap_comm and overlap_problem(parallel, precision, grad_accum) is None


def problems(parallel, precision, grad_accum: int) -> list[tuple[str, str]]:
    """(key, why) for each reduction setting the parallel section asks for that DeepSpeed would not apply (its
    range, reduce_bucket_size >= 1, is the section's own)."""
    out = []
    if parallel.overlap_comm and (why := overlap_problem(parallel, precision, grad_accum)):
        out.append(("parallel.overlap_comm", why))
    if parallel.reduce_bucket_size is not None and not zero_optimizer(parallel, precision, grad_accum):
        out.append(("parallel.reduce_bucket_size", _without_zero_optimizer(parallel)))
    return out
