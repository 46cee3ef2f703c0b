"""Run a function on N local processes with gloo (for multi-process tests), in a bounded time.

An exception in any rank fails the test with that rank's traceback. A rank that fails makes the others stop (they
would wait for it in their next collective until gloo's timeout). A run that does not end within `timeout` seconds
fails the test naming the function and the ranks that hung; each of those ranks first writes every thread's stack
(faulthandler), and the failure shows them.

Each rank ends by destroying its process groups and leaving with os._exit: what DeepSpeed and megatron-core keep of
their groups is then never destroyed by the interpreter's shutdown (where gloo's threads can abort the process,
"terminate called without an active exception", long after the test's own work passed).

The ranks are forked from the warm server of helpers/forked.py (torch, DeepSpeed and megatron-core imported once) with
the test process's environment, or spawned where that server may not serve (CUDA, MEGAMEMO_TEST_FORK=0).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import forked
from megamemo.runtime.dist import free_port

TIMEOUT_S = float(os.environ.get("MEGAMEMO_TEST_DIST_TIMEOUT_S", "300"))
PEER_GRACE_S = 5.0  # after a rank failed, how long the others get to end (with their own error) on their own


def _entry(rank, world, port, fn, args, errors, timeout, stacks, env):
    os.environ.clear()  # the test process's environment (a forked rank has the server's)
    os.environ.update(env)
    stack_file = open(stacks, "w")
    faulthandler.dump_traceback_later(timeout, file=stack_file)  # a hang: every thread's stack, for the parent
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout + 120))
        fn(rank, world, *args)
        dist.barrier()  # no rank tears down while another still has work with it
    except BaseException:  # handed to the parent, which fails the test with it
        errors.put((rank, traceback.format_exc()))
        code = 1
    faulthandler.cancel_dump_traceback_later()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # the rank has not started yet
        return 0


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def run_distributed(fn, world: int, *args, timeout: float = TIMEOUT_S):
    ctx = forked.context() if forked.for_functions() else mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    stack_dir = tempfile.mkdtemp(prefix="run_distributed-")
    stacks = [os.path.join(stack_dir, f"rank{r}.stacks") for r in range(world)]
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, errors, timeout, stacks[r], env), name=f"rank{r}")
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout + 15  # the ranks start (imports) and dump their stacks first
    failed_at = dumped_at = None
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if dumped_at is None and all(_size(stacks[r]) > 0 for r, p in enumerate(procs) if p.is_alive()):
                dumped_at = now  # every rank still running is past its limit: it wrote its stacks
            if (
                now > deadline
                or (failed_at is not None and now > failed_at + PEER_GRACE_S)
                or (dumped_at is not None and now > dumped_at + 1.0)
            ):
                break
            time.sleep(0.05)
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    reported = []  # in the order they failed: the first is the cause
    while not errors.empty():
        reported.append(errors.get())
    name = getattr(fn, "__qualname__", repr(fn))
    if reported:
        rank, tb = reported[0]
        others = f" (then ranks {[r for r, _ in reported[1:]]})" if len(reported) > 1 else ""
        raise AssertionError(f"{name}: rank {rank} of {world} failed{others}:\n{tb}")
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    if failed_at is None and hung:
        where = "".join(f"\n--- rank {r} ---\n" + Path(stacks[r]).read_text()[-3000:] for r in hung)
        shutil.rmtree(stack_dir, ignore_errors=True)
        raise AssertionError(
            f"{name}: ranks {hung} of {world} did not finish within {timeout:.0f}s (killed); where they were:{where}"
        )
    shutil.rmtree(stack_dir, ignore_errors=True)
    bad = {r: c for r, c in codes.items() if c != 0 and r not in hung}
    if bad or hung:
        raise AssertionError(
            f"{name}: "
            + ", ".join(f"rank {r}: {_describe(c)}" for r, c in sorted(bad.items()))
            + (f"; ranks {hung} were stopped after it" if hung else "")
        )
