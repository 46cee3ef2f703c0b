"""Document corpora, read as a stream of blocks of whole documents (bounded memory, whatever the corpus size).

Sources (`list_sources`): ``.jsonl``/``.json`` files (one JSON object per line, the text in ``--jsonl-field``),
``.parquet`` files (the text in the column of that name, read with pyarrow, local files only), directories
(every file under it, sorted by relative path, by the same rules; any other file is one plain-text document),
and plain-text files (each one document).

A block is ~`BLOCK_BYTES` of input holding whole documents: ``("jsonl", path, first_line, raw_lines, field)`` or
``("docs", path, first_index, [texts])``. `parse_block` turns it into texts (workers do that, so the reading
process only reads). Block boundaries depend on the input alone, never on the number of workers.

`DocumentSplit` assigns whole documents to train/valid/test: documents are numbered in stream order; in each
group of T = sum(ratio) consecutive documents, a permutation drawn from numpy's default_rng([seed, group])
sends ratio[0] of them to train, ratio[1] to valid and ratio[2] to test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_BYTES = 1 << 20
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # jsonl | parquet | text

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def _kind(p: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(p.suffix.lower(), "text")


def list_sources(paths) -> list[Source]:
    out = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files = sorted(
                (f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            out += [Source(f, _kind(f)) for f in files]
        elif p.is_file():
            out.append(Source(p, _kind(p)))
        else:
            raise FileNotFoundError(f"raw corpus file not found: {p}")
    return out


def check_sources(sources: list[Source], field: str) -> None:
    """Errors a user can make, found before anything is written: no files, a parquet file without the column."""
    if not sources:
        raise ValueError("no documents: the given paths hold no files")
    for s in sources:
        if s.kind == "parquet":
            import pyarrow.parquet as pq  # optional (the parquet extra), only for .parquet sources

            try:
                names = pq.ParquetFile(s.path).schema_arrow.names
            except Exception as e:  # pyarrow raises several types for a bad file
                raise ValueError(f"{s.path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
            if field not in names:
                raise ValueError(
                    f"{s.path}: parquet file has no column {field!r} (columns: {', '.join(names)}); "
                    f"choose it with --jsonl-field"
                )


def iter_blocks(sources: list[Source], field: str, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, tuple]]:
    """(input bytes consumed, block) over all sources in order."""
    texts: list[str] = []
    pending, first = 0, None
    for s in sources:
        if s.kind == "jsonl":
            yield from _jsonl_blocks(s.path, field, block_bytes)
        elif s.kind == "parquet":
            yield from _parquet_blocks(s.path, field, block_bytes)
        else:  # plain-text files: several small ones share a block
            data = s.path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data[: e.start].count(b"\n") + 1
                column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
                raise located(
                    s.path,
                    line,
                    ValueError(
                        f"column {column}: not UTF-8 (byte 0x{data[e.start]:02x}; the corpus must be UTF-8 text)"
                    ),
                ) from None
            if first is None:
                first = s.path
            texts.append(text)
            pending += len(data)
            if pending >= block_bytes:
                yield pending, ("docs", str(first), 0, texts)
                texts, pending, first = [], 0, None
            continue
    if texts:
        yield pending, ("docs", str(first), 0, texts)


def _jsonl_blocks(path: Path, field: str, block_bytes: int):
    with open(path, "rb") as f:
        lines, size, first, lineno = [], 0, 1, 0
        for line in f:
            lineno += 1
            lines.append(line)
            size += len(line)
            if size >= block_bytes:
                yield size, ("jsonl", str(path), first, b"".join(lines), field)
                lines, size, first = [], 0, lineno + 1
        if lines:
            yield size, ("jsonl", str(path), first, b"".join(lines), field)


def _parquet_blocks(path: Path, field: str, block_bytes: int):
    import pyarrow.parquet as pq  # optional (the parquet extra), only for .parquet sources

    pf = pq.ParquetFile(path)
    total_rows = max(pf.metadata.num_rows, 1)
    per_row = path.stat().st_size / total_rows  # progress: the file's bytes spread over its rows
    row = 0
    texts, size, first = [], 0, 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for k, v in enumerate(batch.column(0).to_pylist()):
            if not isinstance(v, str):
                raise ValueError(f"{path}: row {row + k}: column {field!r} is {type(v).__name__}, not a string")
            texts.append(v)
            size += len(v)
        row += batch.num_rows
        if size >= block_bytes:
            yield round(len(texts) * per_row), ("docs", str(path), first, texts)
            texts, size, first = [], 0, row
    if texts:
        yield round(len(texts) * per_row), ("docs", str(path), first, texts)


def record_text(line: bytes, field: str | None) -> str:
    """A plain-text line's text (field None) or a jsonl record's `field`. ValueError says why, beginning with
    `column C: ` where a column is at fault; the caller puts the file and line in front (located)."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"column {e.start + 1}: not UTF-8 (byte 0x{line[e.start]:02x}; the corpus must be UTF-8 text)"
        ) from None
    if field is None:
        return s
    try:
        obj = json.loads(s)
    except ValueError as e:
        raise ValueError(f"column {getattr(e, 'colno', 1)}: not a JSON object ({getattr(e, 'msg', e)})") from None
    if not isinstance(obj, dict) or field not in obj:
        raise ValueError(f"no field {field!r} in this jsonl record (choose the field with --jsonl-field)")
    if not isinstance(obj[field], str):
        raise ValueError(f"field {field!r} is {type(obj[field]).__name__}, not a string")
    return obj[field]


