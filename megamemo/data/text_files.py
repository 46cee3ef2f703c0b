"""The ``text`` corpus: plain-text or ``.jsonl`` files, byte-level (raw UTF-8 bytes) or words with a given
vocabulary file (megamemo/data/corpora.py lists every corpus). When every file is ``.jsonl``, each record is a
document (recorded in a document index); plain text is a flat stream (no documents: readers cut it into chunks).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .corpora import Corpus, _check_file, _word_stream, read_range, split_points
from .documents import located, record_text
from .vocab import Vocab


def _is_jsonl(p: Path) -> bool:
    return p.suffix in (".jsonl", ".json")


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` of `path` (an error's location)."""
    with open(path, "rb") as f:
        return (
            sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(min(1 << 20, offset - f.tell())) or None, None)) + 1
        )


def _check_utf8(path: Path, chunk: int = 1 << 24) -> None:
    """A byte-level plain-text file must be UTF-8 text (docs/corpus.md): a Latin-1 file is refused naming the line
    and column of its first bad byte, not stored as bytes no UTF-8 tokenizer or prompt gives."""
    decoder, line, line_start, pos = codecs.getincrementaldecoder("utf-8")(), 1, 0, 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                bad = max(e.start - len(e.object) + len(data), 0)  # the bad byte in this chunk
                line += data.count(b"\n", 0, bad)
                nl = data.rfind(b"\n", 0, bad)
                column = bad - nl if nl >= 0 else pos + bad - line_start + 1
                raise located(
                    path,
                    line,
                    ValueError(f"column {column}: not UTF-8 (byte 0x{data[bad]:02x}; the corpus must be UTF-8 text)"),
                ) from None
            if not data:
                return
            line += data.count(b"\n")
            nl = data.rfind(b"\n")
            line_start = pos + nl + 1 if nl >= 0 else line_start
            pos += len(data)


def _iter_lines(files: list[Path], a: int, b: int) -> Iterator[tuple[Path, int, bytes]]:
    """Lines of the concatenated files that *start* in [a, b) of the concatenation: (file, offset, line)."""
    base = 0
    for p in files:
        size = p.stat().st_size
        lo, hi = max(a - base, 0), min(b - base, size)
        if lo < hi:
            with open(p, "rb") as f:
                pos = lo
                if lo > 0:
                    f.seek(lo - 1)
                    if f.read(1) != b"\n":  # lo is inside a line: that line belongs to the previous range
                        rest = f.readline()
                        pos = lo + len(rest)
                while pos < hi:
                    line = f.readline()
                    if not line:
                        break
                    yield p, pos, line
                    pos += len(line)
        base += size


