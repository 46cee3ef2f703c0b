"""launch/slurm/failure.sh's helper after a failed start: prints shell assignments for it to eval (culprit: c_rank,
c_node, c_suspects; record: verdict, kind, step, replay_decision, replay_verdict, line, why, recorded), from
megamemo/runtime/interruptions.py.

    python3 -I scripts/slurm_failure.py slurm culprit|record --exits DIR --run-dir-file FILE --started T [...]

It runs on the batch host, isolated (-I: no PYTHONPATH, no user site), where megamemo need not be installed (a
container job): it loads interruptions.py by its path beside this script, and that module is standard library only.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "megamemo" / "runtime" / "interruptions.py"


def interruptions():
    """megamemo/runtime/interruptions.py, loaded by path (megamemo itself is not imported)."""
    spec = importlib.util.spec_from_file_location("megamemo_slurm_interruptions", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="slurm_failure.py",
        description="train.sbatch's failure helper: prints "
        "shell assignments (culprit: c_rank, c_node, c_suspects; record: verdict, kind, step, "
        "replay_decision, replay_verdict, line, why)",
    )
    p.add_argument("mode", choices=("slurm",))
    p.add_argument("what", choices=("culprit", "record"))
    p.add_argument("--exits", help="task.sh's exit folder")
    p.add_argument("--run-dir-file", help="the file rank 0 wrote its run directory to")
    p.add_argument("--started", type=float, default=0.0)
    p.add_argument("--rc", type=int, default=0, help="srun's exit code")
    p.add_argument("--restart", type=int, default=0)
    p.add_argument("--restarts-left", type=int, default=1)
    p.add_argument("--node", default="")
    p.add_argument("--node-fault", default="")
    p.add_argument("--job", default="")
    return interruptions().slurm_assignments(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
