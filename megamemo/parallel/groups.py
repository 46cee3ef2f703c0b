"""Process groups (megatron-core parallel_state), the DeepSpeed `mpu` adapter, and the RNG tracker that makes
dropout inside tensor-parallel regions reproducible and different across TP ranks - on GPU megatron's own CUDA
tracker, on CPU a tracker over torch's CPU generator (megatron's needs CUDA)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

TP_RNG = "model-parallel-rng"  # megatron's name for the per-TP-rank stream
TP_SEED_OFFSET = 2718          # megatron's offset: tp seed = seed + 2718 + tp_rank


def _mcore():
    from megatron.core import parallel_state, tensor_parallel
    return parallel_state, tensor_parallel


def init_model_parallel(tp: int = 1, pp: int = 1) -> None:
    """Create the TP x PP x DP groups (torch.distributed must be initialised). Idempotent for the same sizes."""
    ps, _ = _mcore()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"parallel layout: world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (tp, pp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


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


def install_rng_tracker(seed: int) -> None:
    """Seed the per-TP-rank dropout stream: megatron's CUDA tracker on GPU, CPURNGTracker on CPU."""
    ps, tp = _mcore()
    rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    if torch.cuda.is_available():
        tp.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CPURNGTracker()
    tracker.add(TP_RNG, seed + TP_SEED_OFFSET + rank)
    tp.random._CUDA_RNG_STATE_TRACKER = tracker
    tp.random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def rng_tracker():
    _, tp = _mcore()
    return tp.get_cuda_rng_tracker()


def grad_norm(params) -> float:
    """Global L2 norm of the gradients, counting tensor-parallel shards once each and replicated parameters once
    (not once per TP rank)."""
    sq_split = torch.zeros((), dtype=torch.float64)
    sq_repl = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sq_split += sq
        else:
            sq_repl += sq
    _, size = tp_rank_size()
    if size > 1:
        ps, _ = _mcore()
        dist.all_reduce(sq_split, group=ps.get_tensor_model_parallel_group())
    return float((sq_split + sq_repl).sqrt())
