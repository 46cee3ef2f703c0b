"""errors.md's rows for scripts/docs_reference.py: the one-line errors megamemo prints for bad input (every raise
of an exception deriving from megamemo.util.errors.MegamemoError), read from the source with `ast` - each with its
module and line, the `if` that raises it, and its message text. A message held in a variable is shown as the text
assigned to it; a caught exception passed on (`str(e)`) as `{e}` with the kind caught; a ShardError as the "shard
...: why" it prints; `megamemo prepare`'s errors (the ValueError family, missing files) from the modules prepare
runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def user_errors() -> set[str]:
    """The exception classes megamemo defines that derive from megamemo.util.errors.MegamemoError (the user errors
    the dispatcher prints in one line, exit 2), read from the source: a new one is listed without a change here."""
    bases = {}
    for path in REPO.joinpath("megamemo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [getattr(b, "id", None) or getattr(b, "attr", None) for b in node.bases]
    derived, grew = {"MegamemoError"}, True
    while grew:
        more = {name for name, bs in bases.items() if name not in derived and derived.intersection(bs)}
        derived |= more
        grew = bool(more)
    return derived - {"MegamemoError"}


# the user errors, and DivergedError (training's own: exit 1); not SaveFailed, whose message is the verdict of a
# checkpoint's commit (megamemo/checkpoint/commit.py), a failed save rather than bad input
ERRORS = frozenset(user_errors() - {"SaveFailed"} | {"DivergedError"})
# `megamemo prepare` (megamemo/data/cli.py prepare_main) prints these as `megamemo prepare: error: ...`, exit 2
PREPARE_FILES = {
    f"megamemo/data/{m}.py" for m in ("cli", "corpora", "documents", "subword", "tokenizer", "vocab", "shards")
}
PREPARE_ERRORS = ("ValueError", "TokenizerError", "EmptyCorpusError", "FileNotFoundError", "FileExistsError", "located")


# exceptions built from (what, why): the line each prints
TWO_PART = {
    "ShardError": "shard {}: {}",
    "StoreUnavailableError": "object store unavailable: {}: {}",
    "DocumentIndexError": "{}: {}",
}


def _src(node, text: str) -> str:
    return re.sub(r"\s+", " ", ast.get_source_segment(text, node) or "")


def _function(tree, line: int):
    """The innermost function holding `line` (or the module)."""
    best = tree
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= line <= n.end_lineno:
            if best is tree or n.lineno >= best.lineno:
                best = n
    return best


def _caught(func, name: str, line: int) -> str | None:
    """The exception kinds of the `except ... as name` around `line`, if any."""
    for n in ast.walk(func):
        if isinstance(n, ast.ExceptHandler) and n.name == name and n.lineno <= line <= n.end_lineno and n.type:
            return " or ".join(
                getattr(t, "id", None) or getattr(t, "attr", "?")
                for t in (n.type.elts if isinstance(n.type, ast.Tuple) else [n.type])
            )
    return None


def _has_text(message: str) -> bool:
    """Whether a message says something beside the values filled in at run time ({...})."""
    return bool(re.search(r"[A-Za-z]{2}", re.sub(r"\{[^{}]*(\{[^{}]*\}[^{}]*)*\}", "", message)))


def _notes(names: list[str], func, line: int) -> str:
    """What a filled-in name holds, where that is another message: a caught error's, or what a call returned."""
    notes = []
    for name in names:
        kind = _caught(func, name, line)
        if kind:
            notes.append(f"the {kind} caught, passed on")
            continue
        for n in ast.walk(func):
            target, value = (
                (n.targets[0], n.value)
                if isinstance(n, ast.Assign) and len(n.targets) == 1
                else (n.target, n.value)
                if isinstance(n, ast.NamedExpr)
                else (None, None)
            )
            if (
                isinstance(target, ast.Name)
                and target.id == name
                and n.lineno <= line
                and isinstance(value, ast.Call)
                and isinstance(value.func, (ast.Name, ast.Attribute))
            ):
                called = getattr(value.func, "id", None) or value.func.attr
                notes.append(f"{{{name}}}: what {called}() finds")
                break
    return f" ({'; '.join(notes)})" if notes else ""


def _field(v: ast.FormattedValue, text: str) -> str:
    conv = {114: "!r", 115: "!s", 97: "!a"}.get(v.conversion, "")
    spec = (
        ":" + "".join(x.value if isinstance(x, ast.Constant) else _field(x, text) for x in v.format_spec.values)
        if v.format_spec
        else ""
    )
    return "{" + _src(v.value, text) + conv + spec + "}"