def text(
    files: list[str | Path],
    valid: list[str | Path] | None = None,
    test: list[str | Path] | None = None,
    vocab_file: str | Path | None = None,
    jsonl_field: str = "text",
    doc_sep: str = "\n",
    ratio: tuple[int, int, int] = (90, 5, 5),
) -> Corpus:
    """Plain-text / jsonl files. Byte-level unless vocab_file is given (then XL word tokenisation with <eos>).

    With valid/test files each split reads its own files; otherwise the concatenated ``files`` are split by
    byte position in the given ratio: exactly for byte-level plain text, by whole lines otherwise (a line
    belongs to the split in which it starts)."""
    groups = {"train": [_check_file(p) for p in files]}
    if valid:
        groups["valid"] = [_check_file(p) for p in valid]
    if test:
        groups["test"] = [_check_file(p) for p in test]
    vocab = Vocab.load(vocab_file, "words") if vocab_file else Vocab.identity_bytes()
    sep = doc_sep.encode("utf-8")

    def make(fs, a, b, exact):
        if vocab_file:
            return _word_stream(vocab, _text_words(fs, a, b, jsonl_field, documents), "text", documents)
        return _text_bytes(fs, a, b, jsonl_field, exact, sep, documents)

    for p in {p for fs in groups.values() for p in fs if not vocab_file and not _is_jsonl(p)}:
        _check_utf8(p)  # the other files are decoded line by line
    sizes = {s: sum(p.stat().st_size for p in fs) for s, fs in groups.items()}
    documents = all(_is_jsonl(p) for fs in groups.values() for p in fs)  # jsonl records: documents
    splits, input_bytes = {}, {}
    all_plain = not any(_is_jsonl(p) for p in groups["train"])
    if len(groups) == 1:
        ranges = split_points(sizes["train"], ratio)
        exact = all_plain and not vocab_file
        for s, (a, b) in ranges.items():
            splits[s] = make(groups["train"], a, b, exact)
            input_bytes[s] = b - a
        how = f"{ratio[0]}/{ratio[1]}/{ratio[2]} of the concatenated files by byte position" + (
            "" if exact else " (whole lines: a line belongs to the split it starts in)"
        )
    else:
        for s, fs in groups.items():
            splits[s] = make(fs, 0, sizes[s], not vocab_file and not any(_is_jsonl(p) for p in fs))
            input_bytes[s] = sizes[s]
        how = "one file group per split"
    if vocab_file:
        tok = {
            "kind": "words",
            "split": "whitespace",
            "eos": "<eos> after every line",
            "unknown_words": "<unk>",
            "vocab": f"file {vocab_file}",
        }
    else:
        tok = {"kind": "bytes", "vocab": "identity (id = byte value)", "jsonl_doc_separator": doc_sep}
    if any(_is_jsonl(p) for fs in groups.values() for p in fs):
        tok["jsonl_field"] = jsonl_field
    src = {
        "files": {s: [{"path": str(p), "bytes": p.stat().st_size} for p in fs] for s, fs in groups.items()},
        "split": how,
    }
    return Corpus("text", "words" if vocab_file else "bytes", vocab, tok, splits, input_bytes, src, documents=documents)


def _text_lines(fs, a: int, b: int, jsonl_field: str):
    """The lines of files `fs` starting in bytes [a, b) of their concatenation (text's splits), as a generator
    function of (where, text, bytes read, from a jsonl file); a jsonl line is its record's `jsonl_field`."""

    def it():
        for p, off, line in _iter_lines(fs, a, b):
            where = f"{p} (byte {off})"
            if _is_jsonl(p) and not line.strip():
                continue
            try:
                s = record_text(line, jsonl_field if _is_jsonl(p) else None)
            except ValueError as e:
                raise located(p, _line_number(p, off), e) from None
            yield where, s, len(line), _is_jsonl(p)

    return it


def _text_bytes(fs, a: int, b: int, jsonl_field: str, exact: bool, sep: bytes, documents: bool):
    """text's byte-level stream of bytes [a, b): cut at exact byte positions (plain text), else by whole lines
    (a jsonl record followed by `sep`); with `documents`, blocks are (ids, (their count,))."""

    def gen(stats):
        if exact:  # plain text, cut at exact byte positions of the concatenation
            base = 0
            for p in fs:
                size = p.stat().st_size
                lo, hi = max(a - base, 0), min(b - base, size)
                if lo < hi:
                    for _off, raw in read_range(p, lo, hi):
                        stats["input_bytes"] = stats.get("input_bytes", 0) + raw.size
                        yield raw.astype(np.int64)
                base += size
            return
        for _where, s, nbytes, is_json in _text_lines(fs, a, b, jsonl_field)():
            stats["input_bytes"] = stats.get("input_bytes", 0) + nbytes
            data = s.encode("utf-8") + (sep if is_json else b"")
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            yield (ids, (ids.size,)) if documents else ids

    return gen


def _text_words(fs, a: int, b: int, jsonl_field: str, documents: bool):
    """text's lines of words (each line closed by <eos>) in bytes [a, b); with `documents`, a jsonl record's lines
    are one item."""

    def it():
        for where, s, nbytes, is_json in _text_lines(fs, a, b, jsonl_field)():
            parts = s.split("\n") if is_json else [s]
            if documents:  # the record's lines, each with its <eos>: one document
                yield where, [w for part in parts for w in part.split() + ["<eos>"]], nbytes
                continue
            for k, part in enumerate(parts):
                yield where, part.split() + ["<eos>"], nbytes if k == 0 else 0

    return it
