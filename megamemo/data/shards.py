"""Token shards: webdataset tar files of zstd-compressed little-endian token chunks, plus manifest.json (and, for
corpora of documents, a document index per split: megamemo/data/doc_index.py). The format: megamemo/data/README.md.

A split's stream is cut into chunks of ``chunk_tokens`` tokens (the last one may be shorter); chunk k starts at
token offset o = k·chunk_tokens and is the sample with key ``%012d`` % o: ``<key>.json`` ({"offset", "n_tokens",
"dtype"}) and ``<key>.tokens.zst`` (one zstd frame, content size and checksum stored). Shards hold whole chunks,
so a token offset maps to (shard, chunk) from the manifest alone. Everything read is checked; a mismatch raises
`ShardError` naming the shard and the byte/token offset; nothing is skipped.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
import zstandard

from megamemo.util.errors import MegamemoError
from megamemo.util.files import AtomicFile, HashingWriter, write_text_atomic
from megamemo.util.progress import Progress

from .corpora import Corpus
from .doc_index import DocumentStartsWriter, check_entry
from .tokenizer import SubwordTokenizer

FORMAT = "megamemo-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VOCAB_FILE = "vocab.txt"
DTYPES = ("<u1", "<u2", "<u4", "<u8")
_ZERO_BLOCK = bytes(512)


class ShardError(MegamemoError):
    """A shard that is missing, damaged, or does not match its manifest entry."""

    def __init__(self, shard, message: str, offset: int | None = None):
        self.shard, self.offset, self.detail = str(shard), offset, message
        super().__init__(f"shard {shard}: {message}")


class EmptyCorpusError(MegamemoError, ValueError):
    """A corpus with a split too short to train or evaluate on; the message names the corpus's files."""


def _names(files) -> str:
    if isinstance(files, dict):
        files = [f for fs in files.values() for f in fs]
    if isinstance(files, list):
        return ", ".join(str(f.get("path", f)) if isinstance(f, dict) else str(f) for f in files)
    return str(files)


class ManifestError(MegamemoError, ValueError):
    """manifest.json is missing, unreadable or inconsistent; names the file and the field."""


def chunk_key(offset: int) -> str:
    return f"{offset:012d}"


def dtype_name(dt) -> str:
    """'<u1', '<u2', '<u4', '<u8': unsigned little-endian, as the manifest writes it (numpy says '|u1')."""
    return f"<u{np.dtype(dt).itemsize}"


# ================================================================================================ writing
class SplitWriter:
    """Streams one split's token ids into shards: ``write(ids)`` any number of times, then ``close()`` (or
    ``abort()``: nothing it wrote stays). With ``documents``, every ``write`` gives the token counts of the whole
    documents its ids make up, and a document index is written too (megamemo/data/doc_index.py)."""

    def __init__(
        self,
        out_dir: str | Path,
        split: str,
        n_symbols: int,
        dtype: str,
        chunk_tokens: int,
        shard_bytes: int,
        zstd_level: int = 3,
        documents: bool = False,
    ):
        if chunk_tokens < 1 or shard_bytes < 1:
            raise ValueError("chunk_tokens and shard_bytes must be positive")
        self.out, self.split, self.n_symbols = Path(out_dir), split, n_symbols
        self.dtype, self.chunk_tokens, self.shard_bytes = np.dtype(dtype), chunk_tokens, shard_bytes
        self.cctx = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
        self.buf = np.empty(chunk_tokens, dtype=self.dtype)
        self.fill = 0
        self.n_tokens = 0  # tokens emitted into chunks so far
        self.shards: list[dict] = []
        # the shard being written, all three or none: its file, the hash of its bytes, the tar writer over them
        self._file: AtomicFile | None = None
        self._hash: HashingWriter | None = None
        self._tar: Any = None
        self.docs = DocumentStartsWriter(out_dir, split) if documents else None

    def write(self, ids: np.ndarray, doc_lengths=None) -> None:
        ids = np.asarray(ids)
        if self.docs is not None:
            if doc_lengths is None or int(np.sum(doc_lengths)) != ids.size:
                raise ValueError(
                    f"split {self.split}: {ids.size} tokens written without the lengths of the documents they make up"
                )
            self.docs.add(self.tokens_written, doc_lengths)
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.n_symbols:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"split {self.split}: token id {bad} out of range for a vocabulary of "
                f"{self.n_symbols} symbols (near token {self.n_tokens + self.fill})"
            )
        pos = 0
        while pos < ids.size:
            take = min(self.chunk_tokens - self.fill, ids.size - pos)
            self.buf[self.fill : self.fill + take] = ids[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == self.chunk_tokens:
                self._emit()

    @property
    def tokens_written(self) -> int:
        return self.n_tokens + self.fill

    def _open_shard(self):
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self._file = AtomicFile(self.out / name)
        self._hash = HashingWriter(self._file.file)  # a shard is never read back to hash it
        self._tar = wds.TarWriter(self._hash, mtime=0)  # fixed mtime: same input, same shard bytes
        self.shards.append({"name": name, "offset": self.n_tokens, "n_tokens": 0, "n_chunks": 0})

    def _open(self) -> tuple[AtomicFile, HashingWriter, Any]:
        """The shard being written (opened first when none is)."""
        if self._tar is None:
            self._open_shard()
        assert self._file is not None and self._hash is not None
        return self._file, self._hash, self._tar

    def _emit(self):
        _, hasher, tar = self._open()
        n = self.fill
        arr = self.buf[:n]
        payload = self.cctx.compress(arr.tobytes())
        meta = json.dumps({"offset": self.n_tokens, "n_tokens": n, "dtype": dtype_name(self.dtype)}).encode()
        tar.write({"__key__": chunk_key(self.n_tokens), "json": meta, "tokens.zst": payload})
        entry = self.shards[-1]
        entry["n_tokens"] += n
        entry["n_chunks"] += 1
        self.n_tokens += n
        self.fill = 0
        if hasher.n >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self):
        file, hasher, tar = self._open()
        tar.close()
        entry = self.shards[-1]
        entry["bytes"] = hasher.n
        entry["sha256"] = hasher.hexdigest()
        file.commit()
        self._tar = self._file = self._hash = None

    def close(self) -> dict:
        if self.fill:
            self._emit()
        if self._tar is not None:
            self._close_shard()
        info = {"n_tokens": self.n_tokens, "n_chunks": sum(s["n_chunks"] for s in self.shards), "shards": self.shards}
        return info if self.docs is None else dict(info, documents=self.docs.close())

    def abort(self) -> None:
        """Delete the shard being written and the document index (finished shards: the caller's to delete)."""
        if self._file is not None:
            try:
                self._tar.close()
            finally:
                self._file.abort()
                self._tar = self._file = self._hash = None
        if self.docs is not None:
            self.docs.abort()


