"""Document index of a split: where each document starts in the split's token stream.

For corpora made of documents (jsonl records, parquet rows, files of a directory, ...), `megamemo prepare` writes
beside the shards one file per split, ``<split>-documents.bin``: the token offset of every document's first token
as little-endian uint64, ascending, the first one 0 (so document d is tokens starts[d] .. starts[d+1]-1, the last
one ending with the split). manifest.json lists it under ``splits.<split>.documents``::

    {"file": "train-documents.bin", "n_documents": N, "dtype": "<u8", "bytes": 8N, "sha256": ...}

Why a file of its own and raw uint64: a split may hold millions of documents (8 bytes each: well under 1% of the
shards for documents of 100 tokens or more), too many for a JSON manifest that every process reads; a raw array
needs no parser (numpy reads it as it is), is written while the shards are (memory does not grow with the
corpus), and is verified like a shard (size and sha256 from the manifest, then the offsets themselves), also
through the verified cache of a remote directory. Manifests without it (flat corpora: one enwik8 file, ...; and
directories prepared before it existed) have no document boundaries, and readers fall back to chunks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megamemo.util.errors import MegamemoError
from megamemo.util.files import AtomicFile, HashingWriter, bytes_sha256, entry_mismatch

DTYPE = "<u8"
CONTENT = "token offset of each document's first token in the split's stream, ascending, the first 0"


class DocumentIndexError(MegamemoError, ValueError):
    """A document index that does not match its manifest entry or is not a valid index; names the file."""

    def __init__(self, file, message: str):
        self.file, self.detail = str(file), message
        super().__init__(f"{file}: {message}")


def file_name(split: str) -> str:
    return f"{split}-documents.bin"


class DocumentStartsWriter:
    """Streams a split's document start offsets into a hidden temporary file beside ``<split>-documents.bin``
    (hashed as written); ``close`` renames it into place and returns its manifest entry, ``abort`` deletes it."""

    def __init__(self, out_dir: str | Path, split: str):
        self.name = file_name(split)
        self.path = Path(out_dir) / self.name
        self._f: AtomicFile | None = None
        self._hash: HashingWriter | None = None
        self.n = 0

    def add(self, first_token: int, lengths) -> None:
        """Documents of the given token counts, the first starting at token `first_token` (empty ones skipped)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        lengths = lengths[lengths > 0]
        if not lengths.size:
            return
        starts = first_token + np.concatenate(([0], np.cumsum(lengths[:-1])))
        data = starts.astype(DTYPE).tobytes()
        _, hasher = self._open()
        hasher.write(data)
        self.n += lengths.size

    def _open(self) -> tuple[AtomicFile, HashingWriter]:
        if self._f is None or self._hash is None:  # both or neither
            self._f = AtomicFile(self.path)
            self._hash = HashingWriter(self._f.file)
        return self._f, self._hash

    def close(self) -> dict:
        f, hasher = self._open()  # no documents at all: an empty split (an error elsewhere)
        f.commit()
        sha256, self._f, self._hash = hasher.hexdigest(), None, None
        return {
            "file": self.name,
            "n_documents": self.n,
            "dtype": DTYPE,
            "bytes": 8 * self.n,
            "sha256": sha256,
            "content": CONTENT,
        }

    def abort(self) -> None:
        if self._f is not None:
            self._f.abort()
            self._f = self._hash = None
        self.path.unlink(missing_ok=True)


def check_entry(entry, split: str, n_documents: int | None = None) -> str | None:
    """What is wrong with a manifest's ``splits.<split>.documents`` field (None when it is well formed);
    `n_documents`: the split's own count, where the manifest records one."""
    where = f"splits.{split}.documents."
    if not isinstance(entry, dict):
        return f"field splits.{split}.documents is not an object"
    for key, typ in (("file", str), ("n_documents", int), ("dtype", str), ("bytes", int), ("sha256", str)):
        if key not in entry:
            return f"missing field {where}{key}"
        if not isinstance(entry[key], typ) or isinstance(entry[key], bool):
            return f"field {where}{key} has type {type(entry[key]).__name__}, expected {typ.__name__}"
    name = entry["file"]
    if "/" in name or name.startswith("."):
        return f"field {where}file {name!r} is not a plain file name"
    if entry["dtype"] != DTYPE:
        return f"field {where}dtype is {entry['dtype']!r}, expected {DTYPE!r}"
    if entry["n_documents"] < 1 or entry["bytes"] != 8 * entry["n_documents"]:
        return f"fields {where}n_documents / bytes ({entry['n_documents']} / {entry['bytes']}) do not fit {DTYPE}"
    if n_documents is not None and n_documents != entry["n_documents"]:
        return f"field {where}n_documents is {entry['n_documents']}, but splits.{split}.n_documents is {n_documents}"
    return None


def parse(data: bytes, entry: dict, n_tokens: int, where) -> np.ndarray:
    """The verified start offsets (int64) from the bytes of the file `where`."""
    problem = entry_mismatch(
        entry, len(data), lambda: bytes_sha256(data), recorded="manifest.json", what="the document index"
    )
    if problem:
        raise DocumentIndexError(where, problem if problem.startswith("the ") else f"document index: {problem}")
    starts = np.frombuffer(data, dtype=DTYPE).astype(np.int64)
    if starts[0] != 0 or (starts.size > 1 and not np.all(np.diff(starts) > 0)) or starts[-1] >= n_tokens:
        raise DocumentIndexError(
            where, f"document index: offsets are not ascending from 0 below the split's {n_tokens} tokens"
        )
    return starts
