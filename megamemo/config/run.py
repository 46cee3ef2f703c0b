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
from pathlib import Path

import yaml
from pydantic import ValidationError

from .fields import choices, literal_values, type_name


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it."""


def section(cls, data, where: str):
    """Section `cls` (a declared dataclass, fields.section) from plain data (a mapping, or None for every default);
    the first bad key or value is a one-line ConfigError naming it."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.__pydantic_validator__.validate_python(data)     # as cls(**data), its errors named by `where`
    except ValidationError as e:
        raise one_line(e, cls, where) from None


def refusal(obj, prefix: str):
    """bad(key, why) for a section's own rules (a model_validator): ConfigError `key: why (got value)`, the value
    read from obj, the section named `prefix`."""
    def bad(key: str, why: str):
        raise ConfigError(f"{key}: {why} (got {getattr(obj, key.removeprefix(prefix + '.'))!r})")
    return bad


BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}
TYPES = {"int_type": "int", "float_type": "float", "float_parsing": "float", "bool_type": "bool",
         "string_type": "str", "list_type": "list", "dict_type": "dict"}


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
        return e["ctx"]["error"]                       # a section's own rule (refusal): already one line
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
        if allowed and not isinstance(value, type(allowed[0])):       # a number for a word, a word for a number
            return ConfigError(f"{key}: expected {type(allowed[0]).__name__}, got {type(value).__name__} {value!r}")
        return ConfigError(f"{key}: must be {choices(allowed)} (got {value!r})")
    if e["type"] in ("too_short", "too_long"):
        n = e["ctx"].get("min_length") if e["type"] == "too_short" else e["ctx"].get("max_length")
        return ConfigError(f"{key}: expected {'at least' if e['type'] == 'too_short' else 'at most'} {n} items "
                           f"(got {value!r})")
    if e["type"].startswith("dataclass_"):
        return ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    if e["type"] in TYPES or e["type"].endswith(("_type", "_parsing")):
        typ = TYPES.get(e["type"], e["type"].split("_")[0])
        if info is not None and not isinstance(e["loc"][-1], int):      # the field itself: its declared type
            typ = type_name(info)
        return ConfigError(f"{key}: expected {typ}, got {type(value).__name__} {value!r}")
    return ConfigError(f"{key}: {e['msg']} (got {value!r})")


@dataclasses.dataclass
class Run:
    """A run's config: its dataclass fields whose values are sections (declared dataclasses), in order, and plain
    fields beside them (not written out)."""

    def sections(self) -> dict[str, object]:
        return {f.name: v for f in dataclasses.fields(self)
                if dataclasses.is_dataclass(v := getattr(self, f.name))}

    def to_dict(self) -> dict:
        return {name: s.to_dict() if hasattr(s, "to_dict") else dataclasses.asdict(s)
                for name, s in self.sections().items()}

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


def read(path: str | Path | None, overrides: list[str] = ()) -> tuple[dict, str]:
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
