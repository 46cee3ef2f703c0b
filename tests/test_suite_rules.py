"""Rules of the test suite itself: an xfail that passes fails the run (xfail_strict), and bench/mutants.py's list of
mutations is well formed (each original line found exactly once in its file, each with tests that exist)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_an_xfail_that_passes_fails_the_run(request, tmp_path):
    """pyproject.toml's xfail_strict: a test marked xfail that passes is a failure (XPASS(strict)), under the
    project's own pytest settings."""
    assert request.config.getini("xfail_strict") is True
    (tmp_path / "test_marked.py").write_text("import pytest\n\n@pytest.mark.xfail(reason='fixed meanwhile')\n"
                                             "def test_fixed():\n    assert True\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                        "-p", "no:cacheprovider", "-p", "no:xdist", "-q", str(tmp_path / "test_marked.py")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and "XPASS(strict)" in r.stdout and "1 failed" in r.stdout, r.stdout[-2000:]
