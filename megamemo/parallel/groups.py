"""Process groups (megatron-core parallel_state), the DeepSpeed `mpu` adapter, and the RNG tracker that makes
dropout inside tensor-parallel regions reproducible and different across TP ranks - on GPU megatron's own CUDA
tracker, on CPU a tracker over torch's CPU generator (megatron's needs CUDA)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megamemo.util.seeding import seed_default_streams

TP_RNG = "model-parallel-rng"  # megatron's name for the per-TP-rank stream


def _mcore():
    from megatron.core import parallel_state, tensor_parallel  # megatron-core: only for tp/pp > 1 (heavy)

    return parallel_state, tensor_parallel


def init_model_parallel(tp: int = 1, pp: int = 1, timeout_s: float | None = None) -> None:
    """Create the TP x PP x DP groups (torch.distributed must be initialised). Idempotent for the same sizes.
    timeout_s: their collectives' timeout (parallel.collective_timeout_s; None: megatron-core's 30 minutes)."""
    ps, _ = _mcore()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"parallel layout: world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (tp, pp):
            return
        ps.destroy_model_parallel()
    minutes = {} if timeout_s is None else {"distributed_timeout_minutes": max(1, math.ceil(timeout_s / 60))}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **minutes)


def destroy_model_parallel() -> None:
    ps, _ = _mcore()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def tp_rank_size() -> tuple[int, int]:
    ps, _ = _mcore()
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class MCoreMPU:
    """What DeepSpeed asks of `mpu=`, answered from megatron-core's parallel_state (which lacks the
    `get_model_parallel_*` names DeepSpeed uses)."""

    def __getattr__(self, name):
        ps, _ = _mcore()
        return getattr(ps, name)

    def get_model_parallel_world_size(self):
        ps, _ = _mcore()
        return dist.get_world_size(group=ps.get_model_parallel_group())

    def get_model_parallel_rank(self):
        ps, _ = _mcore()
        return dist.get_rank(group=ps.get_model_parallel_group())

    def get_model_parallel_group(self):
        ps, _ = _mcore()
        return ps.get_model_parallel_group()


class CPURNGTracker:
    """Named CPU generator states; `fork(name)` runs a block on that stream and restores the default one.
    Same interface as megatron's CudaRNGStatesTracker (add / fork / get_states / set_states / reset)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self):
        return bool(self.states_)

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} / seed {seed} already added")
        self.seeds_.add(seed)
        g = torch.Generator().manual_seed(seed)
        self.states_[name] = g.get_state()

    @contextlib.contextmanager
    def fork(self, name=TP_RNG):
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _pair(a: int, b: int) -> int:
    """Cantor's pairing: a one-to-one map of two naturals to one natural."""
    return (a + b) * (a + b + 1) // 2 + b


def dropout_seeds(seed: int, dp_rank: int, tp_rank: int, pp_rank: int, step_salt: int = 0) -> tuple[int, int]:
    """(default-stream seed, tensor-parallel-stream seed) of the rank at (dp, tp, pp), for run seed `seed`.

    The default stream drops out replicated activations: every TP rank of a (dp, pp) group must draw the same
    masks, so it does not depend on tp_rank. The TP stream (ForkedDropout, inside TP regions) is one per rank.
    Seeds are seed + 1 + an index that is one-to-one in (dp, pp, step_salt) for the default stream and in
    (dp, pp, tp, step_salt) for the TP stream, even for default and odd for TP: no two ranks, streams or salts
    share a seed (megatron's seed + 2718 + tp_rank gives (dp 0, tp 1) the stream of (dp 1, tp 0), and the same
    one to every pipeline stage). step_salt: a re-seed at a step (resume under another layout) uses the step."""
    if min(dp_rank, tp_rank, pp_rank, step_salt) < 0:
        raise ValueError(
            f"dropout_seeds: negative rank or salt (dp {dp_rank}, tp {tp_rank}, pp {pp_rank}, salt {step_salt})"
        )
    group = _pair(dp_rank, pp_rank)
    default = seed + 1 + 2 * _pair(group, step_salt)
    tp = seed + 1 + 2 * _pair(_pair(group, tp_rank), step_salt) + 1
    return default, tp


def install_tp_stream(tp_seed: int, cuda: bool | None = None) -> None:
    """Seed this rank's tensor-parallel dropout stream with exactly `tp_seed`: megatron's CUDA tracker when the
    model runs on CUDA (cuda=None: whenever torch sees a GPU), CPURNGTracker on CPU. (megatron's
    model_parallel_cuda_manual_seed would derive it as seed + 2718 + tp_rank and reseed the default stream.)"""
    _, tp = _mcore()
    if torch.cuda.is_available() if cuda is None else cuda:
        tracker = tp.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add(TP_RNG, tp_seed)
        return
    tracker = CPURNGTracker()
    tracker.add(TP_RNG, tp_seed)
    tp.random._CUDA_RNG_STATE_TRACKER = tracker
    tp.random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_rng_streams(
    seed: int,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    step_salt: int = 0,
    tp_stream: bool = True,
    cuda: bool | None = None,
) -> tuple[int, int]:
    """Seed this rank's default streams (python, numpy, torch CPU and CUDA) and, with tp_stream, its TP stream
    (on CUDA or CPU, see install_tp_stream), from dropout_seeds(...). Returns the two seeds."""
    default, tp_seed = dropout_seeds(seed, dp_rank, tp_rank, pp_rank, step_salt)
    seed_default_streams(default)
    if tp_stream:
        install_tp_stream(tp_seed, cuda)
    return default, tp_seed


def rng_tracker():
    _, tp = _mcore()
    return tp.get_cuda_rng_tracker()


def communication_device() -> torch.device:
    """The device this process's collectives run on (DeepSpeed's accelerator: cuda:N under NCCL, cpu under gloo)."""
    # deepspeed picks its accelerator at import: only after runtime/device.resolve()
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def grad_norm(params) -> float:
    """Global L2 norm of the gradients, counting tensor-parallel shards once each and replicated parameters once
    (not once per TP rank). The squares are summed in float64 on the gradients' device; the TP all-reduce runs
    there too (NCCL takes no CPU tensors); one host sync at the end."""
    grads = [(p.grad.detach(), bool(getattr(p, "tensor_model_parallel", False))) for p in params if p.grad is not None]
    device = grads[0][0].device if grads else communication_device()  # a rank without gradients still joins
    sq = torch.zeros(2, dtype=torch.float64, device=device)  # [split across TP ranks, replicated]
    for g, split in grads:
        sq[0 if split else 1] += g.double().pow(2).sum()
    _, size = tp_rank_size()
    if size > 1:
        ps, _ = _mcore()
        split_sq = sq[:1].clone()
        dist.all_reduce(split_sq, group=ps.get_tensor_model_parallel_group())
        sq = torch.cat([split_sq, sq[1:]])
    return float(sq.sum().sqrt())
