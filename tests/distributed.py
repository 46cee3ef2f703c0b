"""Run a function on N local processes with gloo (for multi-process tests). Exceptions in any rank fail the test."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamemo.train.dist import free_port


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args):
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
