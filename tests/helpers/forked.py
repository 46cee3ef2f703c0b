"""Ranks forked from a warm interpreter, for the tests that train many short runs (tests only).

A fresh `python -m megamemo train` spends 3-4 s of CPU importing torch, TorchDynamo, DeepSpeed, megatron-core and
megamemo before its first step, more than the tests' tiny runs spend training; on the 2 cores of CI that was about
a third of the suite. `ForkedRank` forks a rank from a fork server (multiprocessing's forkserver, one per pytest
process) that imported all that once (tests/helpers/warm_imports.py), then runs `megamemo.cli.main` with the rank's own
environment, working directory and log, as `python -m megamemo` would, and returns a handle with Popen's methods.

What a forked rank does not show, so the tests of those things start real interpreters (runs_cache.launch(...,
fresh=True), the launcher's, Slurm's and mpirun's tests, and every test of start-up itself): what a process imports
and when, a stop signal that arrives while it imports, and its interpreter's shutdown (a forked rank leaves through
multiprocessing, which joins its threads and skips atexit). Its imports read the server's environment, so a rank
whose environment differs in what imports read (another DS_ACCELERATOR or thread count: the GPU tests) starts fresh.
MEGAMEMO_TEST_FORK=0 starts every rank fresh.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # what puts the helpers package on the server's path
SERVER_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # set by tests/helpers/warm_imports.py
_context = None


def _enabled() -> bool:
    return os.environ.get("MEGAMEMO_TEST_FORK", "1") != "0"


def usable(env: dict) -> bool:
    """Whether a rank with this environment may be forked from the warm server."""
    return _enabled() and all(env.get(k) == v for k, v in SERVER_ENV.items())


def for_functions() -> bool:
    """Whether helpers/distributed.py may fork its ranks from the warm server: not where CUDA is (the server's imports
    read DS_ACCELERATOR=cpu), nor with MEGAMEMO_TEST_FORK=0."""
    import torch

    return _enabled() and not torch.cuda.is_available()


def context():
    """The multiprocessing context whose processes are forked from the warm server: multiprocessing's fork server,
    started once with tests/helpers/warm_imports.py imported. Python 3.11's server does not take the test process's
    sys.path, so it finds that module through PYTHONPATH, set while it starts."""
    global _context
    if _context is None:
        server = multiprocessing.get_context("forkserver")
        server.set_forkserver_preload(["helpers.warm_imports"])
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), *([before] if before else [])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        _context = server
    return _context


def _rank_main(argv: list[str], env: dict, out_path: str, err_path: str, cwd: str) -> None:
    if "helpers.warm_imports" not in sys.modules:  # the server swallows its preload's ImportError: no silent slow path
        raise RuntimeError("tests/helpers/forked.py: the fork server did not import tests/helpers/warm_imports.py")
    for target, path in ((1, out_path), (2, err_path)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh rank's output
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["megamemo", *argv]
    from megamemo.cli import main

    sys.exit(main(argv))


class ForkedRank:
    """A forked rank with the part of subprocess.Popen the tests use: pid, args, poll, wait, send_signal, kill,
    terminate, returncode (a signal's death is -N, as with Popen)."""

    def __init__(self, argv: list[str], env: dict, log_path, cwd, err_path=None):
        self.args = [sys.executable, "-m", "megamemo", *argv]
        self._process = context().Process(
            target=_rank_main, args=(argv, env, str(log_path), str(err_path or log_path), str(cwd))
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run_megamemo(args, env: dict, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m megamemo ARGS` run to its end with its output captured as text (subprocess.run's answer), forked
    from the warm server when its environment allows (usable), else in a fresh interpreter."""
    argv = [str(a) for a in args]
    cmd = [sys.executable, "-m", "megamemo", *argv]
    if not usable(env):
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        rank = ForkedRank(argv, env, out, cwd, err_path=err)
        try:
            code = rank.wait(timeout)
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
            raise
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))
