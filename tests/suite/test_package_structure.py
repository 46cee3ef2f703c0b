"""The package's floors point one way: no import cycle anywhere (function-level imports included), packages import
only from lower layers (LAYERS, no exceptions), every folder says what it holds, and files stay short."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("megamemo",)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _string_import(node: ast.AST) -> str | None | bool:
    """The module a call imports by name: importlib.import_module("a.b") / import_module("a.b") / __import__("a.b")
    -> "a.b"; such a call with a name that is not a literal -> False (it cannot be checked); any other node -> None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__"):
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else False


# the one module that may import by a computed name: the dispatcher, the top layer, which imports each subcommand's
# module from its table (SUBCOMMANDS) when it is used
DYNAMIC_IMPORTS_ALLOWED = {"megamemo.cli"}


def _imports(mods: dict[str, Path], sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file: import statements, and importlib.import_module
    / __import__ calls with a literal name (a computed name outside DYNAMIC_IMPORTS_ALLOWED fails: it escapes this
    check). `sources`: module -> its text (default: the file's)."""
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        text = sources[name] if sources is not None else path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif (by_name := _string_import(node)) is not None:
                assert by_name is not False or name in DYNAMIC_IMPORTS_ALLOWED, (
                    f"{name} (line {node.lineno}) imports a module by a computed name, which the layer checks "
                    f"cannot follow: import it by a literal name"
                )
                targets = [by_name] if by_name else []
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def test_no_import_cycles():
    graph = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n) :] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# The layers, lowest first. A module imports from its own package and from packages of LOWER layers only: nothing
# low imports something high, and packages of one layer know nothing of each other. Every package has a layer.
LAYERS = (
    ("megamemo.util",),  # atomic files, digests, progress, precision: nothing of megamemo
    ("megamemo.config",),  # composes a run's config from its sections: YAML, --set, their checks
    ("megamemo.data", "megamemo.model"),  # shards and tokenizers (the data section); the single-device model
    ("megamemo.parallel", "megamemo.kernels"),  # the model's TP / PP forms (the parallel section); its CPU kernels
    ("megamemo.checkpoint",),  # the checkpoint format only
    ("megamemo.runtime", "megamemo.interop"),  # processes, devices, the run directory; checkpoints as models
    ("megamemo.train", "megamemo.eval", "megamemo.plan", "megamemo.export"),  # what runs a model or plans a layout
    ("megamemo.commands",),  # one module per subcommand: its flags and a call into the library
    ("megamemo",),  # the top: __init__, __main__ and the `megamemo` dispatcher (cli.py)
)


def _package(module: str) -> str:
    parts = module.split(".")
    candidate = ".".join(parts[:2])
    return candidate if (REPO / candidate.replace(".", "/")).is_dir() else parts[0]


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    layer = {pkg: i for i, tier in enumerate(LAYERS) for pkg in tier}
    unknown = sorted({_package(m) for m in graph} - set(layer))
    assert not unknown, f"packages without a layer (add them to LAYERS): {unknown}"
    return sorted(
        f"{m} imports {n} ({_package(m)} is layer {layer[_package(m)]}, {_package(n)} layer {layer[_package(n)]})"
        for m, deps in graph.items()
        for n in deps
        if _package(n) != _package(m) and layer[_package(n)] >= layer[_package(m)]
    )


def test_packages_import_one_way_by_layers():
    bad = _layer_violations(_imports(_modules()))
    assert not bad, bad


def test_an_import_by_name_is_checked_like_an_import_statement():
    """importlib.import_module("...") and __import__("...") count as imports (they escaped this check): the lowest
    layer importing the dispatcher that way is a violation, and an import by a computed name is refused outside
    megamemo/cli.py."""
    mods = _modules()
    files = "megamemo.util.files"
    text = mods[files].read_text()
    # the real tree passes, the dispatcher's import by a computed name (megamemo/cli.py) included
    assert "importlib.import_module(mod_name)" in mods["megamemo.cli"].read_text()
    assert not _layer_violations(_imports(mods, {m: p.read_text() for m, p in mods.items()}))
    for call in (
        'importlib.import_module("megamemo.cli")',
        '__import__("megamemo.train.loop")',
        'import_module("megamemo.eval.evaluate")',
    ):
        sources = {m: p.read_text() for m, p in mods.items()}
        sources[files] = text + f"\n\ndef _sneaky():\n    return {call}\n"
        bad = _layer_violations(_imports(mods, sources))
        target = call.split('"')[1]
        assert bad == [
            f"{files} imports {target} (megamemo.util is layer 0, {_package(target)} layer "
            f"{[i for i, t in enumerate(LAYERS) if _package(target) in t][0]})"
        ], (call, bad)
    sources = {m: p.read_text() for m, p in mods.items()}
    sources[files] = text + "\n\ndef _computed(name):\n    import importlib\n    return importlib.import_module(name)\n"
    with pytest.raises(AssertionError, match="megamemo.util.files .* imports a module by a computed name"):
        _imports(mods, sources)


def test_the_top_level_holds_only_the_dispatcher():
    loose = sorted(p.name for p in (REPO / "megamemo").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py"], loose


def test_every_folder_says_what_lives_in_it():
    silent = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "megamemo").rglob("__init__.py"))
        if "hf_code" not in p.parts and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not silent, silent


def written_lines(text: str) -> int:
    """A file's lines as its author wrote them: every physical line but those the formatter adds when it spreads
    one bracketed expression over several (a call's or a signature's arguments one per line). A line that starts
    inside an open bracket is a continuation and does not count; strings, comments and blank lines do."""
    depth, continued, row = 0, set(), 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.start[0] != row:
            row = tok.start[0]
            if depth > 0 and tok.type not in (tokenize.NL, tokenize.COMMENT):
                continued.add(row)
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
    return len(text.splitlines()) - len(continued)


def test_written_lines_leave_out_the_formatters_continuations():
    spread = 'f(\n    a,\n    b,\n)\nx = [1, 2]\n# a comment\n\ns = """two\nlines"""\n'
    assert written_lines(spread) == 6  # 9 lines: f( counts, its arguments and its ) do not; the rest counts


def test_files_hold_one_idea_and_stay_short():
    """At most 420 written lines a module (written_lines: the formatter's one-argument-a-line layout aside)."""
    long = [f"{p.relative_to(REPO)}: {n}" for p in _modules().values() if (n := written_lines(p.read_text())) > 420]
    assert not long, long
