"""The run configuration: typed dataclasses, loaded from one YAML file plus `--set a.b=value` overrides.

Every section is a dataclass; an unknown key or a value of the wrong type is a `ConfigError` naming the key
(`optim.lr: expected float, got str 'fast'`). The model section is megamemo.model.ModelConfig itself. The
resolved config (every default filled in) is written to `<run_dir>/config.yaml` by the trainer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megamemo.config.data import check_data_source
from megamemo.config.zero import problems as reduction_problems
from megamemo.util.typed import Switch, build
from megamemo.util.precision import NAMES as PRECISIONS

from .vocab import is_auto, resolve_auto   # model.n_token: auto -> the data's vocabulary, padded for parallel.tp


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it."""


@dataclass
class DataConfig:
    dir: str = ""                   # shard directory written by `megamemo prepare` (holds manifest.json)
    split: str = "train"
    batch_size: int = 22            # global batch B: contiguous streams (columns) over all data-parallel ranks
    roll: bool = False              # LaMemo's per-epoch, per-column seeded rotation of the streams
    seed: int = 1111                # seed of the roll offsets
    prefetch: int = 0               # background prefetch depth of the reader (0: none)
    # dir may be s3://bucket/prefix, gs://bucket/prefix or https://host/path (fsspec; pip install megamemo[s3] /
    # megamemo[gcs]); credentials only from the storage library's standard environment/config. Remote shards are
    # fetched whole into cache_dir ("" = $XDG_CACHE_HOME/megamemo/shards), verified against the manifest's sha256,
    # and evicted least-recently-used beyond cache_size (data_pipeline/remote.py)
    cache_dir: str = ""
    cache_size: str = "50G"
    retries: int = 5                # retries of a transient storage error (backoff doubling from retry_backoff_s)
    retry_backoff_s: float = 1.0
    fetch_threads: int = 4          # concurrent shard downloads of the read-ahead
    # weighted blend of shard directories (local and remote mixed) instead of dir: [{dir: ..., weight: ...}, ...]
    blend: list[dict] = field(default_factory=list)


@dataclass
class OptimConfig:
    name: str = "adam"              # adam | adamw (torch optimizers handed to DeepSpeed)
    lr: float = 2.5e-4              # the papers' setting
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool = True              # torch's fused Adam kernel (CPU and CUDA; ~3.5x faster than its per-tensor loop)
    clip: float = 0.25              # global gradient-norm clip (0 disables); DeepSpeed's own default would be 1.0
    schedule: str = "cosine"        # cosine (linear warmup, then cosine to min_lr) | constant (warmup, then flat)
    warmup_steps: int = 0
    decay_steps: int | None = None  # length of the cosine, warmup included; None: train.max_steps
    min_lr: float = 0.0
    half_loss: bool = False         # LaMemo's train_ddp optimises mean(nll) / 2


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"             # fp32 | bf16 | fp16 (fp16: dynamic loss scaling)
    initial_scale_power: int = 16   # fp16: first loss scale 2**power
    loss_scale_window: int = 1000   # fp16: raise the scale after this many steps without overflow
    hysteresis: int = 2             # fp16: overflows tolerated before the scale is lowered
    min_loss_scale: float = 1.0
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


@dataclass
class ParallelConfig:
    tp: int = 1                     # tensor parallel size: heads, FFN and vocabulary split (megatron-core)
    pp: int = 1                     # pipeline parallel size: layers split into stages (DeepSpeed pipeline)
    zero_stage: int = 1             # DeepSpeed ZeRO stage 0 | 1 | 2
    # the gradient reduction (DeepSpeed's zero_optimization; what takes effect where: megamemo/config/zero.py):
    # overlap it with the backward pass, bucket by bucket (ZeRO 1 or 2, no pipeline; not bf16 on ZeRO 1 with fp32
    # accumulation); elements per bucket (ZeRO 1 or 2; null: DeepSpeed's 500,000,000)
    overlap_comm: bool = False
    reduce_bucket_size: int | None = None
    # full: every rank builds the whole single-device model from train.seed and keeps its shard (any layout starts
    # from the same weights; needs host memory for the whole model per process); shard: each rank initialises only
    # its own shard (same distributions, weights depend on the layout); auto: full up to 5e8 parameters
    init: str = "auto"
    # a collective (the training's and evaluation's, DeepSpeed's and megatron-core's groups) that does not complete
    # within this fails: a hung or dead peer ends the job in minutes (the checkpoint commit has its own timeout)
    collective_timeout_s: float = 300.0


