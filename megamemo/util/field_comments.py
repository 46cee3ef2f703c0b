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
    """field name -> its comment: the inline one on its line (continued on the lines below that are indented
    deeper than the fields), else the comment block right above it at the field's own indentation."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    declared = ast.parse(src).body[0]
    assert isinstance(declared, ast.ClassDef), f"{cls.__name__}: not a class"
    fields = {n.lineno: n for n in declared.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for row, node in fields.items():
        assert isinstance(node.target, ast.Name)
        if row in comments and not lines[row - 1].lstrip().startswith("#"):
            out[node.target.id] = " ".join([comments[row], *_continued(row, comments, lines, fields)])
        else:  # a block at the field's own indentation (not the tail of the previous field's comment)
            indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())
            text: list[str] = []
            k = row - 1
            while k in comments and _own_line(lines[k - 1]) and _indent(lines[k - 1]) == indent:
                text.insert(0, comments[k])
                k -= 1
            out[node.target.id] = " ".join(text)
    return out


def _continued(row: int, comments: dict, lines: list[str], fields: dict) -> list[str]:
    """The comment lines that continue the inline comment on `row`: the comment-only lines below it, unless they
    are the block above a field that has no inline comment of its own (then they are that field's). ruff format
    puts a continuation at the fields' indentation, so the indentation cannot tell them apart."""
    k = row + 1
    while k in comments and _own_line(lines[k - 1]):
        k += 1
    below = fields.get(k)
    if k > row + 1 and below is not None and not (k in comments and not _own_line(lines[k - 1])):
        return []  # the next field's block
    return [comments[j] for j in range(row + 1, k)]


def _own_line(line: str) -> bool:
    return line.lstrip().startswith("#")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
