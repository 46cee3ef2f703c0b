"""The flags several commands share, defined once: --ckpt, --data, --device, --mem-len and --dtype (eval, generate,
analyze, convert, export, harness), --config and --set (train, plan) mean the same wherever they appear (a command may
say more in its own help, take --ckpt more than once, or make --data optional). Three flags only share a name with
these: `megamemo plan --device` (the kind of ranks a layout is planned for: GPUs or CPU processes), `megamemo prepare
--dtype` (how token ids are stored) and `megamemo convert import-reference --config` (the reference model's
constructor arguments).

--device defaults to "auto", which the command resolves when it runs (runtime/device.py torch_device: cuda where
torch sees a device, else the CPU): a parser, and so docs/reference/cli.md, is the same on every machine.
"""
from __future__ import annotations

import argparse
from typing import Any

from megamemo.util.precision import NAMES as PRECISIONS

SHARED: dict[str, dict[str, Any]] = {
    "config": dict(required=True, metavar="FILE", help="run config YAML (see configs/)"),
    "set": dict(action="append", default=[], metavar="KEY=VALUE",
                help="override a config field, e.g. --set optim.lr=1e-4 (repeatable)"),
    "ckpt": dict(required=True, metavar="CKPT",
                 help="a single-device checkpoint, a training run directory, its checkpoints/ directory or a step_* "
                      "directory"),
    "data": dict(metavar="DIR",
                 help="shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of one"),
    "device": dict(default="auto", help="torch device: auto (cuda when torch sees one, else cpu), cpu, cuda, cuda:N"),
    "mem-len": dict(type=int, metavar="N", help="memory length (default: the checkpoint's mem_len)"),
    "dtype": dict(choices=PRECISIONS, help="the weights' dtype"),
}


def add(parser: argparse.ArgumentParser, name: str, *, help: str | None = None, required: bool | None = None,
        repeat: bool = False, extra_choices: tuple = (), default=None) -> argparse.Action:
    """Adds the shared flag `--name` to `parser`. A command may give its own help (what the flag means to it),
    require it or not, take it more than once (repeat: a list), allow more choices (--dtype's "checkpoint") and set
    the default those choices need; the flag's type and meaning stay the ones defined here."""
    spec = dict(SHARED[name])
    if help is not None:
        spec["help"] = help
    if required is not None:
        spec["required"] = required
    if repeat:
        spec["action"] = "append"           # (--set always is)
    if extra_choices:
        spec["choices"] = (*spec["choices"], *extra_choices)
    if default is not None:
        spec["default"] = default
    return parser.add_argument(f"--{name}", **spec)
