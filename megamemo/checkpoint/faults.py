"""Fault injection for the crash tests and bench/soak.py: a rank SIGKILLs itself at a named moment of the checkpoint
protocol, where a kill from outside would land only by luck (the windows are milliseconds long), or of training,
so that a seed replays the same kills on any host under any load (never a moment measured in time).

    MEGAMEMO_FAULT_KILL_IN_SAVE="STEP:RANK"   that rank, while saving that step: its tensors written, not its JSON
    MEGAMEMO_FAULT_KILL_AT="POINT:N[:RANK]"   the rank that passes POINT for the N-th time (counted per process;
                                              with RANK, only that rank):
        save       a rank's files written but its rank JSON not yet (a half-written checkpoint)
        commit     rank 0: every rank's files are in, COMMITTED not yet written
        retention  rank 0: the step is committed, older checkpoints not yet removed
        removal    rank 0: an old checkpoint's COMMITTED removed, its files not yet
        start-up   every rank: built, resumed, about to train its first step
        step       every rank, mid-step: its forward, backward and optimizer step done, the step's all-reduce and
                   commit (memory, data cursor, counters) not yet
    MEGAMEMO_FAULT_STOP_AT="POINT:N[:RANK]"   the same points, but the rank stops itself (SIGSTOP): bench/soak.py
                                              then kills the whole job with -9 from outside, launcher first
      "POINT:N@K,POINT:N@K,..."               the same, each in the start with MEGAMEMO_RESTART=K only (a plan for
                                              a job that restarts itself: launch/local.sh --max-restarts)
    MEGAMEMO_FAULT_FAIL_WRITE="STEP:RANK"   that rank's write of its tensor file of that step fails with ENOSPC
                                            (the save must fail on every rank, nothing committed)
    MEGAMEMO_FAULT_CRASH_AT="STEP:RANK"     that rank raises an error as it begins training that step, in every
                                            start (a deterministic failure: the supervisor must give up on it)
    MEGAMEMO_FAULT_FLIP="WHAT:STEP:RANK[:BIT]"  silent data corruption: that rank flips bit BIT (default 22, the
                                            highest mantissa bit of an fp32) of the first element of its first
                                            parameter, WHAT = weights: after that step's optimizer step (the
                                            replica check looks next), grad: its gradient after the backward, before
                                            the optimizer step (where the parameters hold it: ZeRO 0)
    MEGAMEMO_FAULT_BAD_BATCH="N[:TOKEN]"    the N-th batch of the data (counted from epoch 0's first; the batch of
                                            step N when nothing was skipped) has targets all TOKEN (default 0, a
                                            byte no text holds), on every rank: a bad batch, whose loss spikes; a
                                            rollback that skips it skips the fault too
      (both take "SPEC@K,..." plans too: in the start with MEGAMEMO_RESTART=K only)
Unset (always, outside tests and the soak), each check is one comparison.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import torch

POINTS = ("save", "commit", "retention", "removal", "start-up", "step")


def _point(env, key: str) -> tuple[str, int, int | None] | None:
    """(point, N, rank or None) of POINT:N[:RANK] in env[key]; None when unset."""
    value = for_this_start(env.get(key, ""), env)  # a plan per start: launch/local.sh --max-restarts
    if not value:
        return None
    name, n, *rank = value.split(":")
    if name not in POINTS:
        raise ValueError(f"{key}: unknown point {name!r} (one of {', '.join(POINTS)})")
    return name, int(n), int(rank[0]) if rank else None


def for_this_start(value: str, env) -> str:
    """The entry of a plan "SPEC@K,SPEC@K,..." for this start of the job (MEGAMEMO_RESTART=K, set by the launcher;
    an entry without @K holds for every start); "" when none."""
    start = int(env.get("MEGAMEMO_RESTART") or 0)
    for item in filter(None, value.split(",")):
        spec, _, k = item.partition("@")
        if not k or int(k) == start:
            return spec
    return ""


class FaultPoints:
    def __init__(self, rank: int, environ=None):
        env = os.environ if environ is None else environ
        self.rank = rank
        legacy = env.get("MEGAMEMO_FAULT_KILL_IN_SAVE", "")
        self.kill_in_save = tuple(int(x) for x in legacy.split(":")) if legacy else None
        self.kill_at = _point(env, "MEGAMEMO_FAULT_KILL_AT")
        self.stop_at = _point(env, "MEGAMEMO_FAULT_STOP_AT")
        self.points = {p[0] for p in (self.kill_at, self.stop_at) if p}
        self.passed: dict[str, int] = {}
        failing = env.get("MEGAMEMO_FAULT_FAIL_WRITE", "")
        self.fail_write_at = tuple(int(x) for x in failing.split(":")) if failing else None
        crash = env.get("MEGAMEMO_FAULT_CRASH_AT", "")
        self.crash_at = tuple(int(x) for x in crash.split(":")) if crash else None
        what, *flip = for_this_start(env.get("MEGAMEMO_FAULT_FLIP", ""), env).split(":")
        if what and (what not in ("weights", "grad") or len(flip) not in (2, 3)):
            raise ValueError(f"MEGAMEMO_FAULT_FLIP: expected weights|grad:STEP:RANK[:BIT], got {what!r}")
        self.flip = (what, int(flip[0]), int(flip[1]), int(flip[2]) if len(flip) > 2 else 22) if what else None
        bad = for_this_start(env.get("MEGAMEMO_FAULT_BAD_BATCH", ""), env)
        self.bad_batch = tuple(int(x) for x in (bad.split(":") + ["0"])[:2]) if bad else None

    def step(self, step: int) -> None:
        """As this rank begins training step `step`: the injected crash when asked for."""
        if self.crash_at == (step, self.rank):
            raise RuntimeError(f"rank {self.rank}: crash injected at step {step} (MEGAMEMO_FAULT_CRASH_AT)")

    def batch(self, number: int, inp: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The data's batch number `number`, or the injected bad one."""
        if self.bad_batch is None or self.bad_batch[0] != number:
            return inp, tgt
        print(f"[fault] rank {self.rank}: batch {number} is a bad one (targets all {self.bad_batch[1]})", flush=True)
        return inp, torch.full_like(tgt, self.bad_batch[1])

    def corrupt(self, what: str, step: int, module: torch.nn.Module) -> None:
        """At `what` ("weights" after the optimizer step, "grad" before it) of step `step`: the injected bit flip."""
        if self.flip is None or self.flip[:3] != (what, step, self.rank):
            return
        p = next(p for p in module.parameters() if p.numel())
        t = p.data if what == "weights" else p.grad
        if t is None:
            raise RuntimeError(
                f"MEGAMEMO_FAULT_FLIP=grad: rank {self.rank} holds no gradient in its parameters at "
                f"step {step} (ZeRO 1/2 move it into their buckets during the backward: use "
                f"parallel.zero_stage=0)"
            )
        flat = t.view(-1)[:1].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        flat ^= 1 << self.flip[3]
        print(f"[fault] rank {self.rank} flips bit {self.flip[3]} of its {what} at step {step}", flush=True)

    def write(self, step: int, path: Path) -> None:
        """Before this rank writes `path` of step `step`: an injected write error when asked for."""
        if self.fail_write_at == (step, self.rank) and Path(path).name.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: MEGAMEMO_FAULT_FAIL_WRITE)", str(path))

    def at(self, point: str, step: int | None = None) -> None:
        if point == "save" and self.kill_in_save == (step, self.rank):
            self._die(f"while saving step {step}")
        if point not in self.points:
            return
        n = self.passed[point] = self.passed.get(point, 0) + 1
        for (name, nth, rank), sig in (
            (self.kill_at or ("", 0, None), signal.SIGKILL),
            (self.stop_at or ("", 0, None), signal.SIGSTOP),
        ):
            if name == point and n == nth and rank in (None, self.rank):
                self._die(f"at {point} #{n}", sig)

    def _die(self, where: str, sig: int = signal.SIGKILL) -> None:
        print(f"[fault] rank {self.rank} {'kills' if sig == signal.SIGKILL else 'stops'} itself {where}", flush=True)
        os.kill(os.getpid(), sig)
