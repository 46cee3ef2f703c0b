"""The root of megamemo's user errors. Every exception that means "the user's input cannot be used" - a bad config,
flag, data directory, checkpoint or file - derives from MegamemoError, so the `megamemo` dispatcher (megamemo/cli.py)
catches them once: it prints `megamemo COMMAND: error: MESSAGE`, one line, and exits 2. Any other exception is a bug:
its traceback is printed and the exit code is 1.

A project error that was a ValueError (or RuntimeError) stays one too (`class ShardError(MegamemoError, ValueError)`),
so code and tests that catch the older kind keep working. UsageError is the plain kind: a value the user gave that
cannot be used, raised where no more specific error of the module fits."""

from __future__ import annotations


class MegamemoError(Exception):
    """A user error: its message is one line that names the bad file, field or value."""


class UsageError(MegamemoError, ValueError):
    """A flag, option or file content the user gave that cannot be used (one line: which and why)."""
