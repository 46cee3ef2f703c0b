"""Typed construction of config dataclasses from plain data (YAML / JSON / --set): every value is checked
against its field's annotation, and an unknown or ill-typed key is an error that names it."""
from __future__ import annotations

import dataclasses


# A field annotated `Switch` is a string choice that includes "on" / "off", which YAML 1.1 reads as booleans when
# unquoted (`compile: on`): a boolean is taken as "on" / "off" there, and nowhere else.
Switch = str


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_value(name: str, typ: str, value, error=ValueError):
    """`value` checked against a field annotation (a string under `from __future__ import annotations`)."""
    if typ.endswith(" | None"):
        if value is None:
            return None
        typ = typ[: -len(" | None")]
    if typ == "int" and _is_int(value):
        return value
    if typ == "float":
        if _is_int(value) or isinstance(value, float):
            return float(value)
        if isinstance(value, str):          # PyYAML reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    if typ == "bool" and isinstance(value, bool):
        return value
    if typ == "Switch" and isinstance(value, bool):
        return "on" if value else "off"
    if typ in ("str", "Switch") and isinstance(value, str):
        return value
    if typ == "dict" and isinstance(value, dict):
        return value
    if typ.startswith("list[") and isinstance(value, (list, tuple)):
        inner = typ[5:-1]
        return [check_value(f"{name}[{i}]", inner, v, error) for i, v in enumerate(value)]
    raise error(f"{name}: expected {typ}, got {type(value).__name__} {value!r}")


def build(cls, data, where: str, error=ValueError):
    """cls(**data) after checking every key and value; `where` prefixes the names in errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise error(f"{where}.{key}: unknown field (known: {', '.join(sorted(fields))})")
        sub = _subsection(fields[key])
        kwargs[key] = (build(sub, value, f"{where}.{key}", error) if sub is not None
                       else check_value(f"{where}.{key}", fields[key].type, value, error))
    return cls(**kwargs)


def _subsection(f: dataclasses.Field):
    """The dataclass of a field whose default is one (a section inside a section: train.spike), else None."""
    if f.default_factory is dataclasses.MISSING:
        return None
    cls = f.default_factory
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None
