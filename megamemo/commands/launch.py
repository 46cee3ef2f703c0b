"""The local launcher's entry point: N training processes on this machine under megamemo/runtime/launcher.py, which
says what it does with signals, failures and restarts. launch/local.sh runs it (so do `megamemo replay` and
bench/soak.py).

    python -m megamemo.commands.launch [--max-restarts K] N [megamemo train args...]

Exit code: the failed worker's (2 for bad usage, config, data or checkpoint), else 0; 2 for a bad command line.
MEGAMEMO_TRAIN_CMD replaces the worker command (`python -m megamemo train`; tests run scripted workers).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile

USAGE = (
    "usage: python -m megamemo.commands.launch [--max-restarts K] N [megamemo train args...]   (N: number of "
    "processes; K: restarts after failures, default 0)"
)


def parse(argv: list[str]) -> tuple[int, int, list[str]] | None:
    """(N, max restarts, train args) from `[--max-restarts K | --max-restarts=K] N ARGS...`, or None."""
    restarts = 0
    if argv and argv[0].startswith("--max-restarts"):
        flag, _, value = argv[0].partition("=")
        if flag != "--max-restarts":
            return None
        if not value:
            if len(argv) < 2:
                return None
            value, argv = argv[1], argv[1:]
        if not value.isdigit():
            return None
        restarts, argv = int(value), argv[1:]
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        return None
    return int(argv[0]), restarts, argv[1:]


def main(argv: list[str] | None = None) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.runtime.launcher import FORWARDED, Launcher

    parsed = parse(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    n, max_restarts, args = parsed
    train = shlex.split(os.environ.get("MEGAMEMO_TRAIN_CMD", "")) or [sys.executable, "-m", "megamemo", "train"]
    fd, run_dir_file = tempfile.mkstemp(prefix="megamemo-run-dir-")
    os.close(fd)
    launcher = Launcher(n, train + args, max_restarts=max_restarts, run_dir_file=run_dir_file)
    for sig in FORWARDED:
        signal.signal(sig, launcher.on_signal)
    early = os.environ.pop("MEGAMEMO_PENDING_SIGNALS", "").split()  # caught by launch/local.sh before us
    try:
        return launcher.supervise(early)
    finally:
        launcher.kill()
        os.unlink(run_dir_file)


if __name__ == "__main__":
    sys.exit(main())
