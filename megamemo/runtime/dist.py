"""Rank discovery and process-group start-up.

One process per device. The launcher is recognised from its environment:
  - torchrun / the `deepspeed` launcher / launch/local.sh: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set;
  - srun: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; MASTER_ADDR is the first host of the job's node list
    (`scontrol show hostnames`), MASTER_PORT derived from the job id (DeepSpeed does not map SLURM_* itself);
  - mpirun (Open MPI, MPICH, Intel MPI): ranks from mpi4py; rank 0 broadcasts its host and a free port. An
    mpirun inside an sbatch script also inherits SLURM_*; the MPI ranks win there (see mpirun_inside_slurm);
  - nothing: one process.
The mapping is written back into os.environ (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which is
what torch.distributed's env:// initialisation and DeepSpeed read. gloo on CPU, NCCL on GPU; which one, and which
GPU, is decided by megamemo/runtime/device.py (a GPU job without a usable GPU stops with a one-line error).
"""

from __future__ import annotations

import importlib
import os
import random
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # env | slurm | mpi | single
    local_world: int | None = None  # tasks on this node, when the launcher says

    def export(self) -> None:
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


PORTS_FROM = 20000  # free_port draws from here up to the kernel's ephemeral range


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel picks a socket's port from when none is asked for (Linux; elsewhere its default)."""
    try:
        low, high = map(int, Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(tries: int = 64) -> int:
    """A TCP port free now for a job's rendezvous (rank 0 listens on it once it has started), drawn from below the
    kernel's ephemeral range: a port the kernel never hands out by itself, so that the connections other jobs on the
    host open in the seconds before rank 0 listens (gloo's, each on a port of that range) cannot take it. Falls back
    to a port the kernel chooses when none below is free (or the range starts too low)."""
    low, _ = ephemeral_ports()
    draw = random.SystemRandom()  # not the `random` module's stream, which a run may have seeded
    for _ in range(tries if low > PORTS_FROM else 0):
        port = draw.randrange(PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def expand_nodelist(nodelist: str) -> list[str]:
    """Hosts of a Slurm node list. Uses `scontrol show hostnames`; without scontrol, expands the common
    forms itself (`a,b`, `node[01-03,7]`, `gpu-[1-2]-x`)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True, timeout=30
        ).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", item)
        if not m:
            hosts.append(item)
            continue
        pre, ranges, post = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                a, b = r.split("-", 1)
                hosts += [f"{pre}{i:0{len(a)}d}{post}" for i in range(int(a), int(b) + 1)]
            else:
                hosts.append(f"{pre}{r}{post}")
    return hosts


def slurm_port(job_id: str) -> int:
    """A port every task of one job agrees on, different between jobs sharing a node."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits) % 20000


def discover(environ: dict | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        lw = env.get("LOCAL_WORLD_SIZE")
        return DistEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(local),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")),
            "env",
            int(lw) if lw else None,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and not mpirun_inside_slurm(env):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else "127.0.0.1")
        port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0")))
        return DistEnv(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", "0")),
            addr,
            port,
            "slurm",
            slurm_tasks_on_node(env),
        )
    if mpi_rank(env) is not None:
        return _discover_mpi(env)
    return DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT") or free_port()), "single")


def launcher_rank_size(environ: dict | None = None) -> tuple[int, int | None]:
    """(rank, world size or None) as the launcher put them in the environment, with discover()'s precedence but
    nothing started or asked for (no MPI, no scontrol): for what a process says before its process group exists."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and not mpirun_inside_slurm(env):
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return mpi_rank(env) or (0, 1)


def slurm_tasks_on_node(env) -> int | None:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE), e.g.
    '8(x2),4' and SLURM_NODEID; None when Slurm does not say."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else None


def mpi_rank(env) -> tuple[int, int | None] | None:
    """(rank, size or None) as an MPI launcher (mpirun/mpiexec, or srun's PMI plugins) put them in the environment."""
    for rank_key, size_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("PMIX_RANK", None),
    ):
        if rank_key in env:
            size = env.get(size_key) if size_key else None
            return int(env[rank_key]), (int(size) if size else None)
    return None


def mpirun_inside_slurm(env) -> bool:
    """True when an MPI launcher started this process inside a Slurm allocation (mpirun in an sbatch script):
    then SLURM_PROCID/SLURM_NTASKS describe the batch step or mpirun's proxies, not our ranks. Under srun with a
    PMI plugin the two agree, and the Slurm mapping is used (no MPI initialisation needed)."""
    if "OMPI_COMM_WORLD_RANK" in env:
        return True
    mpi = mpi_rank(env)
    if mpi is None:
        return False
    rank, size = mpi
    return rank != int(env["SLURM_PROCID"]) or (size is not None and size != int(env["SLURM_NTASKS"]))


def _discover_mpi(env) -> DistEnv:
    from mpi4py import MPI  # initialises MPI when imported: only under an MPI launcher

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, local_world = node.Get_rank(), node.Get_size()
    if rank == 0:
        addr = env.get("MASTER_ADDR") or socket.gethostname()
        port = int(env.get("MASTER_PORT") or free_port())
    else:
        addr, port = None, None
    addr, port = comm.bcast((addr, port), root=0)
    return DistEnv(rank, world, local, addr, port, "mpi", local_world)


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (40-120 s with g++) at the first
    init_distributed. Training never uses it (only inference_all_reduce does), so skip the build. The patch must
    go on the module object deepspeed.comm.torch: `import deepspeed.comm.torch as m` binds a different name."""
    mod = importlib.import_module("deepspeed.comm.torch")
    setattr(mod, "build_shm_op", lambda: None)  # noqa: B010 - deepspeed's stubs do not declare it


def init(timeout_s: float = 300.0) -> DistEnv:
    """Discover the ranks, export them, choose the device (device.py) and start torch.distributed through
    DeepSpeed (gloo or NCCL). timeout_s (parallel.collective_timeout_s): how long a collective of the default group
    waits for a peer before it fails (a hung or dead rank)."""
    # torch, and device (which imports it), only here: the launcher imports this module and runs without torch
    import torch

    from megamemo.runtime import device

    de = discover()
    de.export()
    if device.resolve() == "cuda":  # sets DS_ACCELERATOR before DeepSpeed picks its accelerator
        index = device.pick_cuda_device(de.local_rank, de.local_world, torch.cuda.device_count())
        torch.cuda.set_device(index)
        # DeepSpeed takes LOCAL_RANK for the device index (init_process_group's device_id, the engine's device,
        # PipelineModule.to): a task bound to one GPU is cuda:0 whatever its local rank
        os.environ["LOCAL_RANK"] = str(index)
        backend = "nccl"
    else:
        backend = "gloo"
        _skip_shm_comm_build()
    import deepspeed  # picks its accelerator when imported: only after device.resolve() above

    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        rank=de.rank,
        world_size=de.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return de


def barrier() -> None:
    import torch.distributed as dist  # no torch at import: the launcher imports this module

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast(obj):
    """Rank 0's `obj` on every rank (any picklable value between this run's own processes)."""
    import torch.distributed as dist  # no torch at import: the launcher imports this module

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    import torch.distributed as dist  # no torch at import: the launcher imports this module

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
