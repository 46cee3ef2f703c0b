"""scripts/docs_reference.py's pages hold what a reader needs (issue 50, items 7 and 8): every config key and flag
has text, a comment is kept whole (not cut at its first sentence or line), the drift check fails on a key without
text, and every error entry shows its message - never a bare variable name - including `megamemo prepare`'s."""

from __future__ import annotations

import dataclasses
import re
import sys

from helpers.fixture_data import REPO

sys.path.insert(0, str(REPO / "scripts"))
import docs_reference


def rows(page: str) -> dict[str, list[str]]:
    """First cell (the key or flag, backticks off) -> the row's cells, of every table row of a generated page."""
    out = {}
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            out.setdefault(cells[0].strip("`"), cells)
    return out


def test_every_config_key_and_flag_has_text():
    assert docs_reference.keys_without_text() == []
    assert docs_reference.flags_without_text() == []
    assert all(r[4] for r in rows(docs_reference.config_page()).values())


def test_a_key_without_text_fails_the_check(monkeypatch, capsys):
    @dataclasses.dataclass
    class Bare:
        said: int = 1  # a key with its text
        unsaid: int = 2

    monkeypatch.setattr(docs_reference, "PAGES", {})  # the pages aside: only the text is checked
    monkeypatch.setattr(docs_reference, "config_sections", lambda: [("bare", Bare)])
    assert docs_reference.keys_without_text() == ["bare.unsaid"]
    assert docs_reference.main(["--check"]) == 1
    assert "without text: bare.unsaid" in capsys.readouterr().err
    monkeypatch.setattr(docs_reference, "config_sections", lambda: [])
    assert docs_reference.main(["--check"]) == 0


def test_comments_are_kept_whole():
    """A comment's later sentences and continuation lines are in the row: max_consecutive_skips' second sentence,
    n_token's second line, attention's closing note."""
    config = rows(docs_reference.config_page())
    assert config["precision.max_consecutive_skips"][4].endswith("stops with an error.")
    assert "megamemo/train/vocab.py" in config["model.n_token"][4]
    assert "resumes and converts under any form" in config["model.attention"][4]


def test_the_cache_dir_and_same_length_rows_say_what_they_are():
    config = rows(docs_reference.config_page())
    assert "cached" in config["data.cache_dir"][4] and "s3://" not in config["data.cache_dir"][4]
    assert "s3://" in config["data.dir"][4]
    cli = rows(docs_reference.cli_page())
    same_length = cli["--same-length`, `--no-same-length"]  # one flag, both forms (Request.same_length)
    assert "same number of keys" in same_length[4] and "checkpoint's" in same_length[4] and same_length[2] == ""
    parser = docs_reference.command_parser("megamemo.commands.eval:main")
    assert parser.parse_args(["--ckpt", "c", "--data", "d"]).same_length is None  # the checkpoint's, really


# ---- errors.md (item 8) ------------------------------------------------------------------------------------------
def test_every_error_entry_shows_its_message_text():
    """No entry is a bare variable or expression (`path`, `shard`, `{url}`): with the `{...}` filled in at run time
    taken out, text is left - or the entry names the caught error whose message it passes on."""
    sys.path.insert(0, str(REPO / "scripts"))
    from docs_errors import error_rows

    bare = [
        (rel, line, msg)
        for rel, line, _, _, msg in error_rows()
        if not re.search(r"[A-Za-z]{2}", re.sub(r"\{[^{}]*(\{[^{}]*\}[^{}]*)*\}", "", msg))
        and "caught, passed on)" not in msg
    ]
    assert bare == []


def test_the_message_of_a_variable_a_shard_error_and_a_caught_error():
    from docs_errors import error_rows

    by = {(rel, line): msg for rel, line, _, _, msg in error_rows()}
    shard = [m for (rel, _), m in by.items() if rel == "megamemo/data/shard_reader.py" and "truncated tar" in m]
    assert shard and all(m.startswith("shard {shard}: truncated tar") for m in shard), shard
    assert any(
        m.startswith("{e} (the ValueError caught, passed on)")
        for (rel, _), m in by.items()
        if rel == "megamemo/train/speedups.py"
    )
    utf8 = [m for (rel, _), m in by.items() if rel == "megamemo/data/documents.py" and "not UTF-8" in m]
    assert any("line {line}: column {column}: not UTF-8 (byte 0x{data[e.start]:02x}" in m for m in utf8), utf8


def test_prepares_errors_are_in_the_catalogue():
    from docs_errors import error_rows

    prepare = [(rel, msg) for rel, _, kind, _, msg in error_rows() if kind.startswith("prepare")]
    files = {rel for rel, _ in prepare}
    assert {"megamemo/data/corpora.py", "megamemo/data/documents.py", "megamemo/data/tokenizer.py"} <= files
    assert any("bpe:N needs an integer N >= 257" in msg for _, msg in prepare)
    page = docs_reference.errors_page()
    assert "megamemo prepare: error: MESSAGE" in page and "| prepare (ValueError) |" in page