def text_of(node, text: str, func, line: int, depth: int = 0) -> str:
    """A message expression as its text: literals and f-strings with `{...}` for what is filled in at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # one that is only names: what they hold
        said = "".join(v.value if isinstance(v, ast.Constant) else _field(v, text) for v in node.values)
        return (
            said
            if _has_text(said)
            else said
            + _notes(
                [
                    v.value.id
                    for v in node.values
                    if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)
                ],
                func,
                line,
            )
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return text_of(node.left, text, func, line, depth) + text_of(node.right, text, func, line, depth)
    if isinstance(node, ast.IfExp):  # both texts; an empty one makes the other optional: [...]
        a, b = (text_of(x, text, func, line, depth) for x in (node.body, node.orelse))
        return f"{a} | {b}" if a and b else f"[{a or b}]"
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "str"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Name)
    ):
        kind = _caught(func, node.args[0].id, line)
        return "{" + node.args[0].id + "}" + (f" (the {kind} caught, passed on)" if kind else "")
    if isinstance(node, ast.Name) and depth < 3:
        kind = _caught(func, node.id, line)
        if kind:
            return "{" + node.id + "}" + f" (the {kind} caught, passed on)"
        said = []
        for n in ast.walk(func):
            if (
                isinstance(n, ast.Assign)
                and n.lineno < line
                and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
            ):
                s = text_of(n.value, text, func, n.lineno, depth + 1)
                if s and s not in said and not s.startswith("{" + node.id):
                    said.append(s)
        texts = [t for t in said if not re.fullmatch(r"\{[^{}]*\}", t)]  # not a bare call's result
        return " | ".join(texts or said) or "{" + node.id + "}"
    kinds = {k for n in ast.walk(node) if isinstance(n, ast.Name) and (k := _caught(func, n.id, line))}
    return "{" + _src(node, text) + "}" + (f" (the {' or '.join(sorted(kinds))} caught, passed on)" if kinds else "")


def _message(kind: str, call: ast.Call, text: str, func) -> str:
    args = call.args
    if kind == "config check":
        return _src(args[0], text).strip("\"'") + ": " + text_of(args[1], text, func, call.lineno)
    if kind in TWO_PART and len(args) >= 2:
        return TWO_PART[kind].format("{" + _src(args[0], text) + "}", text_of(args[1], text, func, call.lineno))
    if kind.endswith("(located)") and len(args) >= 3:
        return f"{{{_src(args[0], text)}}}: line {{{_src(args[1], text)}}}: " + text_of(
            args[2].args[0] if isinstance(args[2], ast.Call) and args[2].args else args[2], text, func, call.lineno
        )
    return text_of(args[0], text, func, call.lineno) if args else ""


def _conditions(tree) -> dict[int, tuple]:
    """line -> the `if` test that guards it (the innermost)."""
    guard = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        guard.setdefault(sub.lineno, (node.lineno, node.test))
    return guard


def _kind(node, rel: str) -> tuple[str | None, ast.Call | None]:
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        name = getattr(node.exc.func, "id", None) or getattr(node.exc.func, "attr", None)
        if rel in PREPARE_FILES and name in PREPARE_ERRORS:
            return f"prepare ({'ValueError' if name == 'located' else name})" + (
                " (located)" if name == "located" else ""
            ), node.exc
        if name in ERRORS:
            return name, node.exc
    elif isinstance(node, ast.Call):
        fname = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if fname == "bad" and len(node.args) >= 2:
            return "config check", node
        if fname == "error" and isinstance(node.func, ast.Attribute) and node.args:
            return "usage (argparse)", node
    return None, None


def error_rows() -> list[tuple[str, int, str, str, str]]:
    rows = []
    files = sorted([*REPO.joinpath("megamemo").rglob("*.py")])
    for path in files:
        if "hf_code" in path.parts:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        guards = _conditions(tree)
        rel = str(path.relative_to(REPO))
        for node in ast.walk(tree):
            kind, call = _kind(node, rel)
            if kind is None:
                continue
            msg = _message(kind, call, text, _function(tree, node.lineno))
            guard = guards.get(node.lineno)
            rows.append((rel, node.lineno, kind.replace(" (located)", ""), _src(guard[1], text) if guard else "", msg))
    return sorted(rows, key=lambda r: (r[0], r[1]))


def declared_rows(sections) -> list[tuple[str, int, str, str, str]]:
    """The refusals a config section declares (megamemo/config/fields.py): a field's Literal choices and its Field
    bounds, each a row at the field's line, with the one-line message megamemo/config/run.py one_line writes."""
    import dataclasses
    import inspect
    import typing

    from megamemo.config.fields import choices, literal_values

    rows = []
    for name, cls in sections:
        lines, first = inspect.getsourcelines(cls)
        rel = str(Path(inspect.getsourcefile(cls)).relative_to(REPO))
        at = {
            node.target.id: first + node.lineno - 1
            for node in ast.parse("".join(lines).lstrip()).body[0].body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
        for f in dataclasses.fields(cls):
            info, key = cls.__pydantic_fields__[f.name], f"{name}.{f.name}"
            if dataclasses.is_dataclass(info.annotation):
                rows += declared_rows([(key, info.annotation)])
                continue
            metadata = list(info.metadata) + [
                m
                for a in typing.get_args(info.annotation)
                if typing.get_origin(a) is typing.Annotated
                for m in a.__metadata__
            ]
            unit = " seconds" if key.endswith("_s") else ""
            for m in metadata:
                for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    if getattr(m, k, None) is not None:
                        rows.append(
                            (
                                rel,
                                at[f.name],
                                "config field",
                                f"Field({k}={getattr(m, k)})",
                                f"{key}: must be {op} {getattr(m, k)}{unit} (got {{value}})",
                            )
                        )
            if values := literal_values(info.annotation):
                rows.append(
                    (rel, at[f.name], "config field", "Literal", f"{key}: must be {choices(values)} (got {{value}})")
                )
    return rows