def _parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build(
    corpus: Corpus,
    out_dir: str | Path,
    chunk_tokens: int = 1 << 16,
    shard_bytes: int | str = 256 << 20,
    zstd_level: int = 3,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    progress_every: float = 2.0,
    bar: bool | None = False,
) -> dict:
    """Write every split of ``corpus`` as shards under ``out_dir`` and return the manifest (also written).
    Progress: a line to `log` every `progress_every` seconds, or a tqdm bar on stderr (bar=True; None: when
    stderr is a terminal)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    old = out / MANIFEST
    if old.exists():
        if not overwrite:
            raise FileExistsError(f"{old} exists; pass --overwrite to replace the shards it lists")
        for entry in _listed_files(out):
            (out / entry).unlink(missing_ok=True)
    shard_bytes = _parse_size(shard_bytes)
    vocab = corpus.vocab
    dtype = dtype_name(corpus.dtype or vocab.dtype)
    if len(vocab) - 1 > np.iinfo(np.dtype(dtype)).max:
        raise ValueError(f"a vocabulary of {len(vocab)} symbols does not fit the token dtype {dtype}")
    if isinstance(vocab, SubwordTokenizer):  # subword: the tokenizer file itself (tokenizer.json or .model)
        vocab_file, vocab_sha = vocab.save(out).name, vocab.sha256
    else:
        vocab_file, vocab_sha = VOCAB_FILE, vocab.save(out / VOCAB_FILE)
    log(
        f"[prepare] {corpus.name} ({corpus.mode}): vocabulary of {len(vocab)} symbols, tokens as {dtype}, "
        f"chunks of {chunk_tokens} tokens, shards of ~{shard_bytes / 2**20:.0f} MiB -> {out}"
    )
    splits: dict[str, dict] = {}
    written = [out / vocab_file]
    t_start = time.time()
    try:
        _write_splits(
            corpus, out, vocab, dtype, chunk_tokens, shard_bytes, zstd_level, log, progress_every, bar, splits, written
        )
    except BaseException:  # nothing half-written stays: what this build wrote goes
        for f in written + [t for split in corpus.splits for t in out.glob(f"{split}-*.tar*")]:
            f.unlink(missing_ok=True)
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        raise
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "corpus": corpus.name,
        "mode": corpus.mode,
        "tokenizer": corpus.tokenizer,
        "vocab": {"file": vocab_file, "kind": vocab.kind, "size": len(vocab), "sha256": vocab_sha},
        "dtype": dtype,
        "chunk_tokens": chunk_tokens,
        "compression": {"codec": "zstd", "level": zstd_level, "checksum": True},
        "sample": {
            "key": "%012d token offset of the chunk in its split's stream",
            "json": "offset, n_tokens, dtype",
            "tokens.zst": "zstd frame of n_tokens little-endian ids",
        },
        "source": corpus.source,
        "splits": splits,
    }
    write_text_atomic(old, json.dumps(manifest, indent=1) + "\n")
    log(f"[prepare] done in {time.time() - t_start:.1f}s: {out / MANIFEST}")
    return manifest


def _write_splits(
    corpus, out, vocab, dtype, chunk_tokens, shard_bytes, zstd_level, log, progress_every, bar, splits, written
) -> None:
    """Every split's shards (their paths appended to `written` as they appear); a split of fewer than 2 tokens
    (an empty or too short corpus) is an error naming the corpus's files."""
    if corpus.interleaved is not None:
        return _write_interleaved(
            corpus, out, vocab, dtype, chunk_tokens, shard_bytes, zstd_level, log, progress_every, bar, splits, written
        )
    for split, gen in corpus.splits.items():
        w = SplitWriter(out, split, len(vocab), dtype, chunk_tokens, shard_bytes, zstd_level, corpus.documents)
        stats: dict = {}
        t0 = time.time()
        try:
            with Progress(
                f"[prepare] {split}",
                total=corpus.input_bytes.get(split, 0),
                unit="B",
                scale=True,
                every=progress_every,
                bar=bar,
                log=log,
                line=_progress_line(split),
            ) as progress:
                for item in gen(stats):
                    w.write(*(item if corpus.documents else (item,)))
                    progress.update_to(stats.get("input_bytes", 0), tokens=w.tokens_written, shards=len(w.shards))
            info = w.close()
        except BaseException:
            w.abort()  # its open shard and document index (build removes the finished shards)
            raise
        written += _files_of(out, info)
        _check_not_empty(corpus, split, info)
        info.update({"n_unk_mapped": stats["n_unk_mapped"]} if stats.get("n_unk_mapped") else {})
        splits[split] = info
        dt = max(time.time() - t0, 1e-9)
        size = sum(s["bytes"] for s in info["shards"])
        log(
            f"[prepare] {split}: {info['n_tokens']:,} tokens in {len(info['shards'])} shards "
            f"({size / 2**20:.1f} MiB), {info['n_tokens'] / dt / 1e6:.1f} M tokens/s"
            + (f", {info['n_unk_mapped']:,} unknown words -> <unk>" if info.get("n_unk_mapped") else "")
        )


