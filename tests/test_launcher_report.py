"""megamemo/runtime/launcher.py names the worker whose failure stopped the job, not a peer that died of it: workers here are
small Python programs (MEGAMEMO_TRAIN_CMD), no training."""
import os
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    time.sleep(0.5)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)        # the cause: killed with -9
    time.sleep(0.02)
    os.abort()                                      # the consequence, as gloo aborts a rank whose peer vanished
""")


def launch(tmp_path, worker: str, n: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = dict(os.environ, MEGAMEMO_TRAIN_CMD=f"{sys.executable} {script}")
    return subprocess.run([sys.executable, "-m", "megamemo.runtime.launcher", str(n)], env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_first_failure_is_reported_not_the_peer_that_aborted_after_it(tmp_path):
    r = launch(tmp_path, WORKER)
    assert r.returncode == 128 + 9, r.stderr
    assert "worker 0 exited with signal SIGKILL" in r.stderr and "SIGABRT" not in r.stderr, r.stderr


def test_a_worker_that_explains_its_error_gives_exit_2(tmp_path):
    r = launch(tmp_path, "import os, sys\nsys.exit(2 if os.environ['RANK'] == '1' else 0)\n")
    assert r.returncode == 2, r.stderr
