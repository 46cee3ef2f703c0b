"""Raw corpora -> per-split streams of token ids, read in bounded blocks (never the whole corpus in memory).

A `Corpus` names its vocabulary and, per split, a function returning an iterator of int64 id arrays.
Supported corpora (see `megamemo prepare --help`):
* ``enwik8``  one file; 90/5/5 split by byte position (90M/5M/5M for the full 10^8-byte file).
  mode ``bytes`` (default): every byte is a token, id = byte value, 256 symbols.
  mode ``reference``: Transformer-XL / awd-lstm ``prep_enwik8.py``: newline bytes are dropped (after the split),
  symbols = byte values present in the whole file, ordered by frequency (204 for the full enwik8).
* ``text8``   one file of a-z and spaces; same split rule.
  mode ``chars`` (default): fixed 27-symbol alphabet ``_a..z`` ('_' = space), every byte kept.
  mode ``reference``: ``prep_text8.py``: each split part is ``strip()``-ed, symbols ordered by frequency.
* ``wikitext-103``  a directory with ``wiki.{train,valid,test}.tokens``: whitespace words, ``<eos>`` after
  every line, case kept, vocabulary from train only (``<eos>`` first, then by frequency), ``<unk>`` kept as a word.
  With ``vocab_file`` the vocabulary is read instead and train may be absent.
* ``text``    plain-text or ``.jsonl`` files (megamemo/data/text_files.py): byte-level (raw UTF-8 bytes), or words
  with a given vocabulary file. When every file is ``.jsonl``, each record is a document (recorded in a document
  index); plain text is a flat stream (no documents: readers cut it into chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .vocab import Vocab, frequency_order

if TYPE_CHECKING:
    from .tokenizer import SubwordTokenizer

SPLITS = ("train", "valid", "test")
BLOCK_BYTES = 1 << 22
WORD_BLOCK = 1 << 20


@dataclass
class Corpus:
    name: str
    mode: str
    vocab: Vocab | SubwordTokenizer
    tokenizer: dict  # what the manifest records about tokenisation
    splits: dict[str, Callable[[dict], Iterator[Any]] | None]  # split -> f(stats) -> id blocks (see documents)
    input_bytes: dict[str, int] = field(default_factory=dict)  # per split, for progress ("all": interleaved)
    source: dict = field(default_factory=dict)
    # all splits in one pass: f(stats) -> (split, ids) pairs; `splits` then only names the splits (subword.py)
    interleaved: Callable[[dict], Iterator[tuple]] | None = None  # (split, ids) or (split, ids, counts)
    dtype: str | None = None  # token dtype (None: the smallest that holds the vocab)
    # a corpus of documents: its streams yield (ids, token counts of the whole documents in ids) and the shards get
    # a document index (megamemo/data/doc_index.py); interleaved yields (split, ids, counts)
    documents: bool = False


def split_points(n: int, ratio: tuple[int, int, int] = (90, 5, 5)) -> dict[str, tuple[int, int]]:
    """Byte ranges of train/valid/test: valid and test get floor(n·r/total), train the rest (90M/5M/5M of 10^8)."""
    total = sum(ratio)
    n_valid, n_test = n * ratio[1] // total, n * ratio[2] // total
    a, b = n - n_valid - n_test, n - n_test
    return {"train": (0, a), "valid": (a, b), "test": (b, n)}


def read_range(path: Path, start: int, stop: int, block: int = BLOCK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, uint8 block) over bytes [start, stop) of a file."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < stop:
            data = f.read(min(block, stop - pos))
            if not data:
                raise ValueError(f"{path}: file ended at byte {pos}, expected {stop} bytes")
            yield pos, np.frombuffer(data, dtype=np.uint8)
            pos += len(data)


def _check_file(path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"raw corpus file not found: {p}")
    return p


def _count_bytes(ranges: list[tuple[Path, int, int]], drop: int | None = None) -> tuple[dict, dict]:
    """Byte counts and first-occurrence positions over ranges read in order (the Counter of XL's vocab)."""
    counts = np.zeros(256, dtype=np.int64)
    first: dict[int, int] = {}
    pos = 0
    for path, a, b in ranges:
        for _, raw in read_range(path, a, b):
            if drop is not None:
                raw = raw[raw != drop]
            counts += np.bincount(raw, minlength=256)
            vals, idx = np.unique(raw, return_index=True)
            for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
                first.setdefault(v, pos + i)
            pos += raw.size
    return {v: int(counts[v]) for v in first}, first


def _byte_stream(vocab: Vocab, path: Path, a: int, b: int, drop: int | None = None):
    def gen(stats: dict) -> Iterator[np.ndarray]:
        for off, raw in read_range(path, a, b):
            stats["input_bytes"] = stats.get("input_bytes", 0) + raw.size
            if drop is not None:
                raw = raw[raw != drop]
            yield vocab.encode_bytes(raw, where=str(path), base=off)

    return gen


# ---------------------------------------------------------------------------------------------------- enwik8
def enwik8(raw: str | Path, mode: str = "bytes") -> Corpus:
    path = _check_file(raw)
    n = path.stat().st_size
    ranges = split_points(n)
    if mode == "bytes":
        vocab = Vocab.identity_bytes()
        drop = None
        tok = {"kind": "bytes", "newlines": "kept", "vocab": "identity (id = byte value)"}
    elif mode == "reference":
        drop = 10
        counts, first = _count_bytes([(path, 0, n)], drop=drop)
        vocab = Vocab("bytes", [str(v) for v in frequency_order(counts, first)])
        tok = {
            "kind": "bytes",
            "newlines": "dropped (prep_enwik8.py)",
            "vocab": "byte values present in train+valid+test, by decreasing frequency (Transformer-XL)",
        }
    else:
        raise ValueError(f"enwik8: unknown mode {mode!r} (bytes | reference)")
    splits = {s: _byte_stream(vocab, path, a, b, drop) for s, (a, b) in ranges.items()}
    return Corpus(
        "enwik8",
        mode,
        vocab,
        tok,
        splits,
        {s: b - a for s, (a, b) in ranges.items()},
        {"files": [{"path": str(path), "bytes": n}], "split_bytes": ranges},
    )


# ----------------------------------------------------------------------------------------------------- text8
def _strip_spaces(path: Path, a: int, b: int) -> tuple[int, int]:
    """[a, b) without leading/trailing spaces (str.strip() on text8, which has no other whitespace)."""
    lo = a
    for off, raw in read_range(path, a, b, block=1 << 16):
        nz = np.flatnonzero(raw != 32)
        if nz.size:
            lo = off + int(nz[0])
            break
    else:
        return a, a
    hi = b
    while hi > lo:
        start = max(lo, hi - (1 << 16))
        _, raw = next(read_range(path, start, hi))
        nz = np.flatnonzero(raw != 32)
        if nz.size:
            return lo, start + int(nz[-1]) + 1
        hi = start
    return lo, lo


def text8(raw: str | Path, mode: str = "chars") -> Corpus:
    path = _check_file(raw)
    n = path.stat().st_size
    ranges = split_points(n)
    if mode == "chars":
        vocab = Vocab.text8_alphabet()
        tok = {"kind": "chars", "alphabet": "_abcdefghijklmnopqrstuvwxyz ('_' = space)", "strip": False}
    elif mode == "reference":
        ranges = {s: _strip_spaces(path, a, b) for s, (a, b) in ranges.items()}
        counts, first = _count_bytes([(path, a, b) for a, b in ranges.values()])
        bad = [v for v in counts if v != 32 and not 97 <= v <= 122]
        if bad:
            raise ValueError(f"{path}: text8 must hold only a-z and spaces; found byte 0x{bad[0]:02x}")
        vocab = Vocab("chars", ["_" if v == 32 else chr(v) for v in frequency_order(counts, first)])
        tok = {
            "kind": "chars",
            "strip": True,
            "vocab": "characters of train+valid+test, by decreasing frequency (Transformer-XL)",
        }
    else:
        raise ValueError(f"text8: unknown mode {mode!r} (chars | reference)")
    splits = {s: _byte_stream(vocab, path, a, b) for s, (a, b) in ranges.items()}
    return Corpus(
        "text8",
        mode,
        vocab,
        tok,
        splits,
        {s: b - a for s, (a, b) in ranges.items()},
        {"files": [{"path": str(path), "bytes": n}], "split_bytes": ranges},
    )


# ---------------------------------------------------------------------------------------------- wikitext-103
def _xl_lines(path: Path) -> Iterator[tuple[int, list[str], int]]:
    """Transformer-XL tokenisation: text-mode UTF-8 lines, strip + whitespace split, <eos> per line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield lineno, line.split() + ["<eos>"], len(line)


def _word_stream(vocab: Vocab, lines: Callable[[], Iterator], where: str, documents: bool = False):
    """Blocks of ids; with `documents`, each item of `lines` is one document and blocks are (ids, lengths)."""

    def gen(stats: dict) -> Iterator[np.ndarray | tuple[np.ndarray, list[int]]]:
        buf: list[int] = []
        lengths: list[int] = []
        for loc, words, nbytes in lines():
            ids, n_unk = vocab.encode_words(words, where=f"{where}:{loc}")
            if n_unk:
                stats["n_unk_mapped"] = stats.get("n_unk_mapped", 0) + n_unk
            stats["input_bytes"] = stats.get("input_bytes", 0) + nbytes
            buf.extend(ids)
            lengths.append(len(ids))
            if len(buf) >= WORD_BLOCK:
                yield (np.asarray(buf, dtype=np.int64), lengths) if documents else np.asarray(buf, dtype=np.int64)
                buf, lengths = [], []
        if buf:
            yield (np.asarray(buf, dtype=np.int64), lengths) if documents else np.asarray(buf, dtype=np.int64)

    return gen


def wikitext103(raw: str | Path, vocab_file: str | Path | None = None) -> Corpus:
    d = Path(raw)
    if not d.is_dir():
        raise FileNotFoundError(f"wikitext-103: --raw must be the directory holding wiki.*.tokens, got {d}")
    files = {s: d / f"wiki.{s}.tokens" for s in SPLITS}
    present = {s: p for s, p in files.items() if p.is_file()}
    if vocab_file is not None:
        vocab = Vocab.load(vocab_file, "words")
        vsrc = f"file {vocab_file}"
    else:
        if "train" not in present:
            raise FileNotFoundError(
                f"wikitext-103: {files['train']} is missing (the vocabulary is built from "
                f"train only; pass --vocab FILE to use a given vocabulary instead)"
            )
        counts: dict[str, int] = {}
        for _, words, _ in _xl_lines(present["train"]):
            for w in words[:-1]:
                counts[w] = counts.get(w, 0) + 1
        counts.pop("<eos>", None)
        vocab = Vocab("words", ["<eos>"] + frequency_order(counts))
        vsrc = "train only: <eos> first, then by decreasing frequency (Transformer-XL)"
    if not present:
        raise FileNotFoundError(f"wikitext-103: no wiki.{{train,valid,test}}.tokens in {d}")
    splits = {s: _word_stream(vocab, functools.partial(_xl_lines, p), str(p)) for s, p in present.items()}
    tok = {
        "kind": "words",
        "split": "whitespace",
        "eos": "<eos> after every line",
        "lower_case": False,
        "unknown_words": "<unk>",
        "vocab": vsrc,
    }
    return Corpus(
        "wikitext-103",
        "words",
        vocab,
        tok,
        splits,
        {s: p.stat().st_size for s, p in present.items()},
        {"files": [{"path": str(p), "bytes": p.stat().st_size} for p in present.values()]},
    )


# ---------------------------------------------------------------------------------------------------- arrays
def from_arrays(
    arrays: dict[str, np.ndarray], vocab: Vocab, name: str = "arrays", documents: dict[str, np.ndarray] | None = None
) -> Corpus:
    """Token id arrays already in memory (tests, conversions); `documents`: per split, the token counts of its
    documents in order (then the shards get a document index)."""

    def gen_of(split, arr):
        def gen(stats):
            a = np.asarray(arr)
            if documents is not None:  # whole documents per block
                lengths = np.asarray(documents[split], dtype=np.int64)
                ends = np.cumsum(lengths)
                if ends[-1] != a.size:
                    raise ValueError(f"split {split}: documents of {ends[-1]} tokens for {a.size} ids")
                d = 0
                while d < lengths.size:
                    e = max(d + 1, int(np.searchsorted(ends, ends[d] - lengths[d] + WORD_BLOCK, side="right")))
                    yield a[ends[d] - lengths[d] : ends[e - 1]].astype(np.int64), lengths[d:e]
                    d = e
                return
            for i in range(0, a.size, WORD_BLOCK):
                yield a[i : i + WORD_BLOCK].astype(np.int64)

        return gen

    return Corpus(
        name,
        "ids",
        vocab,
        {"kind": vocab.kind, "vocab": "given"},
        {s: gen_of(s, a) for s, a in arrays.items()},
        {s: int(np.asarray(a).size) for s, a in arrays.items()},
        documents=documents is not None,
    )