def _check_not_empty(corpus, split: str, info: dict) -> None:
    if info["n_tokens"] < 2:
        files = corpus.source.get("files", corpus.name)
        raise EmptyCorpusError(
            f"{_names(files)}: the {split} split holds {info['n_tokens']} tokens (at least 2 "
            f"needed): the corpus is empty or too short"
        )


def _write_interleaved(
    corpus, out, vocab, dtype, chunk_tokens, shard_bytes, zstd_level, log, progress_every, bar, splits, written
) -> None:
    """All splits of a document corpus in one pass: each (split, ids) the corpus yields goes to that split's
    writer; the corpus counts each split's documents and UTF-8 bytes (recorded as n_documents, n_bytes)."""
    writers = {
        s: SplitWriter(out, s, len(vocab), dtype, chunk_tokens, shard_bytes, zstd_level, corpus.documents)
        for s in corpus.splits
    }
    stats: dict = {}
    t0 = time.time()
    try:
        with Progress(
            "[prepare] all splits",
            total=corpus.input_bytes.get("all", 0),
            unit="B",
            scale=True,
            every=progress_every,
            bar=bar,
            log=log,
            line=_progress_line("all splits"),
        ) as progress:
            for split, *item in corpus.interleaved(stats):
                writers[split].write(*item)
                progress.update_to(
                    stats.get("input_bytes", 0),
                    tokens=sum(w.tokens_written for w in writers.values()),
                    shards=sum(len(w.shards) for w in writers.values()),
                )
        infos = {split: w.close() for split, w in writers.items()}
    except BaseException:
        for w in writers.values():  # the shard each writer had open goes too (build removes the rest)
            w.abort()
        raise
    written += [f for info in infos.values() for f in _files_of(out, info)]
    for split, info in infos.items():
        _check_not_empty(corpus, split, info)
        info.update(stats.get("splits", {}).get(split, {}))
        splits[split] = info
    dt = max(time.time() - t0, 1e-9)
    mib = stats.get("input_bytes", 0) / 2**20
    log(
        "[prepare] "
        + ", ".join(
            f"{s} {i['n_tokens']:,} tokens ({i.get('n_documents', 0):,} documents, {i.get('n_bytes', 0):,} bytes)"
            for s, i in splits.items()
        )
        + f"; {mib:.1f} MiB of input in {dt:.1f}s = {mib / dt:.2f} MiB/s"
    )


