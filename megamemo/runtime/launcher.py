"""N local training processes: what `launch/local.sh N ARGS...` runs (`python -m megamemo.commands.launch N ARGS...`,
whose flags megamemo/commands/launch.py reads).

Why not torchrun (which this replaced): its agent starts every worker in a session of its own, so a signal sent to
the launcher's process group never reaches them and a `kill -9` of the launcher leaves them training; SIGTERM to it
ends in its own traceback and exit 1; it dies on SIGUSR1 (no handler) and orphans the workers; and it turns any
worker failure into a ChildFailedError traceback with exit 1, losing megamemo's own exit code. Its elastic
restarts and rendezvous are not needed on one machine. This launcher:
  * starts the workers with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (a free port), each in a
    process group of its own, so that a terminal's Ctrl-C or a `kill -- -PGID` reaches only this process;
  * forwards SIGTERM, SIGINT, SIGHUP and SIGUSR1 to every worker, holding a signal for a worker until it has
    installed its handler (SigCgt in /proc/PID/status), so a signal during start-up is honoured once start-up
    ends (the worker then saves and stops); a second SIGINT kills the workers at once;
  * ties the workers to itself: `megamemo train` asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG),
    so a `kill -9` of this launcher makes them save and stop instead of training on as orphans;
  * when a worker fails, kills the others at once (they cannot go on without it: their collectives would fail with
    messages of their own) and exits with the failed worker's exit code (2 for bad usage, config, data or checkpoint,
    as megamemo prints it, in one line); after an exit 2 the others first get EXPLAINED_GRACE_S to end on their own,
    so that rank 0 can print the line of an error every rank met;
  * records the failure in <run_dir>/interruptions.jsonl (runtime/interruptions.py: rank 0 tells it the run
    directory) and, with --max-restarts N (torchrun's meaning), starts all the workers again, at most N times, after
    a retryable failure: they resume from the newest committed checkpoint. One line per restart says its cause.
    With MEGAMEMO_REPLAY_SUSPECT=1 a node-suspect stop (exit 5) is first replayed in other processes and the
    replay's verdict and decision go into its record (runtime/suspect.py; one machine: there is no node to exclude,
    the job restarts from the newest agreeing checkpoint whatever the decision).
    Never after exit 2 (bad usage, config, data, a refused checkpoint), nor after a stop signal, nor after failing
    SAME_STEP_LIMIT times in a row at the same step (deterministic: one line says so). Each start gets a fresh
    MASTER_PORT (unless the environment fixes one) and MEGAMEMO_RESTART = the restarts before it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megamemo.runtime import interruptions, suspect
from megamemo.runtime.dist import free_port
from megamemo.runtime.interruptions import Exit

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# After a worker's exit 2 (an error megamemo explains in one line), how long the others may take to end on their own
# before they are killed: a bad config or data directory is met by every rank at start-up and rank 0 alone says it,
# so killing them at once could kill rank 0 before its line (rank 1 is often the first to fail); a rank still in a
# collective with the one that left ends on its own with exit 4 (interruptions.EXIT_PEER_LOST)
EXPLAINED_GRACE_S = 10.0


def handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (bit sig-1 of SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool((int(line.split()[1], 16) >> (sig - 1)) & 1)
    except (OSError, ValueError):
        return False
    return not Path("/proc").is_dir()  # no /proc (not Linux): deliver at once


class Launcher:
    def __init__(
        self,
        n: int,
        cmd: list[str],
        log=lambda m: print(m, file=sys.stderr, flush=True),
        max_restarts: int = 0,
        run_dir_file: str | None = None,
    ):
        self.n, self.cmd, self.log = n, cmd, log
        self.max_restarts, self.restarts = max_restarts, 0
        self.run_dir_file = run_dir_file  # where rank 0 writes its run directory
        self.procs: list[subprocess.Popen] = []
        self.pending: list[set[int]] = []
        self.exits: dict[int, Exit] = {}  # rank -> how it ended, in this start
        self.interrupts = 0
        self.stopping = False  # a stop signal was passed on: the job is not started again
        self.started = 0.0

    def start(self) -> None:
        port = os.environ.get("MASTER_PORT") or str(free_port())
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // self.n))
        self.procs, self.pending, self.exits, self.started = [], [], {}, time.time()
        extra = {interruptions.RUN_DIR_FILE: self.run_dir_file} if self.run_dir_file else {}
        for r in range(self.n):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(self.n),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(self.n),
                MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                MASTER_PORT=port,
                OMP_NUM_THREADS=threads,
                MEGAMEMO_RESTART=str(self.restarts),
                **extra,
            )
            self.procs.append(subprocess.Popen(self.cmd, env=env, process_group=0))
            self.pending.append(set())

    def on_signal(self, sig, _frame) -> None:
        self.stopping = True
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self.log("[launch] second interrupt: killing the workers")
                self.kill()
                return
            sig = signal.SIGTERM  # a first Ctrl-C: save and stop, like a scheduler's TERM
        self.log(
            f"[launch] {signal.Signals(sig).name}: passing it to the {self.n} worker(s) (they finish the step, "
            f"save and stop)"
        )
        for pending in self.pending:
            pending.add(sig)
        self.deliver()

    def deliver(self) -> None:
        for p, pending in zip(self.procs, self.pending, strict=True):
            for sig in sorted(pending):
                if p.poll() is not None:
                    pending.clear()
                elif handles(p.pid, sig):
                    p.send_signal(sig)
                    pending.discard(sig)

    def kill(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                p.kill()
                self.exits.setdefault(r, Exit(r, -signal.SIGKILL, time.time(), socket.gethostname(), killed=True))

    def _note_exits(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None and r not in self.exits:
                self.exits[r] = Exit(r, p.returncode, time.time(), socket.gethostname())

    def wait(self) -> int:
        """Until every worker ended -> 0, or the exit code of the failure: 2 when a worker explained it (megamemo's
        one line for bad usage, config, data or checkpoint), else the first failed worker's (128 + N for signal N)."""
        first: tuple[int, int] | None = None  # the first worker seen failing: the cause
        stopped = False
        kill_at = None  # when the others are killed (after an explained error: a grace)
        # every worker polled each round (not any()'s first running one: a higher rank's failure would go unseen
        # while a lower one runs, or hangs in a collective waiting for it)
        while [p.poll() for p in self.procs].count(None):
            self.deliver()
            self._note_exits()
            if first is None:
                first = _first_failure(self.procs)
                if first is not None:
                    explained = (interruptions.EXIT_USAGE, interruptions.EXIT_NODE_SUSPECT)  # rank 0 says it
                    grace = EXPLAINED_GRACE_S if first[1] in explained else 0.0
                    kill_at = time.time() + grace
            if kill_at is not None and not stopped and time.time() >= kill_at:
                self.kill()  # the others cannot go on without it
                stopped = True
            time.sleep(0.05)
        self._note_exits()
        codes = [p.returncode for p in self.procs]
        if 2 in codes:
            return 2
        if not any(codes):
            return 0
        found = first or _first_failure(self.procs)
        assert found is not None  # a worker exited non-zero
        r, c = found
        self.log(f"[launch] worker {r} exited with {_describe(c)}" + (": the others were stopped" if stopped else ""))
        return c if c > 0 else 128 - c

    def supervise(self, early: Sequence[str] = ()) -> int:
        """Start the workers, and again after each retryable failure while restarts are left -> the exit code.
        early: signals (TERM, USR1, ...) that arrived before the first start, passed on once it began."""
        while True:
            self.start()
            for name in early:
                self.on_signal(signal.Signals[f"SIG{name}"], None)
            early = ()
            rc = self.wait()
            if rc == 0 or self.stopping:
                return rc
            retry, why, rec = self.record()
            if self.stopping:  # a stop signal while the failure was recorded (a replay takes a while)
                return rc
            if not retry:
                if self.max_restarts and why:
                    self.log(f"[launch] not restarting: {why}" + (f" ({interruptions.summary(rec)})" if rec else ""))
                return rc
            self.restarts += 1
            self.log(
                f"[launch] restart {self.restarts}/{self.max_restarts}: "
                + (interruptions.summary(rec) if rec else interruptions.describe(rc))
                + f"; starting the {self.n} worker(s) again from the newest committed checkpoint"
            )

    def record(self) -> tuple[bool, str, dict | None]:
        """The failure's record in the run directory (when rank 0 said which) -> (start again?, why not, record)."""
        run_dir = interruptions.read_run_dir(self.run_dir_file)
        exits = list(self.exits.values())
        first = interruptions.culprit(exits)
        left = self.max_restarts - self.restarts
        if (
            first is not None
            and not interruptions.retryable(first.code)
            and (run_dir is None or not interruptions.read_heartbeats(run_dir, since=self.started))
        ):
            return False, interruptions.USAGE, None  # refused before training (config, data, the lock): no record
        if run_dir is None or first is None:  # failed before rank 0 named its run directory
            return left > 0, "" if left > 0 else "no restarts left", None
        past = interruptions.history(run_dir)
        rec = interruptions.record(
            run_dir,
            exits,
            started=self.started,
            restart=self.restarts,
            launcher="local",
            consult=lambda r: {"replay": suspect.replay(run_dir, r, self.log)} if suspect.enabled(r) else {},
        )
        retry, why = interruptions.decide(rec, past, left)
        return retry, why, rec


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """(rank, exit code) of a failed worker, or None. Several failed since the last look: a SIGABRT (gloo aborting a
    rank whose peer vanished mid-collective) and exit 4 (a rank that saw its peer vanish) are a peer's consequence,
    not the cause; else the lowest rank."""
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
    return (
        min(failed, key=lambda rc: (rc[1] in (-signal.SIGABRT, interruptions.EXIT_PEER_LOST), rc[0]))
        if failed
        else None
    )


def _describe(rc: int) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
