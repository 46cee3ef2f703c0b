"""The environment of a `megamemo` (or launcher script) subprocess started by a test on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# what a rank reads to join a job: a subprocess that inherited the test process's would join a job that is not there
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def cpu_env(*drop: str, **extra) -> dict[str, str]:
    """This process's environment with the venv's programs first on PATH (torchrun, deepspeed, mpirun), one
    intra-op thread, DeepSpeed on the CPU and unbuffered output; without the rendezvous variables nor those named in
    `drop`; with `extra` set (values as str)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and k not in drop}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env