def located(path, line_no: int, e: ValueError) -> ValueError:
    """record_text's error as one line naming the file, line and column: `f.jsonl: line 3, column 7: why`."""
    why = str(e)
    return ValueError(f"{path}: line {line_no}{', ' if why.startswith('column ') else ': '}{why}")


def parse_block(block: tuple) -> list[str]:
    """The documents' texts of a block; a malformed jsonl line is an error naming the file, line and column."""
    if block[0] == "docs":
        return block[3]
    _, path, first, raw, field = block
    texts = []
    for k, line in enumerate(raw.split(b"\n")):
        if not line.strip():
            continue
        try:
            texts.append(record_text(line, field))
        except ValueError as e:
            raise located(path, first + k, e) from None
    return texts


class DocumentSplit:
    """Whole documents to splits by their index in the stream (module docstring); `fixed` sends all to one."""

    def __init__(self, ratio=(90, 5, 5), seed: int = 1234, fixed: str | None = None):
        self.ratio, self.seed, self.fixed = tuple(int(r) for r in ratio), int(seed), fixed
        self.group = sum(self.ratio)
        self.bounds = np.cumsum(self.ratio)
        self._cache: dict[int, np.ndarray] = {}

    def slots(self, g: int) -> np.ndarray:
        s = self._cache.get(g)
        if s is None:
            if len(self._cache) > 64:
                self._cache.clear()
            perm = np.random.default_rng([self.seed, g]).permutation(self.group)
            s = self._cache[g] = np.searchsorted(self.bounds, perm, side="right")
        return s

    def assign(self, start: int, n: int) -> np.ndarray:
        """Split index (0 train, 1 valid, 2 test) of documents start .. start+n-1."""
        if self.fixed is not None:
            return np.full(n, SPLITS.index(self.fixed), dtype=np.int64)
        idx = np.arange(start, start + n)
        out = np.empty(n, dtype=np.int64)
        for g in np.unique(idx // self.group):
            sel = idx // self.group == g
            out[sel] = self.slots(int(g))[idx[sel] % self.group]
        return out

    def record(self) -> dict:
        if self.fixed is not None:
            return {"by": "file group", "split": self.fixed}
        return {
            "by": "whole documents",
            "ratio": list(self.ratio),
            "seed": self.seed,
            "rule": "per group of sum(ratio) consecutive documents, numpy default_rng([seed, group])"
            ".permutation: the first ratio[0] slots train, then valid, then test",
        }
