"""A training run's config: one YAML file per run (configs/), `--set section.key=value` overrides (`load`).

Its sections, in order: the model's (ModelConfig, megamemo/model/config.py), the data's (DataConfig,
megamemo/data/config.py), training's own - optim, precision, train, checkpoint (when and how the run saves), log and
eval (validation during training), defined and checked here - and the parallel layout's (ParallelConfig,
megamemo/parallel/config.py). Each is declared (megamemo/config/fields.py: types, Literal choices, Field bounds,
a section's own rules in its model_validator); megamemo/config/run.py composes them (`--set`, one-line errors), and
the rules across sections are RunConfig.check's, here.
`model.n_token: auto` takes the data's vocabulary, padded for parallel.tp (train/vocab.py). The trainer writes the
resolved config (every default filled in) to `<run_dir>/config.yaml`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import model_validator

from megamemo.config.fields import Bool, Field, Float, Int, Switch, section
from megamemo.config.run import ConfigError, Run, check_sections, read, refusal
from megamemo.config.run import section as build_section
from megamemo.data.config import DataConfig
from megamemo.model import ModelConfig
from megamemo.parallel.config import ParallelConfig

from .vocab import is_auto, resolve_auto


@section("optim")
class OptimConfig:
    name: Literal["adam", "adamw"] = "adam"  # adam | adamw (torch optimizers handed to DeepSpeed)
    lr: Annotated[Float, Field(gt=0)] = 2.5e-4  # the papers' setting
    # Adam's decay rates of its moments
    betas: Annotated[list[Annotated[Float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = field(
        default_factory=lambda: [0.9, 0.999]
    )
    eps: Float = 1e-8  # Adam's epsilon, added to the second moment's root
    weight_decay: Float = 0.0  # weight decay (adamw: decoupled; adam: L2 in the gradient)
    fused: Bool = True  # torch's fused Adam kernel (CPU and CUDA; ~3.5x faster than its per-tensor loop)
    # global gradient-norm clip (0 disables); DeepSpeed's own default would be 1.0
    clip: Annotated[Float, Field(ge=0)] = 0.25
    # cosine (linear warmup, then cosine to min_lr) | constant (warmup, then flat)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: Annotated[Int, Field(ge=0)] = 0  # steps of linear warmup from 0 to lr
    decay_steps: Int | None = None  # length of the cosine, warmup included; None: train.max_steps
    min_lr: Annotated[Float, Field(ge=0)] = 0.0  # the learning rate the cosine ends at
    half_loss: Bool = False  # LaMemo's train_ddp optimises mean(nll) / 2

    @model_validator(mode="after")
    def _rules(self) -> OptimConfig:
        bad = refusal(self, "optim")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            bad("optim.decay_steps", "must be larger than optim.warmup_steps")
        if not self.min_lr <= self.lr:
            bad("optim.min_lr", "must be in [0, optim.lr]")
        return self


@section("precision")
class PrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp32 | bf16 | fp16 (fp16: dynamic loss scaling)
    initial_scale_power: Int = 16  # fp16: first loss scale 2**power
    loss_scale_window: Int = 1000  # fp16: raise the scale after this many steps without overflow
    hysteresis: Int = 2  # fp16: overflows tolerated before the scale is lowered
    min_loss_scale: Float = 1.0  # fp16: the loss scale is never lowered below this
    # Gradient accumulation over micro-batches (bf16/fp16): fp32 | model | auto. DeepSpeed 0.19.8 accumulates in
    # fp32 with ZeRO 2 (both half types) and ZeRO 1 + fp16 in its ZeRO optimizer, with ZeRO 1 + bf16 through its
    # BF16_Optimizer (pipelines included), and not at all without ZeRO. auto: fp32 wherever ZeRO is on, the model
    # dtype on ZeRO 0; fp32: the same, and a config error on ZeRO 0 (train/engine.py grad_accum_dtype).
    grad_accum_dtype: Literal["auto", "fp32", "model"] = "auto"
    # fp32 runs on NVIDIA GPUs (Ampere and later): let matmuls and convolutions use TF32 tensor cores (10-bit
    # mantissa products, fp32 accumulation; several times faster). Off by default: fp32 then means fp32.
    allow_tf32: Bool = False
    # An overflowing step is skipped and retried on the same batch with the lowered scale; this many skips
    # in a row means the run diverged (e.g. a NaN loss) and stops with an error.
    max_consecutive_skips: Annotated[Int, Field(ge=1)] = 40


@section("train.spike")
class SpikeConfig:
    """train.spike: a loss spike (megamemo/train/numerics.py SpikeWatch). A step's loss (the global batch's mean) is a
    spike when it is not finite, or, once `window` applied steps are known, when its z-score over them (rule zscore)
    or its ratio to their median (rule ratio) exceeds `threshold`. stop: the run stops (exit 1, like a diverged run);
    rollback: every rank resumes from the newest checkpoint before the spike and skips `skip_batches` batches of every
    stream from the spike's batch on, recorded in interruptions.jsonl (the run stays replayable), at most
    `max_rollbacks` times per run."""

    rule: Literal["off", "zscore", "ratio"] = "off"  # off | zscore | ratio
    window: Annotated[Int, Field(ge=2)] = 50  # applied steps the rule compares a loss with
    threshold: Float | None = None  # None: 6 (zscore: standard deviations above the mean) or 2 (ratio to the median)
    action: Literal["stop", "rollback"] = "rollback"  # stop | rollback
    # rollback: batches of every stream skipped from the spike's on (PaLM: 200-500)
    skip_batches: Annotated[Int, Field(ge=0)] = 200
    max_rollbacks: Annotated[Int, Field(ge=0)] = 3  # rollback: after this many the run stops (with one line)

    def limit(self) -> float:
        return self.threshold if self.threshold is not None else (6.0 if self.rule == "zscore" else 2.0)

    @model_validator(mode="after")
    def _rules(self) -> SpikeConfig:
        if self.threshold is not None and not (self.threshold > (1.0 if self.rule == "ratio" else 0.0)):
            refusal(self, "train.spike")("train.spike.threshold", "must be > 0 (zscore) or > 1 (ratio)")
        return self


@section("train")
class TrainConfig:
    # 0: build the run, save its initial state (checkpoint at step 0) and stop
    max_steps: Annotated[Int, Field(ge=0)] = 1000
    grad_accum: Annotated[Int, Field(ge=1)] = 1  # micro-batches per step on each rank, each with its own memory
    seed: Int = 1111  # seed of the weights' initialisation and the dropout masks
    run_dir: str = "runs/default"  # checkpoints, config.yaml, metrics.jsonl and logs (--run-dir)
    # <run_dir>/LOCK of a trainer on another host counts as dead after this long without a heartbeat (one every
    # 30 s); on the same host a lock is dead when its process is gone
    lock_stale_s: Annotated[Float, Field(ge=60)] = 600.0
    # Bit-exact runs on CUDA: torch's deterministic kernels, CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO=Ring and no NVLS
    # (runtime/device.py). Slower; CPU runs are deterministic without it.
    deterministic: Bool = False
    # Recompute each layer's activations in the backward pass instead of keeping them (less memory, about one
    # more forward of compute). Without a pipeline torch.utils.checkpoint wraps every layer; with one, DeepSpeed's
    # PipelineModule recomputes every layer (activation_checkpoint_interval 1). `megamemo plan` counts it.
    activation_checkpointing: Bool = False
    # CPU kernels (megamemo/kernels/: a cheaper dropout mask, ReLU+dropout in one pass, the attention mask as a
    # bias): auto | plain | cpu. auto: cpu on a CPU device, plain (torch's own dropout and masked_fill) on CUDA.
    # Not a model field: the model's config is its identity (checkpoints compare it on resume), this is not.
    kernels: Literal["auto", "plain", "cpu"] = "auto"
    # Regional torch.compile of every decoder layer (megamemo/kernels/compiler.py): auto | on | off. auto: on for
    # CUDA, off on the CPU (where it measured slower than the CPU kernels). compile_backend: torch.compile's
    # backend (inductor; aot_eager traces without generating code, for debugging).
    compile: Switch = "auto"
    # torch.compile's backend for compiled layers (inductor, aot_eager)
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # Hang detection (runtime/watchdog.py): a rank whose step does not move for this long writes its threads' stacks
    # to its log, names the rank it waits for and exits with code 3 (retried by launch/local.sh --max-restarts and
    # train.sbatch). null: auto, 5 x hang_floor_s over a process's first steps (start-up, compilation), then 10 x
    # the slowest step seen, at least hang_floor_s; 0: no watchdog
    hang_timeout_s: Annotated[Float, Field(ge=0)] | None = None
    hang_floor_s: Annotated[Float, Field(gt=0)] = 120.0  # the least time the watchdog waits (see hang_timeout_s)
    # stream: masks from each rank's RNG streams | keyed: every layout drops the same (megamemo/kernels/keyed.py)
    dropout_masks: Literal["stream", "keyed"] = "stream"
    # Replica agreement (megamemo/train/numerics.py): every N applied steps, and before every checkpoint, the
    # data-parallel replicas compare a fingerprint of what they hold alike (one small all-gather); a mismatch stops the
    # run as node-suspect (exit 5). null: at the checkpoints only (checkpoint.save_every); 0: never
    replica_check_every: Annotated[Int, Field(ge=0)] | None = None
    # Loss spikes (megamemo/train/numerics.py SpikeWatch): the rule (off | zscore | ratio over a running window),
    # its threshold and what a spike does (stop, or rollback past its data, recorded in interruptions.jsonl)
    spike: SpikeConfig = field(default_factory=SpikeConfig)


@section("checkpoint")
class CheckpointConfig:
    save_every: Annotated[Int, Field(ge=0)] = 1000  # steps between checkpoints (0: only at the end and on signals)
    keep_last: Annotated[Int, Field(ge=1)] = 3  # committed checkpoints kept (older ones are deleted)
    resume: str = "auto"  # auto: newest committed one in run_dir, if any | never | a step directory
    save_at_end: Bool = True  # a checkpoint at the last step, whatever save_every says
    probe: Bool = True  # record a small NLL probe with each checkpoint (convert checks itself on it)
    # copy the state to host memory, then write and commit in a background thread while training goes on (the
    # next save, a stop and the end of training wait for it); false: the step waits for the whole write
    async_save: Bool = True
    # how long the ranks wait for each other's save outcome (megamemo/checkpoint/commit.py): a rank that neither
    # reports nor dies within it (a hung file system) fails the save on every rank; it must exceed the spread of
    # the ranks' write times (seconds at the rehearsal width here)
    commit_timeout_s: Annotated[Float, Field(gt=0)] = 600.0


@section("log")
class LogConfig:
    every: Annotated[Int, Field(ge=1)] = 10  # a log line every N steps (metrics.jsonl gets every step)
    tensorboard: Bool = True  # also write TensorBoard event files under run_dir


@section("eval")
class EvalConfig:
    every: Annotated[Int, Field(ge=0)] = 0  # validate every N steps (0: never)
    split: str = "valid"  # the split validation scores
    batch_size: Annotated[Int, Field(ge=1)] = 16  # validation's streams, over all data-parallel ranks
    tgt_len: Annotated[Int, Field(ge=1)] | None = None  # validation's segment length (None: model.tgt_len)
    mem_len: Annotated[Int, Field(ge=0)] | None = None  # validation's memory rows (None: model.mem_len)
    clamp_len: Int | None = None  # validation's clamp of distances (None: model.clamp_len)
    same_length: Bool | None = None  # validation's same_length (None: model.same_length)
    max_segments: Annotated[Int, Field(ge=0)] = 0  # 0: the whole split


# the sections besides the model's, in the order a config lists them (docs/reference/config.md follows it)
SECTIONS = {
    "data": DataConfig,
    "optim": OptimConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "eval": EvalConfig,
}


@dataclass
class RunConfig(Run):
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # model.n_token was `auto` and resolved from the data (train/vocab.py); not itself written out
    n_token_auto: bool = False

    def model_fingerprint(self) -> str:
        """Hash of the model config: checkpoints record it, resuming compares it."""
        blob = json.dumps(self.model.identity(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def check(self, bad) -> None:
        """The rules across sections (each section's own were kept when it was built): the layout against the model
        (parallel/tensor.py, parallel/pipeline.py), ZeRO's settings against what DeepSpeed applies (parallel/zero.py),
        the dropout masks against the layout, the batch against the accumulation."""
        from megamemo.parallel.pipeline import check_supported as pp_supported  # torch: loaded by now
        from megamemo.parallel.tensor import check_supported as tp_supported
        from megamemo.parallel.zero import problems as reduction_problems

        model, par, prec, train = self.model, self.parallel, self.precision, self.train
        if model.attention in ("flex", "fused") and model.dropatt > 0:
            bad(
                "model.attention",
                f"{model.attention} cannot drop attention weights (model.dropatt={model.dropatt}): "
                f"use auto or eager, or dropatt 0",
            )
        try:
            tp_supported(model, par.tp)
            pp_supported(model, par.pp)
        except ValueError as e:
            raise ConfigError(f"parallel: {e}") from None
        if par.pp > 1 and par.zero_stage > 1:
            bad("parallel.zero_stage", "pipeline parallelism works with ZeRO stage 0 or 1 (DeepSpeed)")
        if prec.grad_accum_dtype == "fp32" and prec.dtype != "fp32" and par.zero_stage == 0:
            bad(
                "precision.grad_accum_dtype",
                "fp32 accumulation of bf16/fp16 gradients needs ZeRO 1 or 2 in "
                "DeepSpeed 0.19.8 (parallel.zero_stage=0); use auto or model",
            )
        for name, why in reduction_problems(par, prec, train.grad_accum):
            bad(name, why)
        keyed = train.dropout_masks == "keyed"
        if train.activation_checkpointing and par.tp > 1 and model.dropout > 0 and not keyed:
            bad(
                "train.activation_checkpointing",
                "with parallel.tp > 1 and model.dropout > 0 needs "
                "train.dropout_masks: keyed (recomputation would draw other TP masks from the stream), or "
                "model.dropout: 0, or tp 1",
            )
        if keyed and not (0 <= train.seed < 2**32 and model.n_layer <= 1024):
            bad("train.seed", "keyed dropout masks take a seed in [0, 2^32) and model.n_layer <= 1024")
        if self.data.batch_size % train.grad_accum:
            bad("data.batch_size", f"must be divisible by train.grad_accum={train.grad_accum}")

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps or self.train.max_steps

    def layout(self, world_size: int) -> tuple[int, int]:
        """(data-parallel size, columns per micro-batch) for `world_size` processes; a clear error if the
        global batch does not split evenly."""
        mp = self.parallel.tp * self.parallel.pp
        if world_size % mp:
            raise ConfigError(f"parallel: world size {world_size} is not divisible by tp*pp={mp}")
        dp = world_size // mp
        per = dp * self.train.grad_accum
        if self.data.batch_size % per:
            raise ConfigError(
                f"data.batch_size: {self.data.batch_size} streams do not split over {dp} data-parallel ranks x "
                f"train.grad_accum={self.train.grad_accum} micro-batches (needs a multiple of {per})"
            )
        if self.eval.every and self.eval.batch_size % dp:
            raise ConfigError(
                f"eval.batch_size: {self.eval.batch_size} streams do not split over {dp} data-parallel ranks"
            )
        return dp, self.data.batch_size // per


def from_dict(d: dict, source: str = "config", vocab_fallback: int | None = None) -> RunConfig:
    """The run's config from plain data (a YAML file's mapping), validated. vocab_fallback: the vocabulary a
    `model.n_token: auto` takes where its local data directory has no manifest yet (planning: train/vocab.py)."""
    check_sections(d, ["model", *SECTIONS], source)
    kwargs = {name: build_section(cls, d.get(name), name) for name, cls in SECTIONS.items()}
    given = model_d = d.get("model") or {}
    if is_auto(given):
        model_d = resolve_auto(given, kwargs["data"], kwargs["parallel"].tp, vocab_fallback)
    return RunConfig(
        model=build_section(ModelConfig, model_d, "model"), n_token_auto=model_d is not given, **kwargs
    ).validate()


def load(path: str | Path | None, overrides: Sequence[str] = (), vocab_fallback: int | None = None) -> RunConfig:
    """The config file `path` (None: defaults) with `--set` overrides applied, validated (vocab_fallback: from_dict)."""
    d, source = read(path, overrides)
    return from_dict(d, source, vocab_fallback)
