"""What a dataclass's fields mean, read once from the comments beside them in the code: the config reference
(scripts/docs_reference.py) and the flags a command makes from a request type (megamemo/commands/flags.py
add_fields) both show that text, so a field's meaning is written once, where the field is declared."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize


def field_comments(cls) -> dict[str, str]:
    """field name -> its comment: the inline one on its line, continued on the comment lines below it when the next
    field has an inline comment of its own (or none follows); else the comment block right above the field. (The
    formatter puts a continued comment at the fields' indentation, so the next field's form tells whose it is.)"""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    declared = ast.parse(src).body[0]
    assert isinstance(declared, ast.ClassDef), f"{cls.__name__}: not a class"
    fields = [
        (n.target.id, n.lineno)
        for n in declared.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    inline = {row for _, row in fields if row in comments and not _comment_only(lines, row)}
    starts = {row for _, row in fields}
    out = {}
    for name, row in fields:
        block = _block_above(lines, comments, row)
        if row in inline:
            text, k = [comments[row]], row + 1
            while k in comments and _comment_only(lines, k):
                k += 1
            if k not in starts or k in inline:  # the lines below continue this field's comment
                text += [comments[j] for j in range(row + 1, k)]
            out[name] = " ".join(text)
        elif block:
            prev = max((r for r in inline if r < row), default=None)
            owned = [r for r in block if prev is None or r > prev]
            out[name] = " ".join(comments[r] for r in owned)
    return out


def _comment_only(lines: list[str], row: int) -> bool:
    return lines[row - 1].lstrip().startswith("#")


def _block_above(lines: list[str], comments: dict[int, str], row: int) -> list[int]:
    """The rows of the comment-only lines right above `row`, top to bottom."""
    k = row - 1
    while k in comments and _comment_only(lines, k):
        k -= 1
    return list(range(k + 1, row))
