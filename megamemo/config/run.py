"""A run's configuration, composed: one YAML file plus `--set a.b=value` overrides, read into typed sections.

Every section is a declared dataclass (megamemo/config/fields.py: pydantic checks each value against its type,
choices and bounds on construction) that the package using it defines: the model's (megamemo/model/config.py),
the data's (megamemo/data/config.py), the parallel layout's (megamemo/parallel/config.py), and training's own
(optim, precision, train, checkpoint, log, eval: megamemo/train/config.py, which also declares which sections a
training run has and holds the rules across sections). This module only composes them: it reads the YAML, applies
`--set`, builds every section (an unknown, ill-typed or out-of-range key is a one-line `ConfigError` naming it:
`optim.lr: expected float, got str 'fast'`, `parallel.tp: must be >= 1 (got 0)`). It imports nothing of megamemo but
util.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import ConfigError
from .fields import one_line

__all__ = ["ConfigError", "Run", "apply_overrides", "check_sections", "read", "refusal", "section"]


def section(cls, data, where: str):
    """Section `cls` (a declared dataclass, fields.section) from plain data (a mapping, or None for every default);
    the first bad key or value is a one-line ConfigError naming it."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.__pydantic_validator__.validate_python(data)  # as cls(**data), its errors named by `where`
    except ValidationError as e:
        raise one_line(e, cls, where) from None


def refusal(obj, prefix: str):
    """bad(key, why) for a section's own rules (a model_validator): ConfigError `key: why (got value)`, the value
    read from obj, the section named `prefix`."""

    def bad(key: str, why: str):
        raise ConfigError(f"{key}: {why} (got {getattr(obj, key.removeprefix(prefix + '.'))!r})")

    return bad


@dataclasses.dataclass
class Run:
    """A run's config: its dataclass fields whose values are sections (declared dataclasses), in order, and plain
    fields beside them (not written out)."""

    def sections(self) -> dict[str, Any]:
        return {f.name: v for f in dataclasses.fields(self) if dataclasses.is_dataclass(v := getattr(self, f.name))}

    def to_dict(self) -> dict:
        return {
            name: s.to_dict() if hasattr(s, "to_dict") else dataclasses.asdict(s) for name, s in self.sections().items()
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def get(self, dotted: str):
        """The value of a key, `section.field`."""
        obj = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    def validate(self):
        """The rules across sections (the subclass's `check(bad)`; each section's own were kept on construction);
        the first refusal is a ConfigError `key: why (got value)`."""

        def bad(key: str, why: str):
            raise ConfigError(f"{key}: {why} (got {self.get(key)!r})")

        self.check(bad)
        return self

    def check(self, bad) -> None:
        """Calls bad(key, why) for a value the combination of sections refuses (none here)."""


def check_sections(d, known: list[str], source: str) -> None:
    """A config's top level: a mapping of known section names."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    for key in d:
        if key not in known:
            raise ConfigError(f"{key}: unknown section in {source} (known: {', '.join(known)})")


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """`a.b=value` strings applied to a nested dict; the value is parsed as YAML (`1`, `true`, `[1, 2]`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {key}: expected SECTION.FIELD, e.g. optim.lr")
        value = yaml.safe_load(raw) if raw.strip() else ""
        sec = d.setdefault(parts[0], {})
        if sec is None:
            sec = d[parts[0]] = {}
        if not isinstance(sec, dict):
            raise ConfigError(f"--set {key}: {parts[0]} is not a section")
        sec[parts[1]] = value
    return d


def read(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[dict, str]:
    """(the YAML file's mapping with the overrides applied, its name for errors); no file: the overrides alone."""
    d: dict = {}
    source = "overrides"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({e})") from None
        source = str(p)
    return apply_overrides(d, list(overrides)), source
