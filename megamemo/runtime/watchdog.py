"""Hang detection: each rank's watchdog thread checks that its step counter moves.

The training loop tells it each applied step and how long the step took (`step_done`; a skipped attempt, an fp16
overflow retried, counts as progress: `attempted`), and pauses it around what has time bounds of its own
(`paused`: evaluation, whose collectives end at parallel.collective_timeout_s; checkpoint saves, whose commit ends
at checkpoint.commit_timeout_s). When no step ends for longer than the timeout, the watchdog
  * writes every thread's Python stack to the rank's log (faulthandler: what the main thread waits in),
  * names, in one line, this rank, the step, the frame the main thread is stuck in and the rank it waits for:
    a peer whose heartbeat went stale (a stopped process, one stuck in a call that holds the interpreter) or,
    when every heartbeat is fresh, one that is behind the others,
  * records its verdict in its heartbeat file (for the supervisor's interruption record) and ends the process
    with exit code 3 (interruptions.EXIT_HUNG), which the supervisor retries (launch/local.sh --max-restarts,
    train.sbatch).

The timeout is train.hang_timeout_s when set (0: no watchdog; a fixed value holds from the first step on, so it must
leave room for compilation); by default (auto) 5 x train.hang_floor_s over the first steps of a process (start-up,
compilation, warm-up: WARMUP_STEPS of them), then 10 x the slowest step seen since, at least train.hang_floor_s.

Heartbeats: every `interval` seconds (a fifth of the floor or fixed timeout, within 0.5-5 s) the thread writes
`<run_dir>/heartbeats/rank<N>.json`: rank, node (Slurm's name for it under Slurm), pid, step, the time the step last
moved and the time of the beat.
A heartbeat older than STALE_BEATS intervals belongs to a rank whose threads do not run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from megamemo.runtime.interruptions import EXIT_HUNG, HEARTBEATS, read_heartbeats
from megamemo.util.files import write_text_atomic

WARMUP_STEPS = 2  # steps of a process not counted in its slowest (compilation, allocator warm-up)
FIRST_STEPS_FACTOR = 5  # the auto timeout over the warm-up: 5 x the floor
MULTIPLE = 10  # then: 10 x the slowest step seen
STALE_BEATS = 3


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_name} ({'/'.join(Path(code.co_filename).parts[-3:])}:{frame.f_lineno})"


def stuck_frame(thread_id: int | None = None) -> str:
    """Where a thread is: its innermost frame, and the innermost of megamemo's frames below it."""
    ident = thread_id or threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "an unknown frame"
    inner, ours = frame, None
    while frame is not None:
        if ours is None and f"{os.sep}megamemo{os.sep}" in frame.f_code.co_filename:
            ours = frame
        frame = frame.f_back
    return _where(inner) + (f", called from {_where(ours)}" if ours is not None and ours is not inner else "")


