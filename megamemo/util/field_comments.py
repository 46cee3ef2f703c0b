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
    for node in declared.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            row = node.lineno
            if row in comments and not lines[row - 1].lstrip().startswith("#"):
                text = [comments[row]]
                k = row + 1  # an inline comment continued on the next lines
                while (
                    k in comments
                    and lines[k - 1].lstrip().startswith("#")
                    and len(lines[k - 1]) - len(lines[k - 1].lstrip()) > 8
                ):
                    text.append(comments[k])
                    k += 1
            else:  # a block at the field's own indentation (not the tail of
                indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())  # the previous field's comment)
                text, k = [], row - 1
                while (
                    k in comments
                    and lines[k - 1].lstrip().startswith("#")
                    and len(lines[k - 1]) - len(lines[k - 1].lstrip()) == indent
                ):
                    text.insert(0, comments[k])
                    k -= 1
            out[node.target.id] = " ".join(text)
    return out
