"""DeepSpeed set-up: ZeRO 0/1/2 (optionally overlapping the gradient reduction with the backward pass), fp32 /
bf16 / fp16 (dynamic loss scaling), clipping, torch Adam, warmup + cosine schedule. Checkpoints never go through
DeepSpeed's own (pickled) files: train/resumable.py reads and fills the engine's objects for the checkpoint layer.

DeepSpeed facts this relies on (0.19.8, see shared/notes/stack-on-cpu.md):
  - `gradient_clipping` defaults to 1.0, so it is always set explicitly (0 = off);
  - a torch optimizer plus `zero_allow_untested_optimizer` avoids the fused-Adam JIT build;
  - the LR scheduler is stepped by DeepSpeed only on applied (non-overflow) steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megamemo.config.run import ConfigError
from megamemo.parallel.groups import grad_norm as tp_grad_norm
from megamemo.parallel.zero import fp32_accumulation
from megamemo.train.config import RunConfig


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR for the update that follows `step` applied updates: linear warmup over
    `warmup` updates, then cosine from 1 to min_ratio at `total` (the Transformer-XL / LaMemo schedule)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule(cfg: RunConfig):
    """The LambdaLR multiplier for cfg. A functools.partial: LambdaLR saves the __dict__ of callable objects in
    its state (so a resumed run would keep the old schedule); a partial's arguments stay out of it, and the
    schedule always follows the config (e.g. a larger train.max_steps on resume)."""
    return functools.partial(
        lr_factor,
        warmup=cfg.optim.warmup_steps,
        total=cfg.decay_steps,
        schedule=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr / cfg.optim.lr,
    )


def grad_accum_dtype(cfg: RunConfig) -> str | None:
    """DeepSpeed's data_types.grad_accum_dtype for cfg, or None for its default (the model dtype).

    DeepSpeed 0.19.8 (runtime/engine.py _do_optimizer_sanity_check, read for this): with ZeRO, bf16 + fp32
    accumulation + ZeRO 1 is its BF16_Optimizer, which sums every micro-batch's bf16 gradient into fp32 buffers
    (bf16_optimizer.py _update_hp_grad; the pipeline engine clears the bf16 gradients before each micro-batch's
    backward and adds them to the fp32 ones after it, pipe/engine.py _exec_backward_pass, so PP works too); any
    other half-precision ZeRO 1/2 case is its ZeRO optimizer, which accumulates in an fp32 `grad_accum`
    (zero/stage_1_and_2.py, gradient_accumulation_dtype). Without ZeRO it has none (NotImplementedError), so
    auto gives fp32 wherever ZeRO is on, with or without a pipeline, and the model dtype on ZeRO 0 (no shipped
    config is half precision on ZeRO 0; tests/train/test_grad_accum.py checks them all) - but bf16 on ZeRO 1 at
    grad_accum
    1 without a pipeline, which has nothing to accumulate and takes the model dtype so that DeepSpeed runs its ZeRO
    optimizer, whose reduction can overlap the backward (parallel/zero.py fp32_accumulation)."""
    return "fp32" if fp32_accumulation(cfg.parallel, cfg.precision, cfg.train.grad_accum) else None


def zero_optimization(cfg: RunConfig) -> dict:
    """DeepSpeed's zero_optimization section: the stage and, where the config sets them, the reduction's overlap
    with the backward pass and its bucket size (validated against what DeepSpeed applies: parallel/zero.py)."""
    out: dict[str, int | bool] = {"stage": cfg.parallel.zero_stage}
    if cfg.parallel.overlap_comm:
        out["overlap_comm"] = True
    if cfg.parallel.reduce_bucket_size is not None:
        out["reduce_bucket_size"] = cfg.parallel.reduce_bucket_size
    return out


def ds_config(cfg: RunConfig, micro_batch: int, dp: int) -> dict:
    p = cfg.precision
    out = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "train_batch_size": micro_batch * cfg.train.grad_accum * dp,
        "zero_optimization": zero_optimization(cfg),
        # pipeline stages send whole activations (not split across TP ranks): simple, and exact
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        "gradient_clipping": cfg.optim.clip,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": p.dtype == "bf16"},
        "fp16": {
            "enabled": p.dtype == "fp16",
            "loss_scale": 0,
            "initial_scale_power": p.initial_scale_power,
            "loss_scale_window": p.loss_scale_window,
            "hysteresis": p.hysteresis,
            "min_loss_scale": p.min_loss_scale,
        },
    }
    accum = grad_accum_dtype(cfg)
    if accum is not None:
        out["data_types"] = {"grad_accum_dtype": accum}
    return out


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(
        model.parameters(),
        lr=o.lr,
        betas=(o.betas[0], o.betas[1]),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=o.fused or None,
    )


# bf16 products run on tensor cores from compute capability 8.0 (A100) on. torch.cuda.is_bf16_supported() (and so
# DeepSpeed's check) is True on a V100 (7.0) too, where bf16 is emulated without tensor cores: several times slower.
BF16_MIN_CAPABILITY = (8, 0)
FP16_PRESET = "launch/slurm/v100-fp16.sbatch, or --set precision.dtype=fp16"


def check_precision(dtype: str) -> tuple[int, int] | None:
    """fp16 needs an accelerator DeepSpeed supports it on (not this kind of CPU), bf16 a GPU that has it in hardware
    (compute capability 8.0 or newer); say so before starting. -> the compute capability bf16 was checked against
    (None where no capability applies)."""
    from deepspeed.accelerator import get_accelerator  # deepspeed: only after device.resolve() (see Engine)

    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise ConfigError(
            f"precision.dtype: fp16 is not supported by DeepSpeed on this {acc.device_name()} device (use bf16 or fp32)"
        )
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(
            f"precision.dtype: bf16 is not supported by DeepSpeed on this {acc.device_name()} device (use fp16 or fp32)"
        )
    if dtype == "bf16" and acc.device_name() == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < BF16_MIN_CAPABILITY:
            raise ConfigError(
                f"precision.dtype: bf16 needs a GPU of compute capability 8.0 or newer; this "
                f"{torch.cuda.get_device_name()} is {major}.{minor} and would emulate it without "
                f"tensor cores, several times slower: use the fp16 preset ({FP16_PRESET})"
            )
        return major, minor
    return None


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did: applied (False: skipped on an fp16 overflow), the gradient norm (nan where
    DeepSpeed reports none), the loss scale after it, the LR it used; loss: a pipeline step's mean loss over its
    micro-batches (None for a micro-step: the loop sums the micro-batches' own)."""

    applied: bool
    grad_norm: float
    loss_scale: float
    lr: float
    loss: float | None = None


