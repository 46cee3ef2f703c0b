"""A training process, start to end (what `megamemo train` runs: megamemo/commands/train.py): the stop signals
handled from the first moment, a worker that dies with its launcher, the config read and checked, the device
decided, the data checked, the run built (build.py) and trained (loop.py), goodput and peak memory said at the end;
an error megamemo anticipates is one line from one rank, and every way a run ends tears down in one order
(runtime/rundir.py tear_down). Exit codes: 0 done or stopped by SIGUSR1/SIGTERM after saving; 2 bad config, data or
checkpoint (never retried); 1 other errors and a diverged run; 3 hung (the watchdog, runtime/watchdog.py); 4 a peer
is gone (runtime/interruptions.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megamemo.checkpoint.pieces import PieceError
from megamemo.checkpoint.store import CheckpointError
from megamemo.config.run import ConfigError
from megamemo.data import ManifestError, ShardError
from megamemo.kernels.compiler import compile_stats
from megamemo.runtime import device, dist, goodput, rss
from megamemo.runtime.device import DeviceError
from megamemo.runtime.dist import launcher_rank_size
from megamemo.runtime.goodput import process_started
from megamemo.runtime.interruptions import announce_run_dir
from megamemo.runtime.lock import RunLockedError
from megamemo.runtime.rundir import die_with_parent, leave_without_finalizing, peer_lost, report, tear_down
from megamemo.runtime.signals import StopRequest
from megamemo.train.build import build
from megamemo.train.config import load
from megamemo.train.data import DataError, check_data_dir, unused_ids
from megamemo.train.engine import check_precision
from megamemo.train.loop import DivergedError
from megamemo.train.numerics import EXIT_NODE_SUSPECT, ReplicaMismatch


def run(config, sets: Sequence[str] = ()) -> int:
    """Trains the run of config file `config` with `--set` overrides `sets` in this process (one rank of it), to its
    end or a stop signal -> the exit code (0 done or stopped after saving; 2 a bad config, data or checkpoint, said in
    one line by one rank; 1 a diverged run; 4 a peer is gone). Every way it ends tears down in one order."""
    stop = StopRequest()  # first: a stop signal held since the process started is handled now
    die_with_parent()  # a worker never outlives its launcher
    started = process_started()
    # (DeepSpeed's deprecation warning of every step is filtered by the entry point: megamemo/runtime/quiet.py)
    (rank, size), trainer, expected = launcher_rank_size(), None, anticipated_errors()
    world = size or 1
    starting = True  # until training runs, every rank meets the same errors
    lost = None  # the exit code when a peer is gone
    try:
        cfg = load(config, list(sets))
        announce_run_dir(cfg.train.run_dir, rank)  # to a supervisor that restarts failed runs (launch/)
        device.resolve()  # cuda or cpu, before DeepSpeed picks its accelerator
        unused = unused_ids(cfg, check_data_dir(cfg))
        if unused and not rank:
            print(f"[train] warning: {unused}", flush=True)
        if cfg.train.deterministic:
            device.make_deterministic()
        device.set_tf32(cfg.precision.allow_tf32 and cfg.precision.dtype == "fp32")
        if cfg.precision.dtype != "fp32":
            check_precision(cfg.precision.dtype)
        t0 = time.time()
        trainer, de = build(cfg, stop=stop, started=started)
        rank, world, starting = de.rank, de.world_size, False
        outcome = trainer.run()
        trainer.metrics.end(trainer.step, outcome)
        trainer.metrics.close()
        rss.write(de.rank)
        if de.rank == 0:
            compiled = ""
            if trainer.speed.uses_compiler:
                compiled = ", {graphs} graphs compiled ({recompiles} recompiles)".format(**compile_stats())
            print(f"[train] {outcome} at step {trainer.step} ({time.time() - t0:.1f}s{compiled})", flush=True)
            g = goodput.of_run(Path(cfg.train.run_dir))
            if g is not None:
                print(f"[train] {goodput.describe(g)}", flush=True)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                print(
                    f"[train] peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                    f"(torch.cuda.max_memory_allocated, rank 0)",
                    flush=True,
                )
        dist.barrier()
        dist.shutdown()
        return 0
    except expected as e:
        # while starting every rank meets the same error (but its node's devices): rank 0 says it; in training it
        # is this rank's own
        everyone = (starting and not isinstance(e, DeviceError)) or getattr(e, "same_on_every_rank", False)
        code = 1 if isinstance(e, DivergedError) else EXIT_NODE_SUSPECT if isinstance(e, ReplicaMismatch) else 2
        return report(e, rank, everyone=everyone, world_size=world, code=code)
    except RuntimeError as e:
        lost = peer_lost(e)
        if lost is None:
            raise
        return lost
    finally:
        tear_down(trainer)  # on every path: no thread mid-write, the lock freed, the group destroyed
        stop.restore()  # the caller's handlers back (main called in-process: tests, notebooks)
        if lost is not None:  # gloo's worker threads may still hold work: no interpreter shutdown
            leave_without_finalizing(lost)


def anticipated_errors() -> tuple[type[BaseException], ...]:
    """Errors megamemo explains in one line (bad config, data, shard, checkpoint, a locked run directory, a
    diverged run); anything else is a bug and shows its traceback."""
    return (
        ReplicaMismatch,
        ConfigError,
        DataError,
        CheckpointError,
        PieceError,
        RunLockedError,
        ShardError,
        ManifestError,
        DivergedError,
        DeviceError,
    )
