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
import dataclasses
import types
import typing
from typing import Any

from megamemo.util.field_comments import field_comments
from megamemo.util.precision import NAMES as PRECISIONS

SHARED: dict[str, dict[str, Any]] = {
    "config": dict(required=True, metavar="FILE", help="run config YAML (see configs/)"),
    "set": dict(
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set optim.lr=1e-4 (repeatable)",
    ),
    "ckpt": dict(
        required=True,
        metavar="CKPT",
        help="a single-device checkpoint, a training run directory, its checkpoints/ directory or a step_* directory",
    ),
    "data": dict(
        metavar="DIR", help="shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of one"
    ),
    "device": dict(default="auto", help="torch device: auto (cuda when torch sees one, else cpu), cpu, cuda, cuda:N"),
    "mem-len": dict(type=int, metavar="N", help="memory length (default: the checkpoint's mem_len)"),
    "dtype": dict(choices=PRECISIONS, help="the weights' dtype"),
}


def add(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    help: str | None = None,
    required: bool | None = None,
    repeat: bool = False,
    extra_choices: tuple = (),
    default=None,
) -> argparse.Action:
    """Adds the shared flag `--name` to `parser`. A command may give its own help (what the flag means to it),
    require it or not, take it more than once (repeat: a list), allow more choices (--dtype's "checkpoint") and set
    the default those choices need; the flag's type and meaning stay the ones defined here."""
    spec = dict(SHARED[name])
    if help is not None:
        spec["help"] = help
    if required is not None:
        spec["required"] = required
    if repeat:
        spec["action"] = "append"  # (--set always is)
    if extra_choices:
        spec["choices"] = (*spec["choices"], *extra_choices)
    if default is not None:
        spec["default"] = default
    return parser.add_argument(f"--{name}", **spec)


def add_fields(parser: argparse.ArgumentParser, cls, *, shared: dict | None = None, **specs) -> None:
    """Adds one flag per field of the dataclass `cls` (a library request type), `--field-name`, so the field is
    declared once, in the library: its type, its default and its help (the comment beside the field, read by
    megamemo/util/field_comments.py) make the flag. A field without a default is required; `bool | None` makes
    --name / --no-name (None: neither given); `list[float]` reads comma-separated numbers, `list[str]` one or more
    values. `shared` maps a field to a shared flag of SHARED above ({field: dict of add()'s keywords}): its type,
    metavar and default (where SHARED declares one) are the shared ones, its help the field's. `specs`: argparse
    keywords one flag adds (choices); a field's type or meaning stays the field's."""
    helps = field_comments(cls)
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not helps.get(f.name):
            raise TypeError(f"{cls.__name__}.{f.name}: no comment beside the field to be its flag's help")
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = dict(help=helps[f.name], default=default)
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        if shared and f.name in shared:
            name = f.name.replace("_", "-")
            if "default" in SHARED[name]:  # the shared flag's own default (--device auto), declared once above
                kwargs.pop("default")
            add(parser, name, **{**kwargs, **shared[f.name]})
            continue
        kwargs.update(_argparse_type(types[f.name], f.name))
        kwargs.update(specs.get(f.name, {}))
        parser.add_argument(f"--{f.name.replace('_', '-')}", **kwargs)


def field_values(args: argparse.Namespace, cls) -> dict:
    """The parsed flags add_fields made for `cls`, as its keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}


def request(args: argparse.Namespace, cls, **resolved):
    """The request `cls` from the parsed flags add_fields made for it, with `resolved` values (what the command
    decides when it runs, e.g. --device auto) in place of the flags'."""
    return cls(**{**field_values(args, cls), **resolved})


def _argparse_type(hint, name: str) -> dict:
    """argparse keywords for a field's type: int, float, str, bool, `X | None` of those, list[float] or list[str]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
    if base is bool:
        return dict(action="store_true") if hint is bool else dict(action=argparse.BooleanOptionalAction)
    if typing.get_origin(base) is list and typing.get_args(base) == (float,):
        return dict(type=_numbers, metavar="X,Y,...")
    if typing.get_origin(base) is list and typing.get_args(base) == (str,):
        return dict(nargs="+")
    if base in (int, float, str):
        return dict(type=base)
    raise TypeError(f"{name}: a field of type {hint} has no flag form")


def _numbers(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
