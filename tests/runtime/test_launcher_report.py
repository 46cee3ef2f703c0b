"""megamemo/runtime/launcher.py names the worker whose failure stopped the job, not a peer that died of it, and stops
the others as soon as one fails, whichever its rank, and with --max-restarts K starts them K more times, each start
numbered (MEGAMEMO_RESTART), before it gives up: workers here are small Python programs (MEGAMEMO_TRAIN_CMD), no
training."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megamemo.runtime.launcher import _first_failure

# Rank 1 is killed with -9 (the cause); rank 0, the lowest rank, aborts right after it (the consequence, as gloo
# aborts a rank whose peer vanished). Rank 0 learns of rank 1's death through a lock rank 1 holds until it dies, so
# it aborts within a millisecond of it: the launcher (polling every 50 ms) sees both failed at one look about 98% of
# the time, where only the rule "a SIGABRT is a consequence" names rank 1; the other 2% it sees rank 1 first.
WORKER = textwrap.dedent("""
    import fcntl, os, signal, sys, time
    rank, lock = int(os.environ["RANK"]), sys.argv[1]
    f = open(lock, "a")
    if rank == 1:
        fcntl.flock(f, fcntl.LOCK_EX)
        open(lock + ".held", "w").close()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)        # the cause: killed with -9
    while not os.path.exists(lock + ".held"):
        time.sleep(0.005)
    fcntl.flock(f, fcntl.LOCK_EX)                   # free once rank 1 is dead
    os.abort()                                      # the consequence
""")

# Rank 1 fails; rank 0 would wait for it for 30 s (as a rank waits in a collective for a peer that is gone)
HANGS = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "1":
        time.sleep(0.3)
        sys.exit(3)
    time.sleep(30)
""")


def launch(tmp_path, worker: str, n: int = 2, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = dict(os.environ, MEGAMEMO_TRAIN_CMD=f"{sys.executable} {script} {tmp_path / 'lock'}")
    env.pop("MEGAMEMO_RESTART", None)
    return subprocess.run(
        [sys.executable, "-m", "megamemo.commands.launch", *flags, str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_first_failure_is_reported_not_the_lower_rank_that_aborted_after_it(tmp_path):
    r = launch(tmp_path, WORKER)
    assert r.returncode == 128 + 9, r.stderr
    assert "[launch] worker 1 exited with signal SIGKILL" in r.stderr and "SIGABRT" not in r.stderr, r.stderr


def test_a_higher_rank_that_fails_stops_the_lower_ones_at_once(tmp_path):
    t0 = time.monotonic()
    r = launch(tmp_path, HANGS)
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert "[launch] worker 1 exited with exit code 3: the others were stopped" in r.stderr, r.stderr
    assert took < 15, took  # not rank 0's 30 s


class Ended:
    def __init__(self, returncode):
        self.returncode = returncode


def test_a_sigabrt_is_a_consequence_whatever_the_ranks():
    """The rule itself, without processes: among the workers seen failed at one look, a SIGABRT is a peer's
    consequence; otherwise (or among several of one kind) the lowest rank."""
    abort, kill = -signal.SIGABRT, -signal.SIGKILL
    assert _first_failure([Ended(abort), Ended(kill)]) == (1, kill)
    assert _first_failure([Ended(kill), Ended(abort)]) == (0, kill)
    assert _first_failure([Ended(abort), Ended(None), Ended(2)]) == (2, 2)
    assert _first_failure([Ended(0), Ended(abort), Ended(abort)]) == (1, abort)
    assert _first_failure([Ended(None), Ended(1), Ended(kill)]) == (1, 1)
    assert _first_failure([Ended(0), Ended(None)]) is None


def test_a_worker_that_explains_its_error_gives_exit_2(tmp_path):
    r = launch(tmp_path, "import os, sys\nsys.exit(2 if os.environ['RANK'] == '1' else 0)\n")
    assert r.returncode == 2, r.stderr


# A bad config met by every rank at start-up: rank 1 gets there first and leaves with exit 2 without a word (rank 0
# alone says it), rank 0 a second later (still importing torch, on loaded cores) says the line and leaves with 2
RANK0_SAYS_IT_LATER = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "1":
        sys.exit(2)
    time.sleep(1.0)
    print("megamemo train: error: optim.lr: must be > 0", file=sys.stderr, flush=True)
    sys.exit(2)
""")


def test_after_an_explained_error_rank_0_may_still_say_it():
    """Exit 2 is an error every rank meets at start-up and rank 0 says: the launcher gives the others time to end on
    their own (EXPLAINED_GRACE_S) before it kills them, so the line is not lost when another rank was quicker."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        r = launch(Path(d), RANK0_SAYS_IT_LATER)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("megamemo train: error: optim.lr: must be > 0") == 1, r.stderr
    assert "the others were stopped" not in r.stderr, r.stderr  # (the launcher adds no line of its own to a 2)


# Every start fails: each rank notes the restart number it was given (MEGAMEMO_RESTART), rank 1 exits 1 once rank 0
# has noted its own (the launcher stops the other ranks when one fails: rank 0 could be stopped before it wrote)
NOTES_AND_FAILS = textwrap.dedent("""
    import os, sys, time
    note = f"{os.environ['RANK']}:{os.environ['MEGAMEMO_RESTART']}"
    with open(sys.argv[1] + ".starts", "a") as f:
        f.write(note + "\\n")
    if os.environ["RANK"] == "1":
        mine = "0:" + os.environ["MEGAMEMO_RESTART"]
        end = time.time() + 60
        while time.time() < end and mine not in open(sys.argv[1] + ".starts").read().split():
            time.sleep(0.05)
        sys.exit(1)
""")


@pytest.mark.parametrize("restarts", [0, 2])
def test_max_restarts_are_used_up_each_start_numbered_then_the_failure_is_the_exit_code(tmp_path, restarts):
    """--max-restarts K after a retryable failure (exit 1): K + 1 starts in all, the k-th given MEGAMEMO_RESTART=k on
    every rank, one line per restart, then the failure's exit code and one line saying why no more."""
    r = launch(tmp_path, NOTES_AND_FAILS, 2, *(["--max-restarts", str(restarts)] if restarts else []))
    assert r.returncode == 1, r.stderr
    starts = (tmp_path / "lock.starts").read_text().split()
    assert sorted(starts) == sorted(f"{rank}:{k}" for k in range(restarts + 1) for rank in (0, 1)), starts
    lines = [x for x in r.stderr.splitlines() if x.startswith("[launch] restart ")]
    assert [x.split(":")[0] for x in lines] == [f"[launch] restart {k}/{restarts}" for k in range(1, restarts + 1)], (
        r.stderr
    )
    assert r.stderr.count("[launch] worker 1 exited with exit code 1") == restarts + 1, r.stderr
    assert ("[launch] not restarting: no restarts left" in r.stderr) == (restarts > 0), r.stderr
