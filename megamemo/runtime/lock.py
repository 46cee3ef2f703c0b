"""One trainer per run directory: `<run_dir>/LOCK` names its holder.

The file (JSON) holds the holder's host, pid and that process's start time (so a reused pid is not taken for the
holder), the Slurm job id when there is one, when it started, a heartbeat time that a background thread refreshes
every `heartbeat_s`, and a random token. A second trainer started on the same run directory (a resubmitted job while
the old one still runs, a requeue racing a straggler) is refused with the holder named. A dead holder's lock is
taken over with one line saying so: on the same host when its process is gone (or a zombie: killed and not yet
reaped, which under a PID 1 that never reaps lasts for ever); from another host when its
heartbeat is older than `stale_after_s` (clocks of a cluster's nodes agree to well within that); at once, from any
host, when it was an earlier start of the same Slurm job (its restart count lower than this start's: Slurm ended
that start's processes before it started this one, and a requeue after a failure may land on other nodes).

Works on a shared file system across nodes: creation is O_CREAT|O_EXCL, the heartbeat is written to a temporary
file and renamed over the lock, and a take-over renames the stale lock away under a name that carries its token,
then checks it moved the stale lock and not a fresh one.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from megamemo.runtime.interruptions import restart_count
from megamemo.util.errors import MegamemoError
from megamemo.util.files import write_text_atomic

LOCK = "LOCK"


class RunLockedError(MegamemoError, RuntimeError):
    """Another live trainer holds the run directory; the message names it."""


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None if it is gone."""
    fields = _proc_stat(pid)
    return fields[19] if fields else None


DEAD_STATES = ("Z", "X", "x")  # zombie (exited, not yet reaped by its parent) and dead: neither runs again


def _alive_here(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    fields = _proc_stat(pid)
    if fields is not None and fields[0] in DEAD_STATES:
        return False  # killed, waiting for a parent (or a PID 1) that may never reap it
    start = fields[19] if fields else None
    if start is None:
        try:  # no /proc (not Linux): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()
    return holder.get("pid_start") in (None, start)


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    beat = time.time() - float(holder.get("heartbeat", 0))
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}, last heartbeat "
        f"{beat:.0f}s ago"
    )


class RunLock:
    def __init__(self, run_dir: Path, heartbeat_s: float = 30.0, stale_after_s: float = 600.0, log=print):
        self.path = Path(run_dir) / LOCK
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.log = log
        self.token = secrets.token_hex(8)
        self.pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _record(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": self.pid,
            "pid_start": _proc_start(self.pid),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "restart": restart_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "heartbeat": time.time(),
            "token": self.token,
        }

    def _read(self, path: Path | None = None) -> dict | None:
        try:
            return json.loads((path or self.path).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: half-written by a holder that died; stale

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is dead, or None if it may be alive."""
        if not holder:
            return "unreadable lock file"
        job = os.environ.get("SLURM_JOB_ID")
        if (
            job
            and holder.get("slurm_job") == job
            and isinstance(holder.get("restart"), int)
            and holder["restart"] < restart_count()
        ):
            return f"an earlier start (restart {holder['restart']}) of this Slurm job, which has ended"
        if holder.get("host") == socket.gethostname():
            return None if _alive_here(holder) else "its process is gone"
        age = time.time() - float(holder.get("heartbeat", 0))
        return f"no heartbeat for {age:.0f}s (> {self.stale_after_s:.0f}s)" if age > self.stale_after_s else None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = self._record()
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released meanwhile: try again
                why = self._stale(holder)
                if why is None:
                    raise RunLockedError(
                        f"{self.path.parent}: another trainer is running in this run directory "
                        f"({describe(holder)}); stop it, or train in another --run-dir"
                    ) from None
                self._take_over(holder, why)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise RunLockedError(f"{self.path}: could not take the lock (it keeps changing hands)")

    def _take_over(self, holder: dict, why: str) -> None:
        moved = self.path.with_name(f"{LOCK}.stale-{holder.get('token', 'unreadable')}")
        try:
            os.replace(self.path, moved)
        except FileNotFoundError:
            return  # another contender moved it first
        if (self._read(moved) or {}).get("token") != holder.get("token"):
            try:  # we moved a fresh lock taken meanwhile: put it back
                os.link(moved, self.path)
            except FileExistsError:
                pass
            moved.unlink(missing_ok=True)
            return
        moved.unlink(missing_ok=True)
        self.log(
            f"[lock] took over {self.path} from a dead trainer ({describe(holder) if holder else 'unknown'}: {why})"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            current = self._read()
            if not current or current.get("token") != self.token:
                self.log(f"[lock] {self.path} was taken by another process; this trainer no longer holds it")
                return
            try:
                write_text_atomic(self.path, json.dumps({**current, "heartbeat": time.time()}), durable=False)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held and (self._read() or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.held = False