def _files_of(out: Path, info: dict) -> list[Path]:
    return [out / sh["name"] for sh in info["shards"]] + [out / d["file"] for d in [info.get("documents")] if d]


def _progress_line(split: str):
    def line(p: Progress) -> str:
        pct = f" ({100 * p.n / p.total:.0f}%)" if p.total else ""
        eta = f", ETA {_duration((p.total - p.n) / p.rate)}" if p.total and p.rate > 0 and p.n < p.total else ""
        return (
            f"[prepare] {split}: {p.n / 2**20:.1f} MiB read{pct}, {p.info['tokens']:,} tokens, "
            f"{p.info['shards']} shards, {p.rate / 2**20:.1f} MiB/s{eta}"
        )

    return line


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _listed_files(out: Path) -> list[str]:
    try:
        m = json.loads((out / MANIFEST).read_text())
        names = [s["name"] for sp in m["splits"].values() for s in sp["shards"]]
        names += [sp["documents"]["file"] for sp in m["splits"].values() if "documents" in sp]
        return names + [m["vocab"]["file"], MANIFEST]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{out / MANIFEST}: cannot read the old manifest to replace it ({e})") from None


# ================================================================================================ manifest
def load_manifest(data_dir: str | Path) -> dict:
    """Read and check manifest.json: every field the reader relies on, and that shards tile each split."""
    path = Path(data_dir) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: not found (is {data_dir} a directory made by `megamemo prepare`?)") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable: {e}") from None

    need = functools.partial(_need, path)
    if need(m, "format", str, "") != FORMAT:
        raise ManifestError(f"{path}: field format is {m['format']!r}, expected {FORMAT!r}")
    if need(m, "format_version", int, "") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {m['format_version']} is not supported (this reader reads "
            f"version {FORMAT_VERSION})"
        )
    need(m, "corpus", str, "")
    if need(m, "dtype", str, "") not in DTYPES:
        raise ManifestError(f"{path}: field dtype is {m['dtype']!r}, expected one of {DTYPES}")
    ct = need(m, "chunk_tokens", int, "")
    if ct < 1:
        raise ManifestError(f"{path}: field chunk_tokens must be positive")
    v = need(m, "vocab", dict, "")
    need(v, "file", str, "vocab.")
    need(v, "kind", str, "vocab.")
    vsize = need(v, "size", int, "vocab.")
    if vsize - 1 > np.iinfo(np.dtype(m["dtype"])).max:
        raise ManifestError(f"{path}: vocab.size {vsize} does not fit dtype {m['dtype']}")
    for split, sp in need(m, "splits", dict, "").items():
        _check_split(path, split, sp, ct)
    return m


def _need(path: Path, obj, key: str, typ: type, where: str):
    """obj[key], which manifest.json must hold with type `typ` (`where`: the field's path, for the error)."""
    if not isinstance(obj, dict) or key not in obj:
        raise ManifestError(f"{path}: missing field {where}{key}")
    v = obj[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ManifestError(f"{path}: field {where}{key} has type {type(v).__name__}, expected {typ.__name__}")
    return v


def _check_split(path: Path, split: str, sp, ct: int) -> None:
    """One split of the manifest: its fields, and that its shards tile its tokens in chunks of `ct`."""
    need = functools.partial(_need, path)
    w = f"splits.{split}."
    n = need(sp, "n_tokens", int, w)
    pos = 0
    for i, s in enumerate(need(sp, "shards", list, w)):
        ws = f"{w}shards[{i}]."
        name = need(s, "name", str, ws)
        if "/" in name or name.startswith("."):
            raise ManifestError(f"{path}: field {ws}name {name!r} is not a plain file name")
        off, cnt = need(s, "offset", int, ws), need(s, "n_tokens", int, ws)
        nch = need(s, "n_chunks", int, ws)
        need(s, "bytes", int, ws)
        need(s, "sha256", str, ws)
        if off != pos:
            raise ManifestError(f"{path}: field {ws}offset is {off}, but the previous shards end at token {pos}")
        if cnt < 1 or nch != -(-cnt // ct) or (off % ct):
            raise ManifestError(
                f"{path}: shard {name}: {cnt} tokens in {nch} chunks at offset {off} do not "
                f"fit chunks of {ct} tokens (fields {ws}n_tokens / n_chunks / offset)"
            )
        if cnt % ct and pos + cnt != n:
            raise ManifestError(f"{path}: shard {name} ends with a short chunk but is not the last of {split}")
        pos += cnt
    if pos != n:
        raise ManifestError(f"{path}: field {w}n_tokens is {n} but its shards hold {pos} tokens")
    if "documents" in sp and (problem := check_entry(sp["documents"], split, sp.get("n_documents"))):
        raise ManifestError(f"{path}: {problem}")
