"""A training run's config: one YAML file per run (configs/), `--set section.key=value` overrides (`load`).

Its sections, in order: the model's (ModelConfig, megamemo/model/config.py), the data's (DataConfig,
megamemo/data/config.py), training's own - optim, precision, train, checkpoint (when and how the run saves), log and
eval (validation during training), defined and checked here - and the parallel layout's (ParallelConfig,
megamemo/parallel/config.py). megamemo/config/run.py composes them: typed building, `--set`, each section's checks.
`model.n_token: auto` takes the data's vocabulary, padded for parallel.tp (train/vocab.py). The trainer writes the
resolved config (every default filled in) to `<run_dir>/config.yaml`.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megamemo.data.config import DataConfig
from megamemo.config.run import ConfigError, Run, check_sections, read, section
from megamemo.model import ModelConfig
from megamemo.parallel.config import ParallelConfig
from megamemo.util.precision import NAMES as PRECISIONS
from megamemo.util.typed import Switch

from .vocab import is_auto, resolve_auto


@dataclass
class OptimConfig:
    name: str = "adam"              # adam | adamw (torch optimizers handed to DeepSpeed)
    lr: float = 2.5e-4              # the papers' setting
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's decay rates of its moments
    eps: float = 1e-8               # Adam's epsilon, added to the second moment's root
    weight_decay: float = 0.0       # weight decay (adamw: decoupled; adam: L2 in the gradient)
    fused: bool = True              # torch's fused Adam kernel (CPU and CUDA; ~3.5x faster than its per-tensor loop)
    clip: float = 0.25              # global gradient-norm clip (0 disables); DeepSpeed's own default would be 1.0
    schedule: str = "cosine"        # cosine (linear warmup, then cosine to min_lr) | constant (warmup, then flat)
    warmup_steps: int = 0           # steps of linear warmup from 0 to lr
    decay_steps: int | None = None  # length of the cosine, warmup included; None: train.max_steps
    min_lr: float = 0.0             # the learning rate the cosine ends at
    half_loss: bool = False         # LaMemo's train_ddp optimises mean(nll) / 2

    def check(self, run, bad) -> None:
        if self.name not in ("adam", "adamw"):
            bad("optim.name", "must be 'adam' or 'adamw'")
        if self.lr <= 0:
            bad("optim.lr", "must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("optim.betas", "must be two numbers in [0, 1)")
        if self.clip < 0:
            bad("optim.clip", "must be >= 0 (0 disables clipping)")
        if self.schedule not in ("cosine", "constant"):
            bad("optim.schedule", "must be 'cosine' or 'constant'")
        if self.warmup_steps < 0:
            bad("optim.warmup_steps", "must be >= 0")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            bad("optim.decay_steps", "must be larger than optim.warmup_steps")
        if not 0 <= self.min_lr <= self.lr:
            bad("optim.min_lr", "must be in [0, optim.lr]")


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"             # fp32 | bf16 | fp16 (fp16: dynamic loss scaling)
    initial_scale_power: int = 16   # fp16: first loss scale 2**power
    loss_scale_window: int = 1000   # fp16: raise the scale after this many steps without overflow
    hysteresis: int = 2             # fp16: overflows tolerated before the scale is lowered
    min_loss_scale: float = 1.0     # fp16: the loss scale is never lowered below this
    # Gradient accumulation over micro-batches (bf16/fp16): fp32 | model | auto. DeepSpeed 0.19.8 accumulates in
    # fp32 with ZeRO 2 (both half types) and ZeRO 1 + fp16 in its ZeRO optimizer, with ZeRO 1 + bf16 through its
    # BF16_Optimizer (pipelines included), and not at all without ZeRO. auto: fp32 wherever ZeRO is on, the model
    # dtype on ZeRO 0; fp32: the same, and a config error on ZeRO 0 (train/engine.py grad_accum_dtype).
    grad_accum_dtype: str = "auto"
    # fp32 runs on NVIDIA GPUs (Ampere and later): let matmuls and convolutions use TF32 tensor cores (10-bit
    # mantissa products, fp32 accumulation; several times faster). Off by default: fp32 then means fp32.
    allow_tf32: bool = False
    # An overflowing step is skipped and retried on the same batch with the lowered scale; this many skips
    # in a row means the run diverged (e.g. a NaN loss) and stops with an error.
    max_consecutive_skips: int = 40

    def check(self, run, bad) -> None:
        if self.dtype not in PRECISIONS:
            bad("precision.dtype", "must be fp32, bf16 or fp16")
        if self.grad_accum_dtype not in ("auto", "fp32", "model"):
            bad("precision.grad_accum_dtype", "must be auto, fp32 or model")
        if self.grad_accum_dtype == "fp32" and self.dtype != "fp32" and run.parallel.zero_stage == 0:
            bad("precision.grad_accum_dtype", "fp32 accumulation of bf16/fp16 gradients needs ZeRO 1 or 2 in "
                "DeepSpeed 0.19.8 (parallel.zero_stage=0); use auto or model")
        if self.max_consecutive_skips < 1:
            bad("precision.max_consecutive_skips", "must be >= 1")


@dataclass
class SpikeConfig:
    """train.spike: a loss spike (megamemo/train/numerics.py SpikeWatch). A step's loss (the global batch's mean) is a
    spike when it is not finite, or, once `window` applied steps are known, when its z-score over them (rule zscore)
    or its ratio to their median (rule ratio) exceeds `threshold`. stop: the run stops (exit 1, like a diverged run);
    rollback: every rank resumes from the newest checkpoint before the spike and skips `skip_batches` batches of every
    stream from the spike's batch on, recorded in interruptions.jsonl (the run stays replayable), at most
    `max_rollbacks` times per run."""
    rule: str = "off"               # off | zscore | ratio
    window: int = 50                # applied steps the rule compares a loss with
    threshold: float | None = None  # None: 6 (zscore: standard deviations above the mean) or 2 (ratio to the median)
    action: str = "rollback"        # stop | rollback
    skip_batches: int = 200         # rollback: batches of every stream skipped from the spike's on (PaLM: 200-500)
    max_rollbacks: int = 3          # rollback: after this many the run stops (with one line)

    def limit(self) -> float:
        return self.threshold if self.threshold is not None else (6.0 if self.rule == "zscore" else 2.0)

    def check(self, bad) -> None:
        if self.rule not in ("off", "zscore", "ratio"):
            bad("train.spike.rule", "must be off, zscore or ratio")
        if self.window < 2:
            bad("train.spike.window", "must be >= 2 steps")
        if self.threshold is not None and not (self.threshold > (1.0 if self.rule == "ratio" else 0.0)):
            bad("train.spike.threshold", "must be > 0 (zscore) or > 1 (ratio)")
        if self.action not in ("stop", "rollback"):
            bad("train.spike.action", "must be stop or rollback")
        if self.skip_batches < 0:
            bad("train.spike.skip_batches", "must be >= 0")
        if self.max_rollbacks < 0:
            bad("train.spike.max_rollbacks", "must be >= 0")


@dataclass
class TrainConfig:
    max_steps: int = 1000           # 0: build the run, save its initial state (checkpoint at step 0) and stop
    grad_accum: int = 1             # micro-batches per step on each rank, each with its own memory
    seed: int = 1111                # seed of the weights' initialisation and the dropout masks
    run_dir: str = "runs/default"   # checkpoints, config.yaml, metrics.jsonl and logs (--run-dir)
    # <run_dir>/LOCK of a trainer on another host counts as dead after this long without a heartbeat (one every
    # 30 s); on the same host a lock is dead when its process is gone
    lock_stale_s: float = 600.0
    # Bit-exact runs on CUDA: torch's deterministic kernels, CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO=Ring and no NVLS
    # (runtime/device.py). Slower; CPU runs are deterministic without it.
    deterministic: bool = False
    # Recompute each layer's activations in the backward pass instead of keeping them (less memory, about one
    # more forward of compute). Without a pipeline torch.utils.checkpoint wraps every layer; with one, DeepSpeed's
    # PipelineModule recomputes every layer (activation_checkpoint_interval 1). `megamemo plan` counts it.
    activation_checkpointing: bool = False
    # CPU kernels (megamemo/kernels/: a cheaper dropout mask, ReLU+dropout in one pass, the attention mask as a
    # bias): auto | plain | cpu. auto: cpu on a CPU device, plain (torch's own dropout and masked_fill) on CUDA.
    # Not a model field: the model's config is its identity (checkpoints compare it on resume), this is not.
    kernels: str = "auto"
    # Regional torch.compile of every decoder layer (megamemo/kernels/compiler.py): auto | on | off. auto: on for
    # CUDA, off on the CPU (where it measured slower than the CPU kernels). compile_backend: torch.compile's
    # backend (inductor; aot_eager traces without generating code, for debugging).
    compile: Switch = "auto"
    compile_backend: str = "inductor" # torch.compile's backend for compiled layers (inductor, aot_eager)
    # Hang detection (runtime/watchdog.py): a rank whose step does not move for this long writes its threads' stacks
    # to its log, names the rank it waits for and exits with code 3 (retried by launch/local.sh --max-restarts and
    # train.sbatch). null: auto, 5 x hang_floor_s over a process's first steps (start-up, compilation), then 10 x
    # the slowest step seen, at least hang_floor_s; 0: no watchdog
    hang_timeout_s: float | None = None
    hang_floor_s: float = 120.0     # the least time the watchdog waits (see hang_timeout_s)
    # stream: masks from each rank's RNG streams | keyed: every layout drops the same (megamemo/kernels/keyed.py)
    dropout_masks: str = "stream"
    # Replica agreement (megamemo/train/numerics.py): every N applied steps, and before every checkpoint, the
    # data-parallel replicas compare a fingerprint of what they hold alike (one small all-gather); a mismatch stops the
    # run as node-suspect (exit 5). null: at the checkpoints only (checkpoint.save_every); 0: never
    replica_check_every: int | None = None
    # Loss spikes (megamemo/train/numerics.py SpikeWatch): the rule (off | zscore | ratio over a running window),
    # its threshold and what a spike does (stop, or rollback past its data, recorded in interruptions.jsonl)
    spike: SpikeConfig = field(default_factory=SpikeConfig)

    def check(self, run, bad) -> None:
        """Also the speed switches against what megamemo/kernels/ offers (imported here: torch is loaded by then),
        and the dropout masks against the layout (run.parallel, run.model)."""
        from megamemo.kernels import DROPOUT_MASKS, KERNELS
        from megamemo.kernels.compiler import COMPILE

        if self.dropout_masks not in DROPOUT_MASKS:
            bad("train.dropout_masks", "must be stream or keyed")
        keyed = self.dropout_masks == "keyed"
        if self.activation_checkpointing and run.parallel.tp > 1 and run.model.dropout > 0 and not keyed:
            bad("train.activation_checkpointing", "with parallel.tp > 1 and model.dropout > 0 needs train.dropout_masks:"
                " keyed (recomputation would draw other TP masks from the stream), or model.dropout: 0, or tp 1")
        if keyed and not (0 <= self.seed < 2 ** 32 and run.model.n_layer <= 1024):
            bad("train.seed", "keyed dropout masks take a seed in [0, 2^32) and model.n_layer <= 1024")
        if self.max_steps < 0:
            bad("train.max_steps", "must be >= 0 (0: build, save the initial state and stop)")
        if self.grad_accum < 1:
            bad("train.grad_accum", "must be >= 1")
        if self.kernels not in KERNELS:
            bad("train.kernels", f"must be {', '.join(KERNELS[:-1])} or {KERNELS[-1]}")
        if self.compile not in COMPILE:
            bad("train.compile", f"must be {', '.join(COMPILE[:-1])} or {COMPILE[-1]}")
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            bad("train.compile_backend", "must be inductor, aot_eager or eager")
        if self.lock_stale_s < 60:
            bad("train.lock_stale_s", "must be >= 60 (two heartbeats at least)")
        if run.data.batch_size % self.grad_accum:
            bad("data.batch_size", f"must be divisible by train.grad_accum={self.grad_accum}")
        if not self.hang_floor_s > 0:
            bad("train.hang_floor_s", "must be > 0 seconds")
        if self.hang_timeout_s is not None and not self.hang_timeout_s >= 0:
            bad("train.hang_timeout_s", "must be >= 0 seconds (0: no watchdog; null: auto)")
        if self.replica_check_every is not None and self.replica_check_every < 0:
            bad("train.replica_check_every", "must be >= 0 steps (0: never; null: at every checkpoint)")
        self.spike.check(bad)


@dataclass
class CheckpointConfig:
    save_every: int = 1000          # steps between checkpoints (0: only at the end and on signals)
    keep_last: int = 3              # committed checkpoints kept (older ones are deleted)
    resume: str = "auto"            # auto: newest committed one in run_dir, if any | never | a step directory
    save_at_end: bool = True        # a checkpoint at the last step, whatever save_every says
    probe: bool = True              # record a small NLL probe with each checkpoint (convert checks itself on it)
    # copy the state to host memory, then write and commit in a background thread while training goes on (the
    # next save, a stop and the end of training wait for it); false: the step waits for the whole write
    async_save: bool = True
    # how long the ranks wait for each other's save outcome (megamemo/checkpoint/commit.py): a rank that neither
    # reports nor dies within it (a hung file system) fails the save on every rank; it must exceed the spread of
    # the ranks' write times (seconds at the rehearsal width here)
    commit_timeout_s: float = 600.0

    def check(self, run, bad) -> None:
        if self.save_every < 0:
            bad("checkpoint.save_every", "must be >= 0")
        if self.keep_last < 1:
            bad("checkpoint.keep_last", "must be >= 1")
        if not self.commit_timeout_s > 0:
            bad("checkpoint.commit_timeout_s", "must be > 0 seconds")


@dataclass
class LogConfig:
    every: int = 10                 # a log line every N steps (metrics.jsonl gets every step)
    tensorboard: bool = True        # also write TensorBoard event files under run_dir

    def check(self, run, bad) -> None:
        if self.every < 1:
            bad("log.every", "must be >= 1")


@dataclass
class EvalConfig:
    every: int = 0                  # validate every N steps (0: never)
    split: str = "valid"            # the split validation scores
    batch_size: int = 16            # validation's streams, over all data-parallel ranks
    tgt_len: int | None = None      # validation's segment length (None: model.tgt_len)
    mem_len: int | None = None      # validation's memory rows (None: model.mem_len)
    clamp_len: int | None = None    # validation's clamp of distances (None: model.clamp_len)
    same_length: bool | None = None     # validation's same_length (None: model.same_length)
    max_segments: int = 0           # 0: the whole split

    def check(self, run, bad) -> None:
        if self.every < 0:
            bad("eval.every", "must be >= 0")
        if self.batch_size < 1:
            bad("eval.batch_size", "must be >= 1")
        for name in ("tgt_len", "mem_len"):
            v = getattr(self, name)
            if v is not None and v < (1 if name == "tgt_len" else 0):
                bad(f"eval.{name}", "out of range")


# the sections besides the model's, in the order a config lists them (docs/reference/config.md follows it)
SECTIONS = {
    "data": DataConfig, "optim": OptimConfig, "precision": PrecisionConfig, "parallel": ParallelConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig, "eval": EvalConfig,
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
                f"train.grad_accum={self.train.grad_accum} micro-batches (needs a multiple of {per})")
        if self.eval.every and self.eval.batch_size % dp:
            raise ConfigError(f"eval.batch_size: {self.eval.batch_size} streams do not split over {dp} "
                              f"data-parallel ranks")
        return dp, self.data.batch_size // per


def from_dict(d: dict, source: str = "config", vocab_fallback: int | None = None) -> RunConfig:
    """The run's config from plain data (a YAML file's mapping), validated. vocab_fallback: the vocabulary a
    `model.n_token: auto` takes where its local data directory has no manifest yet (planning: train/vocab.py)."""
    check_sections(d, ["model", *SECTIONS], source)
    kwargs = {name: section(cls, d.get(name), name) for name, cls in SECTIONS.items()}
    given = model_d = d.get("model") or {}
    if is_auto(given):
        model_d = resolve_auto(given, kwargs["data"], kwargs["parallel"].tp, vocab_fallback)
    return RunConfig(model=section(ModelConfig, model_d, "model"), n_token_auto=model_d is not given,
                     **kwargs).validate()


def load(path: str | Path | None, overrides: Sequence[str] = (), vocab_fallback: int | None = None) -> RunConfig:
    """The config file `path` (None: defaults) with `--set` overrides applied, validated (vocab_fallback: from_dict)."""
    d, source = read(path, overrides)
    return from_dict(d, source, vocab_fallback)
