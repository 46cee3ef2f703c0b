"""The package's floors point one way: no import cycle anywhere (function-level imports included), the model knows
nothing of parallelism, checkpoints or training, the checkpoint layer nothing of training, and files stay short."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megamemo", "data_pipeline")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file."""
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
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
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_lower_floors_import_nothing_from_higher_ones():
    graph = _imports(_modules())
    allowed = {   # package prefix -> what its modules may import from the project (megamemo.typed and
        # megamemo.progress are leaves: they import nothing from it)
        "megamemo.typed": (),
        "megamemo.progress": (),
        "megamemo.model": ("megamemo.model", "megamemo.typed"),
        "megamemo.kernels": ("megamemo.kernels", "megamemo.model", "megamemo.typed"),
        "megamemo.parallel": ("megamemo.model", "megamemo.parallel", "megamemo.typed"),
        "megamemo.checkpoint": ("megamemo.checkpoint", "megamemo.model", "megamemo.typed", "megamemo.progress",
                                "megamemo.interop",
                                "data_pipeline"),
        "data_pipeline": ("data_pipeline", "megamemo.progress"),
    }
    bad = [f"{m} imports {n}" for m, deps in graph.items() for prefix, ok in allowed.items()
           if m == prefix or m.startswith(prefix + ".") for n in deps if not n.startswith(ok)]
    assert not bad, bad


def test_files_hold_one_idea_and_stay_short():
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > 420]
    assert not long, long
