"""The parallel section of a run config (`parallel.*`): the TP x PP x DP layout, ZeRO and its gradient reduction,
how a sharded model is initialised, and the collectives' time limit. Checked here against the model (what tensor.py
and pipeline.py can split) and against what DeepSpeed applies (zero.py)."""
from __future__ import annotations

from dataclasses import dataclass

from megamemo.config.run import ConfigError

from .zero import problems as reduction_problems


@dataclass
class ParallelConfig:
    tp: int = 1                     # tensor parallel size: heads, FFN and vocabulary split (megatron-core)
    pp: int = 1                     # pipeline parallel size: layers split into stages (DeepSpeed pipeline)
    zero_stage: int = 1             # DeepSpeed ZeRO stage 0 | 1 | 2
    # the gradient reduction (DeepSpeed's zero_optimization; what takes effect where: megamemo/parallel/zero.py):
    # overlap it with the backward pass, bucket by bucket (ZeRO 1 or 2, no pipeline; not bf16 on ZeRO 1 with fp32
    # accumulation)
    overlap_comm: bool = False
    # the gradient reduction's elements per bucket (ZeRO 1 or 2; null: DeepSpeed's 500,000,000)
    reduce_bucket_size: int | None = None
    # full: every rank builds the whole single-device model from train.seed and keeps its shard (any layout starts
    # from the same weights; needs host memory for the whole model per process); shard: each rank initialises only
    # its own shard (same distributions, weights depend on the layout); auto: full up to 5e8 parameters
    init: str = "auto"
    # a collective (the training's and evaluation's, DeepSpeed's and megatron-core's groups) that does not complete
    # within this fails: a hung or dead peer ends the job in minutes (the checkpoint commit has its own timeout)
    collective_timeout_s: float = 300.0

    def check(self, run, bad) -> None:
        """The layout against the model (run.model) and ZeRO's settings against what DeepSpeed applies (reading
        run.precision too)."""
        if self.tp < 1:
            bad("parallel.tp", "must be >= 1")
        if self.pp < 1:
            bad("parallel.pp", "must be >= 1")
        from .pipeline import check_supported as pp_supported     # torch: imported when a config is checked
        from .tensor import check_supported as tp_supported
        try:
            tp_supported(run.model, self.tp)
            pp_supported(run.model, self.pp)
        except ValueError as e:
            raise ConfigError(f"parallel: {e}") from None
        if self.pp > 1 and self.zero_stage > 1:
            bad("parallel.zero_stage", "pipeline parallelism works with ZeRO stage 0 or 1 (DeepSpeed)")
        if self.init not in ("auto", "full", "shard"):
            bad("parallel.init", "must be auto, full or shard")
        if self.zero_stage not in (0, 1, 2):
            bad("parallel.zero_stage", "must be 0, 1 or 2")
        for name, why in reduction_problems(run):
            bad(name, why)
        if not self.collective_timeout_s > 0:
            bad("parallel.collective_timeout_s", "must be > 0 seconds")
