"""Keep third-party start-up noise off the terminal: installed by the `megamemo` entry point (megamemo/cli.py)
before any subcommand imports torch, DeepSpeed or megatron-core. Libraries are not edited.

What is filtered, and why it is safe to:
  - megatron-core's "Transformer Engine and Apex are not installed. Falling back to ..." UserWarnings, printed
    at import by every process (megamemo uses neither: its TP layers are megatron's local ones, its optimizer
    torch's Adam);
  - megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1, where it cannot apply: on CPU runs
    (DS_ACCELERATOR=cpu, as scripts/env.sh sets);
  - DeepSpeed ZeRO's FutureWarning for torch's deprecated all_gather_into_tensor name, every step.
Python's own switches win: with `python -W ...` or PYTHONWARNINGS set, no warning filter is installed.

Ranks: only rank 0 (RANK / SLURM_PROCID / the MPI launcher's rank, as megamemo/runtime/dist.py reads them) shows
warnings and DeepSpeed's / megatron-core's log records below ERROR; the other ranks print only errors (their
tracebacks and "error:" lines are untouched). MEGAMEMO_LOG_ALL_RANKS=1 shows every rank's output.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from megamemo.runtime.dist import mpi_rank, mpirun_inside_slurm

ALL_RANKS_ENV = "MEGAMEMO_LOG_ALL_RANKS"

# (message regex, category, module regex): warnings.filterwarnings arguments
THIRD_PARTY = [
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\."),
    (r".*all_gather_into_tensor.*deprecated", FutureWarning, ""),
]
CPU_ONLY = [
    (
        r"When using .* it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.",
    ),
]
# quiet below ERROR on ranks other than 0: module loggers (children inherit the level) and DeepSpeed's own
# logger, which sets its level when deepspeed is imported (after this runs), so it gets a filter instead
LOGGER_TREES = ("megatron", "deepspeed")
DEEPSPEED_LOGGER = "DeepSpeed"


def user_set_warnings(environ=None) -> bool:
    """True when the user chose warning filters (python -W, PYTHONWARNINGS): then megamemo installs none."""
    env = os.environ if environ is None else environ
    return bool(sys.warnoptions) or bool(env.get("PYTHONWARNINGS"))


def launcher_rank(environ=None) -> int:
    """This process's global rank as its launcher set it (0 without one), without importing torch or MPI."""
    env = os.environ if environ is None else environ
    try:
        if "RANK" in env:
            return int(env["RANK"])
        if "SLURM_PROCID" in env and not mpirun_inside_slurm(env):
            return int(env["SLURM_PROCID"])
        mpi = mpi_rank(env)
        return mpi[0] if mpi else 0
    except ValueError:
        return 0


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def install(environ=None) -> dict:
    """Install the filters for this process; returns what was done (for tests and the curious)."""
    env = os.environ if environ is None else environ
    all_ranks = env.get(ALL_RANKS_ENV, "").lower() in ("1", "true", "yes", "on")
    quiet_rank = not all_ranks and launcher_rank(env) != 0
    did = {"warning_filters": False, "rank_quiet": quiet_rank}
    if not user_set_warnings(env):
        rules = THIRD_PARTY + (CPU_ONLY if env.get("DS_ACCELERATOR") == "cpu" else [])
        for message, category, module in rules:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        if quiet_rank:
            warnings.simplefilter("ignore")
        did["warning_filters"] = True
    if quiet_rank:
        for name in LOGGER_TREES:
            logging.getLogger(name).setLevel(logging.ERROR)
        ds = logging.getLogger(DEEPSPEED_LOGGER)
        if _errors_only not in ds.filters:
            ds.addFilter(_errors_only)
    return did
