"""The run directory as one trainer holds it: locked for the run (megamemo/runtime/lock.py), and left as it was
found when a start fails before its first step (its config.yaml, metrics.jsonl and tb/ appear with the first step:
train/metrics.py); the process tied to its launcher; anticipated errors reported in one line.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import traceback
from pathlib import Path

from megamemo.runtime.interruptions import EXIT_PEER_LOST
from megamemo.runtime.lock import RunLock, RunLockedError


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the process that started this one dies (Linux PR_SET_PDEATHSIG), so a
    worker never trains on as an orphan: a `kill -9` of its launcher makes it finish the step, save and stop."""
    if not sys.platform.startswith("linux"):
        return
    try:
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
        if os.getppid() != parent:  # it died before we asked
            os.kill(os.getpid(), signal.SIGTERM)
    except (OSError, AttributeError):
        pass


_PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|NCCL communicator was aborted|"
    r"remote worker crashing|Socket Timeout|timed out",
    re.I,
)


def report(error: BaseException, rank: int, everyone: bool, world_size: int = 1, code: int = 2) -> int:
    """One line for an anticipated error (no traceback unless MEGAMEMO_DEBUG=1); `everyone`: every rank met the same
    error (config, data, checkpoint choice), so rank 0 alone says it. -> `code`, the exit code (the trainer gives 1
    for a diverged run, 2 for the rest)."""
    if os.environ.get("MEGAMEMO_DEBUG") == "1":
        traceback.print_exception(error)
    if not everyone or rank == 0:
        where = f"rank {rank}: " if not everyone and world_size > 1 else ""
        print(f"megamemo train: error: {where}{error}", file=sys.stderr, flush=True)
    return code


def peer_lost(error: BaseException) -> int | None:
    """A collective that failed because another rank is gone (or hung past parallel.collective_timeout_s): the rank
    that failed said why (and the launcher names a rank that died without a word), so this one exits quietly with
    4 (interruptions.EXIT_PEER_LOST: a consequence, which a supervisor does not take for the cause); None when
    `error` is something else."""
    if not isinstance(error, RuntimeError) or not _PEER_LOST.search(str(error)):
        return None
    if os.environ.get("MEGAMEMO_DEBUG") == "1":
        traceback.print_exception(error)
    return EXIT_PEER_LOST


def leave_without_finalizing(code: int) -> None:
    """End this process now with `code`, skipping the interpreter's shutdown (after tear_down).

    For a rank whose peer is gone. Its gloo process group still has work queued on ProcessGroupGloo's worker
    threads ("pt_gloo_runloop": the collectives issued after the one that failed, each failing in turn), and the
    group cannot be freed while DeepSpeed and megatron-core hold it. A worker thread that finishes such work drops
    its tensors, which takes the GIL; during the interpreter's shutdown Python ends any thread that asks for the
    GIL with pthread_exit, whose forced unwinding through the worker's C++ frames calls std::terminate: "terminate
    called without an active exception", SIGABRT (caught here with a std::set_terminate hook: the thread was
    pt_gloo_runloop, in c10d::ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject -> PyEval_RestoreThread ->
    pthread_exit). Nothing is left to run at shutdown by then (tear_down closed the metrics, released the lock and
    joined our threads), so the process leaves with os._exit once its output is flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def tear_down(trainer) -> None:
    """What a trainer process does last, whichever way it ends (done, stopped, an error of its own or a peer's).

    An interpreter that shuts down with the gloo process group still up, or with a thread inside C++ code, may abort
    ("terminate called without an active exception", exit 134): gloo's worker threads still hold work whose
    tensors need the interpreter that is going away, and a daemon thread that comes back from C++ code is killed
    by the exit. So, in this order: the watchdog thread is stopped, a background checkpoint write in flight is
    abandoned and waited for (never committed; the next start removes it), the metrics are closed, the run
    directory's lock is released (its heartbeat thread joined), and every process group (DeepSpeed's and
    megatron-core's too) is destroyed."""
    if trainer is not None:
        watchdog = getattr(trainer, "watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        store = getattr(trainer, "store", None)
        if store is not None:
            store.abandon()
        metrics = getattr(trainer, "metrics", None)
        if metrics is not None:
            try:
                metrics.close()
            except OSError:
                pass
        rundir = getattr(trainer, "rundir", None)
        if rundir is not None:
            rundir.close()
    try:
        import torch.distributed as dist  # guarded: tear_down must finish even where it cannot be imported
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RunDirectory:
    """Rank 0 holds `<run_dir>/LOCK` for the whole run; every rank learns whether it got it (a collective)."""

    def __init__(self, path: Path, rank: int, stale_after_s: float, log=print):
        self.path, self.rank, self.log = Path(path), rank, log
        self.existed = self.path.exists()
        self.lock = RunLock(self.path, stale_after_s=stale_after_s, log=log) if rank == 0 else None

    def open(self, broadcast) -> None:
        problem = ""
        if self.lock is not None:
            try:
                self.lock.acquire()
            except RunLockedError as e:
                problem = str(e)
        problem = broadcast(problem)
        if problem:
            raise RunLockedError(problem)

    def close(self) -> None:
        if self.lock is None:
            return
        self.lock.release()
        if not self.existed:  # a start that created the directory and wrote nothing into it
            try:
                self.path.rmdir()
            except OSError:
                pass
