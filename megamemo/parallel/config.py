"""The parallel section of a run config (`parallel.*`): the TP x PP x DP layout, ZeRO and its gradient reduction,
how a sharded model is initialised, and the collectives' time limit. Each value's type, choices and range are
declared here; what the layout needs of the model (tensor.py, pipeline.py) and what DeepSpeed applies (zero.py)
are rules across sections, checked by the run config (megamemo/train/config.py RunConfig.check)."""

from __future__ import annotations

from typing import Annotated, Literal

from megamemo.config.fields import Bool, Field, Float, Int, IntChoice, section


@section("parallel")
class ParallelConfig:
    tp: Annotated[Int, Field(ge=1)] = 1  # tensor parallel size: heads, FFN and vocabulary split (megatron-core)
    pp: Annotated[Int, Field(ge=1)] = 1  # pipeline parallel size: layers split into stages (DeepSpeed pipeline)
    zero_stage: Annotated[Literal[0, 1, 2], IntChoice] = 1  # DeepSpeed ZeRO stage 0 | 1 | 2
    # the gradient reduction (DeepSpeed's zero_optimization; what takes effect where: megamemo/parallel/zero.py):
    # overlap it with the backward pass, bucket by bucket (ZeRO 1 or 2, no pipeline; not bf16 on ZeRO 1 with fp32
    # accumulation)
    overlap_comm: Bool = False
    # the gradient reduction's elements per bucket (ZeRO 1 or 2; null: DeepSpeed's 500,000,000)
    reduce_bucket_size: Annotated[Int, Field(ge=1)] | None = None
    # full: every rank builds the whole single-device model from train.seed and keeps its shard (any layout starts
    # from the same weights; needs host memory for the whole model per process); shard: each rank initialises only
    # its own shard (same distributions, weights depend on the layout); auto: full up to 5e8 parameters
    init: Literal["auto", "full", "shard"] = "auto"
    # a collective (the training's and evaluation's, DeepSpeed's and megatron-core's groups) that does not complete
    # within this fails: a hung or dead peer ends the job in minutes (the checkpoint commit has its own timeout)
    collective_timeout_s: Annotated[Float, Field(gt=0)] = 300.0