class Watchdog:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        timeout_s: float | None,
        floor_s: float,
        *,
        node: str | None = None,
        out=None,
        clock=time.monotonic,
        wall=time.time,
        exit=os._exit,
    ):
        self.dir = Path(run_dir) / HEARTBEATS
        self.rank, self.world_size = rank, world_size
        self.fixed, self.floor = timeout_s, floor_s
        self.node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's name: ExcNodeList
        self.out = out
        self.clock, self.wall, self.exit = clock, wall, exit
        self.interval = min(5.0, max(0.5, (timeout_s or floor_s) / 5))
        self.step, self.done, self.slowest = 0, 0, 0.0
        self.last, self.last_wall = clock(), wall()
        self.phase: str | None = None
        self.hung: dict | None = None
        self.notes: dict = {}  # what this rank tells its supervisor (note())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.fixed is None or self.fixed > 0

    def limit(self) -> float:
        """The current timeout in seconds (the module's doc)."""
        if self.fixed is not None:
            return self.fixed
        if self.done <= WARMUP_STEPS:
            return FIRST_STEPS_FACTOR * self.floor
        return max(self.floor, MULTIPLE * self.slowest)

    # ---- what the loop calls -------------------------------------------------------------------------------------
    def start(self, step: int = 0) -> None:
        self.step, self.last, self.last_wall = step, self.clock(), self.wall()
        if not self.enabled or self._thread is not None:
            return
        self.beat()  # at once: the supervisor and the peers learn this rank's node
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="megamemo-watchdog", daemon=True)
        self._thread.start()

    def step_done(self, step: int, seconds: float) -> None:
        self.done += 1
        if self.done > WARMUP_STEPS:
            self.slowest = max(self.slowest, seconds)
        self.step, self.last, self.last_wall = step, self.clock(), self.wall()

    def note(self, key: str, value) -> None:
        """Tell the supervisor `value` under `key` in this rank's heartbeat, now (also with the watchdog off): e.g.
        the suspects of a replica mismatch (train/numerics.py), which its failure record names."""
        self.notes[key] = value
        self.beat()

    def attempted(self) -> None:
        """A step attempted and not applied (an fp16 overflow, retried): progress, though the step does not move."""
        self.last, self.last_wall = self.clock(), self.wall()

    @contextlib.contextmanager
    def paused(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before
            self.last, self.last_wall = self.clock(), self.wall()  # time in a pause is not a stall

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()
            self.check()

    def beat(self) -> None:
        rec = {
            "rank": self.rank,
            "node": self.node,
            "pid": os.getpid(),
            "step": self.step,
            "progress": round(self.last_wall, 3),
            "beat": round(self.wall(), 3),
            "phase": self.phase,
            **({"hung": self.hung} if self.hung else {}),
            **self.notes,
        }
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.dir / f"rank{self.rank}.json", json.dumps(rec), durable=False)
        except OSError:
            pass  # a full or flaky file system must not stop the training

    def check(self) -> bool:
        """Fire when the step has not moved for longer than the timeout (outside a pause). -> fired"""
        if not self.enabled or self.phase is not None:
            return False
        stalled = self.clock() - self.last
        if stalled <= self.limit():
            return False
        self.fire(stalled)
        return True

    def waiting_for(self) -> tuple[list[int], str]:
        """(the ranks this one waits for, why): peers whose heartbeat went stale, else those behind the others."""
        now = self.wall()
        beats = {r: b for r, b in read_heartbeats(self.dir.parent).items() if r != self.rank and r < self.world_size}
        stale = STALE_BEATS * self.interval
        silent = sorted(r for r, b in beats.items() if now - float(b["beat"]) > stale)
        missing = sorted(set(range(self.world_size)) - set(beats) - {self.rank})
        if silent or missing:
            parts = [
                f"rank {r} ({beats[r].get('node')}, pid {beats[r].get('pid')}) not heard from for "
                f"{now - float(beats[r]['beat']):.0f} s (its last heartbeat: step {beats[r].get('step')})"
                for r in silent
            ]
            parts += [f"rank {r} never heard from" for r in missing]
            return sorted(silent + missing), "; ".join(
                parts
            ) + ": its threads do not run (stopped, or stuck in a call that holds the interpreter)"
        low = min([b.get("step", 0) for b in beats.values()] + [self.step])
        behind = sorted(r for r, b in beats.items() if b.get("step", 0) == low and low < self.step)
        if behind:
            return behind, f"rank(s) {', '.join(map(str, behind))} behind at step {low}"
        return [], "every rank's heartbeat is fresh and at this step: a collective or the network hangs"

    def fire(self, stalled: float) -> None:
        out = self.out or sys.stderr
        where = stuck_frame()
        ranks, why = self.waiting_for()
        limit = self.limit()
        setting = f"train.hang_timeout_s={self.fixed:g}" if self.fixed is not None else f"auto timeout {limit:.0f} s"
        line = (
            f"[watchdog] rank {self.rank} ({self.node}, pid {os.getpid()}) hung: no step for {stalled:.0f} s "
            f"({setting}) after step {self.step}; stuck in {where}; {why}; exiting with code {EXIT_HUNG}"
        )
        self.hung = {"stuck": ranks, "by": self.rank, "step": self.step, "frame": where, "seconds": round(stalled, 1)}
        try:
            print(
                f"[watchdog] rank {self.rank}: every thread's stack (the main thread is the training):",
                file=out,
                flush=True,
            )
            faulthandler.dump_traceback(file=out, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass  # an output without a file descriptor: the line still goes out
        print(line, file=out, flush=True)
        self.beat()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self.exit(EXIT_HUNG)
