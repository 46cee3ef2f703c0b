"""Rules of the test suite itself: an xfail that passes fails the run (xfail_strict), and bench/mutants.py's list of
mutations is well formed (each original line found exactly once in its file, each with tests that exist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_an_xfail_that_passes_fails_the_run(request, tmp_path):
    """pyproject.toml's xfail_strict: a test marked xfail that passes is a failure (XPASS(strict)), under the
    project's own pytest settings."""
    assert request.config.getini("xfail_strict") is True
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n@pytest.mark.xfail(reason='fixed meanwhile')\ndef test_fixed():\n    assert True\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(REPO / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-q",
            str(tmp_path / "test_marked.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 1 and "XPASS(strict)" in r.stdout and "1 failed" in r.stdout, r.stdout[-2000:]


def _mutants():
    """bench/mutants.py (a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants", REPO / "bench" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_mutation_list_is_well_formed():
    """At least 40 mutations, named once each, spread over every package of the layers (tests/
    test_package_structure.py LAYERS) and megamemo/cli.py; each one's original line occurs exactly once in its file
    (indentation aside), its mutated line differs, and its tests name test files and functions that exist."""
    import re

    from test_package_structure import LAYERS

    mutants = _mutants()
    ms = mutants.MUTATIONS
    assert len(ms) >= 40 and len({m.name for m in ms}) == len(ms)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", m.name) for m in ms), [m.name for m in ms]
    problems = [p for m in ms for p in mutants.problems(m)]
    assert not problems, problems
    for m in ms:
        for t in m.tests:
            path, _, func = t.partition("::")
            if func:
                assert re.search(rf"^def {re.escape(func.split('[')[0])}\(", (REPO / path).read_text(), re.M), t
    packages = {pkg for tier in LAYERS for pkg in tier} - {"megamemo"}
    covered = {m.file.rsplit("/", 1)[0].replace("/", ".") for m in ms}
    assert packages <= covered and "megamemo/cli.py" in {m.file for m in ms}, packages - covered


def test_the_mutation_list_prints_one_a_line(capsys):
    mutants = _mutants()
    assert mutants.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [m.name for m in mutants.MUTATIONS]
    assert all(
        ln.split()[1] == m.file and ln.split()[2:] == list(m.tests)
        for ln, m in zip(lines, mutants.MUTATIONS, strict=True)
    )


def test_a_mutation_is_applied_to_its_line_alone_and_undone(tmp_path):
    """apply() replaces exactly the named line (its indentation kept) and returns the text that restores it."""
    mutants = _mutants()
    f = tmp_path / "m.py"
    f.write_text("def f(i, j):\n    mask = j > i\n    return mask\n")
    m = mutants.Mutation("x", "m.py", "mask = j > i", "mask = j >= i", ("t",))
    original = mutants.apply(m, tmp_path)
    assert f.read_text() == "def f(i, j):\n    mask = j >= i\n    return mask\n"
    f.write_text(original)
    (tmp_path / "test_m.py").write_text("def test_f():\n    pass\n")
    assert mutants.problems(mutants.Mutation("y", "m.py", "return", "pass", ("test_m.py::test_f",)), tmp_path) == [
        "y: the original line occurs 0 times in m.py: 'return'"
    ]
