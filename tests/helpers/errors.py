"""The one-line error: a bad input ends in one line on stderr that names what is wrong (the bad file, field or
value), with no traceback. One check for the in-process commands (capsys) and the subprocesses alike."""

from __future__ import annotations

import subprocess


def one_line_error(stderr: str, *names: str, prefix: str = "", among_logs: bool = False) -> str:
    """The error line of `stderr`, checked: no traceback, exactly one line (with among_logs, exactly one line that
    says "error" among other output, a run's log lines), starting with `prefix`, naming every one of `names`."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    if among_logs:
        lines = [x for x in lines if "error" in x.lower()]
    assert len(lines) == 1, f"{len(lines)} error lines, not 1:\n{stderr[-3000:]}"
    assert lines[0].startswith(prefix), (prefix, lines[0])
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def failed_with_one_line(
    r: subprocess.CompletedProcess,
    *names: str,
    returncode: int | None = None,
    prefix: str = "",
    among_logs: bool = False,
) -> str:
    """A finished command that failed (with `returncode` where given, else any but 0) in one_line_error's line."""
    if returncode is None:
        assert r.returncode != 0, (r.stdout or "")[-1500:]
    else:
        assert r.returncode == returncode, (r.stdout or "") + (r.stderr or "")
    return one_line_error(r.stderr, *names, prefix=prefix, among_logs=among_logs)
