"""`megamemo replay`: recompute a training run's steps from the newest checkpoint before a step up to it, and compare
every replayed step's loss, gradient norm and LR (and, at a checkpoint step, every saved tensor) with what the run
recorded (megamemo/train/replay.py); `--rolled-back`: the attempt at S that a loss spike's rollback undid.

    megamemo replay --ckpt RUN_DIR --step S [--rolled-back] [--dp N --tp N --pp N] [--keep]

One line of verdict: `replay: identical`, `replay: within <tolerance>` or `replay: differs at step N: <what>`.
Exit codes: 0 identical or within; 1 differs; 2 the replay cannot be made (no such step, no checkpoint before it).
"""

from __future__ import annotations

import argparse

from megamemo.commands import flags


def parse_args(argv):
    """The flags: --ckpt, then one per field of the library's Request (megamemo/train/replay.py)."""
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.train.replay import Request

    p = argparse.ArgumentParser(prog="megamemo replay", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt", help="the training run directory (or one of its step_* directories)")
    flags.add_fields(p, Request)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.train.replay import Request, replay

    a = parse_args(argv)
    line = replay(a.ckpt, flags.request(a, Request))
    print(line, flush=True)
    return 1 if " differs at " in line else 0