@dataclass
class TrainConfig:
    max_steps: int = 1000           # 0: build the run, save its initial state (checkpoint at step 0) and stop
    grad_accum: int = 1             # micro-batches per step on each rank, each with its own memory
    seed: int = 1111
    run_dir: str = "runs/default"
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
    compile_backend: str = "inductor"
    # Hang detection (runtime/watchdog.py): a rank whose step does not move for this long writes its threads' stacks
    # to its log, names the rank it waits for and exits with code 3 (retried by launch/local.sh --max-restarts and
    # train.sbatch). null: auto, 5 x hang_floor_s over a process's first steps (start-up, compilation), then 10 x
    # the slowest step seen, at least hang_floor_s; 0: no watchdog
    hang_timeout_s: float | None = None
    hang_floor_s: float = 120.0
    # stream: masks from each rank's RNG streams | keyed: every layout drops the same (megamemo/kernels/keyed.py)
    dropout_masks: str = "stream"


@dataclass
class CheckpointConfig:
    save_every: int = 1000          # steps between checkpoints (0: only at the end and on signals)
    keep_last: int = 3              # committed checkpoints kept (older ones are deleted)
    resume: str = "auto"            # auto: newest committed one in run_dir, if any | never | a step directory
    save_at_end: bool = True
    probe: bool = True              # record a small NLL probe with each checkpoint (convert checks itself on it)
    # copy the state to host memory, then write and commit in a background thread while training goes on (the
    # next save, a stop and the end of training wait for it); false: the step waits for the whole write
    async_save: bool = True
    # how long the ranks wait for each other's save outcome (megamemo/checkpoint/commit.py): a rank that neither
    # reports nor dies within it (a hung file system) fails the save on every rank; it must exceed the spread of
    # the ranks' write times (seconds at the rehearsal width here)
    commit_timeout_s: float = 600.0


@dataclass
class LogConfig:
    every: int = 10                 # a log line every N steps (metrics.jsonl gets every step)
    tensorboard: bool = True


@dataclass
class EvalConfig:
    every: int = 0                  # validate every N steps (0: never)
    split: str = "valid"
    batch_size: int = 16
    tgt_len: int | None = None      # None: the model's training lengths
    mem_len: int | None = None
    clamp_len: int | None = None
    same_length: bool | None = None
    max_segments: int = 0           # 0: the whole split


SECTIONS = {
    "data": DataConfig, "optim": OptimConfig, "precision": PrecisionConfig, "parallel": ParallelConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig, "eval": EvalConfig,
}


