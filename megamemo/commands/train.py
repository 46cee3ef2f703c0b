"""`megamemo train`: one process per device (see launch/ for local.sh, srun and mpirun); megamemo/train/run.py runs
it, and says its exit codes.

    megamemo train --config FILE [--data SHARD_DIR] [--run-dir DIR] [--max-steps N] [--save-every N]
                   [--set key=value ...] [--tp N --pp M] [--resume auto|never|PATH]

A start in a run directory that holds a committed checkpoint resumes from the newest one (checkpoint.resume).
"""

from __future__ import annotations

import argparse

from megamemo.commands import flags

# a flag that sets a config key
KEYS = (
    ("data", "data.dir"),
    ("run_dir", "train.run_dir"),
    ("max_steps", "train.max_steps"),
    ("save_every", "checkpoint.save_every"),
    ("resume", "checkpoint.resume"),
    ("tp", "parallel.tp"),
    ("pp", "parallel.pp"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megamemo train", description=__doc__.split("\n\n")[0])
    flags.add(p, "config")
    flags.add(p, "data", help="shard directory or s3://, gs://, https:// URL of one (sets data.dir)")
    p.add_argument("--run-dir", help="run directory: config, metrics, TensorBoard, checkpoints (train.run_dir)")
    p.add_argument("--max-steps", type=int, help="train.max_steps")
    p.add_argument("--save-every", type=int, help="checkpoint.save_every")
    p.add_argument("--resume", help="checkpoint.resume: auto | never | a checkpoint or run directory")
    p.add_argument("--tp", type=int, help="parallel.tp (tensor parallel size)")
    p.add_argument("--pp", type=int, help="parallel.pp (pipeline parallel size)")
    flags.add(p, "set")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def config_sets(args: argparse.Namespace) -> list[str]:
    """--set overrides, then the flags that set a config key, as --set overrides."""
    sets = list(args.set)
    for flag, key in KEYS:
        v = getattr(args, flag)
        if v is not None:
            sets.append(f"{key}={v}" if not isinstance(v, str) else f"{key}={_yaml_str(v)}")
    return sets


def _yaml_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.train.run import run

    args = parse_args(argv)
    return run(args.config, config_sets(args))
