"""What `megamemo harness` asks (megamemo/export/harness.py runs it): kept apart from harness.py, which imports
lm-eval (the optional megamemo[eval]), so the command's flags and --help need no lm-eval."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """Each field is one of `megamemo harness`'s flags (megamemo/commands/harness.py makes them from these fields,
    their comments the flags' help)."""

    text: list[str]  # UTF-8 text files, one document each
    # torch device: auto (cuda when torch sees one, else cpu), cpu, cuda, cuda:N
    device: str = "auto"
    mem_len: int | None = None  # memory length (default: the checkpoint's mem_len)