class Engine:
    """The DeepSpeed engine plus what the loop asks of it."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, micro_batch: int, dp: int, mpu=None):
        """mpu: the model-parallel groups for DeepSpeed (tensor parallelism); a PipelineModule brings its own."""
        import deepspeed  # picks its accelerator when imported: only after runtime/device.resolve() chose it

        self.cfg = cfg
        check_precision(cfg.precision.dtype)
        opt = make_optimizer(cfg, model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
        self.ds_config = ds_config(cfg, micro_batch, dp)
        self.ds, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=self.ds_config, mpu=mpu
        )
        self.device = self.ds.device
        self._manual_norm = cfg.parallel.zero_stage == 0 and cfg.precision.dtype == "fp32"

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def forward(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def micro_step(self) -> StepOutcome | None:
        """Called after every micro-batch's backward (DeepSpeed counts micro-steps in step()). Between
        micro-batches it returns None; at the end of the accumulation it steps the optimizer and returns the
        step's outcome (its loss None: the loop sums the micro-batches' own)."""
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()
            return None
        lr = self.lr()
        grad_norm = None
        if self._manual_norm:  # DeepSpeed does not report the norm without ZeRO / mixed precision
            grad_norm = tp_grad_norm(self.ds.module.parameters())
        skipped_before = self.ds.skipped_steps
        self.ds.step()
        applied = self.ds.skipped_steps == skipped_before
        if grad_norm is None:
            n = self.ds.get_global_grad_norm()
            grad_norm = float(n) if n is not None else float("nan")
        return StepOutcome(applied, grad_norm, self.loss_scale(), lr)

    def pipeline_step(self, data_iter) -> StepOutcome:
        """One step of a PipelineEngine (all micro-batches, then the optimizer), its loss the mean over them."""
        lr = self.lr()
        skipped_before = self.ds.skipped_steps
        loss = float(self.ds.train_batch(data_iter))
        applied = self.ds.skipped_steps == skipped_before
        n = self.ds.get_global_grad_norm()
        return StepOutcome(applied, float(n) if n is not None else float("nan"), self.loss_scale(), lr, loss)

    def reduction(self) -> str:
        """How the optimizer DeepSpeed built reduces the gradients, read from it (not from the config): ZeRO 1/2's
        ' (overlapped with the backward, buckets of N)' or ' (after the backward, buckets of N)'; '' where the
        engine all-reduces itself (ZeRO 0, bf16's BF16_Optimizer)."""
        opt = self.ds.optimizer
        size = getattr(opt, "reduce_bucket_size", None)
        if size is None:
            return ""
        when = "overlapped with the backward" if getattr(opt, "overlap_comm", False) else "after the backward"
        return f" ({when}, buckets of {int(size):,})"

    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def loss_scale(self) -> float:
        opt = self.ds.optimizer
        for name in ("cur_scale", "loss_scale"):
            v = getattr(opt, name, None)
            if isinstance(v, (int, float, torch.Tensor)):
                return float(v)
        return 1.0

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)