@dataclass
class RunConfig:
    model: Any                      # megamemo.model.ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # model.n_token was `auto` and resolved from the data (megamemo/config/vocab.py); not itself written out
    n_token_auto: bool = False

    def to_dict(self) -> dict:
        out = {"model": self.model.to_dict()}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def model_fingerprint(self) -> str:
        """Hash of the model config: checkpoints record it, resuming compares it."""
        blob = json.dumps(self.model.identity(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def validate(self) -> "RunConfig":
        def bad(name, why):
            raise ConfigError(f"{name}: {why} (got {_get(self, name)!r})")

        if self.data.batch_size < 1:
            bad("data.batch_size", "must be >= 1")
        check_data_source(self.data, ConfigError)
        if self.optim.name not in ("adam", "adamw"):
            bad("optim.name", "must be 'adam' or 'adamw'")
        if self.optim.lr <= 0:
            bad("optim.lr", "must be > 0")
        if len(self.optim.betas) != 2 or not all(0 <= b < 1 for b in self.optim.betas):
            bad("optim.betas", "must be two numbers in [0, 1)")
        if self.optim.clip < 0:
            bad("optim.clip", "must be >= 0 (0 disables clipping)")
        if self.optim.schedule not in ("cosine", "constant"):
            bad("optim.schedule", "must be 'cosine' or 'constant'")
        if self.optim.warmup_steps < 0:
            bad("optim.warmup_steps", "must be >= 0")
        if self.optim.decay_steps is not None and self.optim.decay_steps <= self.optim.warmup_steps:
            bad("optim.decay_steps", "must be larger than optim.warmup_steps")
        if not 0 <= self.optim.min_lr <= self.optim.lr:
            bad("optim.min_lr", "must be in [0, optim.lr]")
        if self.precision.dtype not in PRECISIONS:
            bad("precision.dtype", "must be fp32, bf16 or fp16")
        if self.precision.grad_accum_dtype not in ("auto", "fp32", "model"):
            bad("precision.grad_accum_dtype", "must be auto, fp32 or model")
        if (self.precision.grad_accum_dtype == "fp32" and self.precision.dtype != "fp32"
                and self.parallel.zero_stage == 0):
            bad("precision.grad_accum_dtype", "fp32 accumulation of bf16/fp16 gradients needs ZeRO 1 or 2 in "
                "DeepSpeed 0.19.8 (parallel.zero_stage=0); use auto or model")
        from megamemo.kernels import DROPOUT_MASKS
        if self.train.dropout_masks not in DROPOUT_MASKS:
            bad("train.dropout_masks", "must be stream or keyed")
        keyed = self.train.dropout_masks == "keyed"
        if self.train.activation_checkpointing and self.parallel.tp > 1 and self.model.dropout > 0 and not keyed:
            bad("train.activation_checkpointing", "with parallel.tp > 1 and model.dropout > 0 needs train.dropout_masks:"
                " keyed (recomputation would draw other TP masks from the stream), or model.dropout: 0, or tp 1")
        if keyed and not (0 <= self.train.seed < 2 ** 32 and self.model.n_layer <= 1024):
            bad("train.seed", "keyed dropout masks take a seed in [0, 2^32) and model.n_layer <= 1024")
        if self.precision.max_consecutive_skips < 1:
            bad("precision.max_consecutive_skips", "must be >= 1")
        if self.parallel.tp < 1:
            bad("parallel.tp", "must be >= 1")
        if self.parallel.pp < 1:
            bad("parallel.pp", "must be >= 1")
        from megamemo.parallel.pipeline import check_supported as pp_supported
        from megamemo.parallel.tensor import check_supported as tp_supported
        try:
            tp_supported(self.model, self.parallel.tp)
            pp_supported(self.model, self.parallel.pp)
        except ValueError as e:
            raise ConfigError(f"parallel: {e}") from None
        if self.parallel.pp > 1 and self.parallel.zero_stage > 1:
            bad("parallel.zero_stage", "pipeline parallelism works with ZeRO stage 0 or 1 (DeepSpeed)")
        if self.parallel.init not in ("auto", "full", "shard"):
            bad("parallel.init", "must be auto, full or shard")
        if self.parallel.zero_stage not in (0, 1, 2):
            bad("parallel.zero_stage", "must be 0, 1 or 2")
        for name, why in reduction_problems(self):
            bad(name, why)
        if self.train.max_steps < 0:
            bad("train.max_steps", "must be >= 0 (0: build, save the initial state and stop)")
        if self.train.grad_accum < 1:
            bad("train.grad_accum", "must be >= 1")
        from megamemo.kernels import KERNELS      # lazily, as the parallel checks above: torch is loaded by then
        if self.train.kernels not in KERNELS:
            bad("train.kernels", f"must be {', '.join(KERNELS[:-1])} or {KERNELS[-1]}")
        if self.model.attention == "flex" and self.model.dropatt > 0:
            bad("model.attention", f"flex cannot drop attention weights (model.dropatt={self.model.dropatt}): "
                                   f"use auto or eager, or dropatt 0")
        from megamemo.kernels.compiler import COMPILE
        if self.train.compile not in COMPILE:
            bad("train.compile", f"must be {', '.join(COMPILE[:-1])} or {COMPILE[-1]}")
        if self.train.compile_backend not in ("inductor", "aot_eager", "eager"):
            bad("train.compile_backend", "must be inductor, aot_eager or eager")
        if self.train.lock_stale_s < 60:
            bad("train.lock_stale_s", "must be >= 60 (two heartbeats at least)")
        if self.data.batch_size % self.train.grad_accum:
            bad("data.batch_size", f"must be divisible by train.grad_accum={self.train.grad_accum}")
        if self.checkpoint.save_every < 0:
            bad("checkpoint.save_every", "must be >= 0")
        if self.checkpoint.keep_last < 1:
            bad("checkpoint.keep_last", "must be >= 1")
        for name in ("checkpoint.commit_timeout_s", "parallel.collective_timeout_s", "train.hang_floor_s"):
            if not _get(self, name) > 0:
                bad(name, "must be > 0 seconds")
        if self.train.hang_timeout_s is not None and not self.train.hang_timeout_s >= 0:
            bad("train.hang_timeout_s", "must be >= 0 seconds (0: no watchdog; null: auto)")
        if self.log.every < 1:
            bad("log.every", "must be >= 1")
        if self.eval.every < 0:
            bad("eval.every", "must be >= 0")
        if self.eval.batch_size < 1:
            bad("eval.batch_size", "must be >= 1")
        for name in ("tgt_len", "mem_len"):
            v = getattr(self.eval, name)
            if v is not None and v < (1 if name == "tgt_len" else 0):
                bad(f"eval.{name}", "out of range")
        return self

    # ---- derived -------------------------------------------------------------------------------------------
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


def remote_options(d: DataConfig):
    """How s3:// gs:// https:// shard directories are read (data.cache_dir, data.cache_size, data.retries, ...)."""
    from data_pipeline.remote import RemoteOptions

    return RemoteOptions(cache_dir=d.cache_dir, cache_size=d.cache_size, retries=d.retries,
                         retry_backoff_s=d.retry_backoff_s, fetch_threads=d.fetch_threads,
                         log=lambda m: print(m, flush=True))


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ---- typed construction ------------------------------------------------------------------------------------
def _section(cls, data, where: str):
    return build(cls, data, where, ConfigError)


def from_dict(d: dict, source: str = "config") -> RunConfig:
    from megamemo.model import ModelConfig

    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    known = ["model", *SECTIONS]
    for key in d:
        if key not in known:
            raise ConfigError(f"{key}: unknown section in {source} (known: {', '.join(known)})")
    kwargs = {name: _section(cls, d.get(name), name) for name, cls in SECTIONS.items()}
    given = model_d = d.get("model") or {}
    if is_auto(given):
        data = kwargs["data"]
        model_d = resolve_auto(given, data, kwargs["parallel"].tp, ConfigError, remote_options(data))
    try:
        model = ModelConfig.from_dict(model_d, where="model")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunConfig(model=model, n_token_auto=model_d is not given, **kwargs).validate()


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """`a.b=value` strings applied to a nested dict; the value is parsed as YAML (`1`, `true`, `[1, 2]`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {key}: expected SECTION.FIELD, e.g. optim.lr")
        value = yaml.safe_load(raw) if raw.strip() else ""
        sec = d.setdefault(parts[0], {})
        if sec is None:
            sec = d[parts[0]] = {}
        if not isinstance(sec, dict):
            raise ConfigError(f"--set {key}: {parts[0]} is not a section")
        sec[parts[1]] = value
    return d


def load(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    d: dict = {}
    source = "overrides"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({e})") from None
        source = str(p)
    return from_dict(apply_overrides(d, list(overrides)), source)
