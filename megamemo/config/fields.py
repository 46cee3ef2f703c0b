"""Declared config sections: `@section` makes a dataclass a pydantic one (every value checked on construction, an
unknown key refused), and the field types here say what YAML / `--set` may give. A field's choices are a `Literal`,
its range `Field(ge=..., gt=..., lt=...)` bounds; a rule across fields of one section is a `@model_validator` that
calls `bad(key, why)` (megamemo/config/run.py refusal); rules across sections are the run config's
(megamemo/train/config.py). one_line (below) turns pydantic's report into the one-line `key: why (got value)`."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Annotated, Literal, TypeVar

from pydantic import BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from .errors import ConfigError


def _no_bool(v):
    if isinstance(v, bool):  # a bool is an int to Python: not a number here
        raise PydanticCustomError("float_type", "Input should be a valid number, not a bool")
    return v


def _int_not_bool(v):
    if isinstance(v, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a bool")
    return v


def _switch(v):
    return ("on" if v else "off") if isinstance(v, bool) else v


Int = Annotated[int, Strict()]  # an int, never a bool or a float or a numeric string
Bool = Annotated[bool, Strict()]  # true / false only (not 1, "yes")
Float = Annotated[float, BeforeValidator(_no_bool)]  # an int or float, or a numeric string: PyYAML reads "1e-4"
# (no dot) as one; never a bool
IntChoice = BeforeValidator(_int_not_bool)  # with Literal[0, 1, 2]: True is no 1 there
# a choice that includes "on" / "off", which YAML 1.1 reads as booleans when unquoted (`compile: on`): a boolean is
# taken as "on" / "off" here, and nowhere else
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch)]

SECTION_CONFIG = ConfigDict(extra="forbid")
T = TypeVar("T")


@typing.dataclass_transform(field_specifiers=(dataclasses.field, Field))
def section(name: str):
    """A config section named `name` (`optim`, `train.spike`): a dataclass whose construction checks every field
    against its declaration; a refused value (constructing it, dataclasses.replace) is the one-line ConfigError
    naming the key (one_line below)."""

    def declare(cls: type[T]) -> type[T]:
        declared = _pydantic_dataclass(cls, config=SECTION_CONFIG)
        checked_init = declared.__init__

        @functools.wraps(checked_init)
        def __init__(self, *args, **kwargs):
            try:
                checked_init(self, *args, **kwargs)
            except ValidationError as e:
                raise one_line(e, declared, name) from None

        declared.__init__ = __init__  # type: ignore[method-assign]
        return typing.cast("type[T]", declared)

    return declare


def type_name(info: FieldInfo) -> str:
    """A declared field's type as a reader sees it: `float | None`, `list[int]`, `str` for a choice, `Switch`."""
    if any(getattr(m, "func", None) is _switch for m in info.metadata):
        return "Switch"
    return _render(info.annotation)


def _render(t) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "None"
    if origin is Literal:
        return type(args[0]).__name__
    if origin is Annotated:
        return _render(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_render(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_render(a) for a in args)}]"
    return t.__name__


def choices(values) -> str:
    """'a, b or c' (up to three choices), 'one of a, b, c, d' (more)."""
    values = [str(v) for v in values]
    if len(values) <= 3:
        return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]
    return "one of " + ", ".join(values)


def literal_values(annotation):
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if (found := literal_values(arg)) is not None:
            return found
    return None


BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}
TYPES = {
    "int_type": "int",
    "float_type": "float",
    "float_parsing": "float",
    "bool_type": "bool",
    "string_type": "str",
    "list_type": "list",
    "dict_type": "dict",
}


def _owner(cls, loc: tuple):
    """(the section class holding loc's last named part, that name, loc as a dotted key `.spike.window`)."""
    key, owner, name = "", cls, None
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        if name is not None:
            owner = owner.__pydantic_fields__[name].annotation
        name, key = part, key + f".{part}"
    return owner, name, key


def one_line(err: ValidationError, cls, where: str) -> ConfigError:
    """The first error of pydantic's report on section `cls` (named `where`) as one line naming the key."""
    e = err.errors(include_url=False)[0]
    if e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
        return e["ctx"]["error"]  # a section's own rule (refusal): already one line
    owner, name, key = _owner(cls, e["loc"])
    key, value = where + key, e.get("input")
    info = owner.__pydantic_fields__.get(name) if name else None
    if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return ConfigError(f"{key}: unknown field (known: {', '.join(sorted(owner.__pydantic_fields__))})")
    if e["type"] in BOUNDS:
        bound = next(v for k, v in e["ctx"].items() if k in ("ge", "gt", "lt", "le"))
        unit = " seconds" if key.endswith("_s") else ""
        return ConfigError(f"{key}: must be {BOUNDS[e['type']]} {bound}{unit} (got {value!r})")
    if e["type"] == "literal_error" and info is not None:
        allowed = literal_values(info.annotation) or ()
        if allowed and not isinstance(value, type(allowed[0])):  # a number for a word, a word for a number
            return ConfigError(f"{key}: expected {type_name(info)}, got {type(value).__name__} {value!r}")
        return ConfigError(f"{key}: must be {choices(allowed)} (got {value!r})")
    if e["type"] in ("too_short", "too_long"):
        n = e["ctx"].get("min_length") if e["type"] == "too_short" else e["ctx"].get("max_length")
        return ConfigError(
            f"{key}: expected {'at least' if e['type'] == 'too_short' else 'at most'} {n} items (got {value!r})"
        )
    if e["type"].startswith("dataclass_"):
        return ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    if e["type"] in TYPES or e["type"].endswith(("_type", "_parsing")):
        typ = TYPES.get(e["type"], e["type"].split("_")[0])
        if info is not None and not isinstance(e["loc"][-1], int):  # the field itself: its declared type
            typ = type_name(info)
        return ConfigError(f"{key}: expected {typ}, got {type(value).__name__} {value!r}")
    return ConfigError(f"{key}: {e['msg']} (got {value!r})")


__all__ = [
    "Bool",
    "Field",
    "Float",
    "Int",
    "IntChoice",
    "Literal",
    "Switch",
    "choices",
    "literal_values",
    "one_line",
    "section",
    "type_name",
]
