"""One trainer per run directory: the LOCK file names its holder; a live holder refuses a second trainer, a dead
one (process gone on this host, or no heartbeat from another host for longer than the timeout) is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megamemo.runtime.lock import LOCK, RunLock, RunLockedError, _proc_start


def test_a_live_holder_refuses_a_second_trainer_and_release_frees_it(tmp_path):
    first = RunLock(tmp_path / "run", heartbeat_s=0.05)
    first.acquire()
    holder = json.loads((tmp_path / "run" / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(
        RunLockedError,
        match=rf"another trainer is running .*pid {os.getpid()} on "
        rf"{socket.gethostname()}",
    ):
        RunLock(tmp_path / "run").acquire()
    beat = holder["heartbeat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / "run" / LOCK).read_text())["heartbeat"] > beat  # the heartbeat runs
    first.release()
    assert not (tmp_path / "run" / LOCK).exists()
    second = RunLock(tmp_path / "run")
    second.acquire()
    now = json.loads((tmp_path / "run" / LOCK).read_text())
    assert second.held and now["token"] == second.token != holder["token"] and now["pid"] == os.getpid()
    second.release()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK).write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": int(gone.stdout),
                "token": "t1",
                "heartbeat": time.time(),
                "started": "then",
            }
        )
    )
    said = []
    lock = RunLock(tmp_path, log=said.append)
    lock.acquire()
    assert "took over" in said[0] and "its process is gone" in said[0] and f"pid {int(gone.stdout)}" in said[0]
    assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.token
    lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """The holder's pid now belongs to another process (this one): its recorded start time tells them apart."""
    (tmp_path / LOCK).write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_start": "1",
                "token": "t2",
                "heartbeat": time.time(),
            }
        )
    )
    said = []
    lock = RunLock(tmp_path, log=said.append)
    lock.acquire()
    assert len(said) == 1 and "took over" in said[0] and "its process is gone" in said[0], said
    assert f"pid {os.getpid()} on {socket.gethostname()}" in said[0], said  # the old holder, named
    now = json.loads((tmp_path / LOCK).read_text())
    assert lock.held and now["token"] == lock.token != "t2"
    assert (now["pid"], now["pid_start"]) == (os.getpid(), _proc_start(os.getpid())) and now["pid_start"] != "1"
    lock.release()


def test_another_hosts_lock_is_stale_only_without_heartbeat(tmp_path):
    record = {"host": "gpu-node-17", "pid": 4242, "slurm_job": "991", "token": "t3", "started": "yesterday"}
    (tmp_path / LOCK).write_text(json.dumps({**record, "heartbeat": time.time() - 10}))
    with pytest.raises(RunLockedError, match=r"pid 4242 on gpu-node-17, Slurm job 991"):
        RunLock(tmp_path, stale_after_s=60).acquire()
    (tmp_path / LOCK).write_text(json.dumps({**record, "heartbeat": time.time() - 120}))
    said = []
    lock = RunLock(tmp_path, stale_after_s=60, log=said.append)
    lock.acquire()
    assert len(said) == 1 and "took over" in said[0] and "no heartbeat for 12" in said[0] and "gpu-node-17" in said[0]
    now = json.loads((tmp_path / LOCK).read_text())
    assert now["token"] == lock.token != "t3" and (now["host"], now["pid"]) == (socket.gethostname(), os.getpid())
    lock.release()


def test_an_earlier_start_of_the_same_slurm_job_is_dead_at_once(tmp_path, monkeypatch):
    """A job requeued after a failure may start on other nodes: the lock its previous start left (a fresh heartbeat,
    another host) is that start's, which Slurm ended, so it is taken over at once; the same start's or another job's
    is not."""
    record = {
        "host": "gpu-node-17",
        "pid": 4242,
        "slurm_job": "991",
        "restart": 2,
        "token": "t4",
        "heartbeat": time.time(),
    }
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.setenv("MEGAMEMO_RESTART", "2")
    for holder in (record, {**record, "slurm_job": "990", "restart": 1}):
        (tmp_path / LOCK).write_text(json.dumps(holder))
        with pytest.raises(RunLockedError, match="another trainer is running"):
            RunLock(tmp_path, stale_after_s=600).acquire()
    monkeypatch.setenv("MEGAMEMO_RESTART", "3")
    (tmp_path / LOCK).write_text(json.dumps(record))
    said = []
    lock = RunLock(tmp_path, stale_after_s=600, log=said.append)
    lock.acquire()
    assert "an earlier start (restart 2) of this Slurm job, which has ended" in said[0], said
    assert json.loads((tmp_path / LOCK).read_text())["restart"] == 3
    lock.release()


def test_a_zombie_holder_is_dead_and_taken_over(tmp_path):
    """A trainer killed with -9 whose parent has not reaped it yet (under a container's PID 1 that never reaps, for
    ever) is a zombie: its /proc entry stays, in state Z. Its lock is taken over, and the take-over says why."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # the child ends at once; the test does not reap it yet
    try:
        end = time.time() + 10
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.time() < end, "the child did not become a zombie"
            time.sleep(0.01)
        from megamemo.runtime.lock import _proc_start

        (tmp_path / LOCK).write_text(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": pid,
                    "token": "tz",
                    "pid_start": _proc_start(pid),
                    "heartbeat": time.time(),
                    "started": "then",
                }
            )
        )
        said = []
        lock = RunLock(tmp_path, log=said.append)
        lock.acquire()
        assert os.path.exists(f"/proc/{pid}"), "the holder must still be a zombie while the lock is taken"
        assert (
            len(said) == 1 and "took over" in said[0] and f"pid {pid}" in said[0] and "its process is gone" in said[0]
        ), said
        assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.token
        lock.release()
    finally:
        os.waitpid(pid, 0)


def test_a_live_child_holder_is_still_refused(tmp_path):
    """The same set-up with a child that still runs (state S): refused, so the zombie test above is not passing
    because every child is taken for dead."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from megamemo.runtime.lock import _proc_start

        (tmp_path / LOCK).write_text(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": child.pid,
                    "token": "tl",
                    "pid_start": _proc_start(child.pid),
                    "heartbeat": time.time(),
                }
            )
        )
        with pytest.raises(RunLockedError, match=rf"pid {child.pid} on"):
            RunLock(tmp_path).acquire()
    finally:
        child.kill()
        child.wait()
