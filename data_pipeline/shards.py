"""Token shards: webdataset tar files of zstd-compressed little-endian token chunks, plus manifest.json.

Layout of a prepared directory::

    manifest.json          format version, corpus, tokenizer, vocabulary, dtype, per split the shard list
    vocab.txt              one symbol per line; line i is token id i
    train-000000.tar ...   shards of each split, in stream order

Each shard is a plain tar (webdataset convention: one sample = the members sharing a key). A split's stream is
cut into chunks of ``chunk_tokens`` tokens (the last one may be shorter); chunk k of a split starts at token
offset o = k·chunk_tokens and is the sample with key ``%012d`` % o, with two members:

    <key>.json        {"offset": o, "n_tokens": n, "dtype": "<u2"}
    <key>.tokens.zst  one zstd frame (content size and checksum stored) holding n tokens as a little-endian array

Shards hold whole chunks, so a token offset maps to (shard, chunk) from the manifest alone. Everything read is
checked: a truncated tar, a broken zstd frame, a chunk with the wrong token count, a file that does not match its
manifest entry raise `ShardError` naming the shard and the byte/token offset; nothing is skipped.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import webdataset as wds
import zstandard

from megamemo.progress import Progress

from .corpora import Corpus
from .vocab import Vocab

FORMAT = "megamemo-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VOCAB_FILE = "vocab.txt"
DTYPES = ("<u1", "<u2", "<u4", "<u8")
_ZERO_BLOCK = bytes(512)


class ShardError(Exception):
    """A shard that is missing, damaged, or does not match its manifest entry."""

    def __init__(self, shard, message: str, offset: int | None = None):
        self.shard, self.offset, self.detail = str(shard), offset, message
        super().__init__(f"shard {shard}: {message}")


class ManifestError(ValueError):
    """manifest.json is missing, unreadable or inconsistent; names the file and the field."""


def chunk_key(offset: int) -> str:
    return f"{offset:012d}"


def dtype_name(dt) -> str:
    """'<u1', '<u2', '<u4', '<u8': unsigned little-endian, as the manifest writes it (numpy says '|u1')."""
    return f"<u{np.dtype(dt).itemsize}"


# ================================================================================================ writing
class _HashingFile:
    """File wrapper that hashes and counts what is written (so a shard is never read back to hash it)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.f.write(b)
        self.sha.update(b)
        self.n += len(b)
        return len(b)

    def flush(self):
        self.f.flush()


class SplitWriter:
    """Streams one split's token ids into shards: ``write(ids)`` any number of times, then ``close()``."""

    def __init__(self, out_dir: str | Path, split: str, n_symbols: int, dtype: str, chunk_tokens: int,
                 shard_bytes: int, zstd_level: int = 3):
        if chunk_tokens < 1 or shard_bytes < 1:
            raise ValueError("chunk_tokens and shard_bytes must be positive")
        self.out, self.split, self.n_symbols = Path(out_dir), split, n_symbols
        self.dtype, self.chunk_tokens, self.shard_bytes = np.dtype(dtype), chunk_tokens, shard_bytes
        self.cctx = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
        self.buf = np.empty(chunk_tokens, dtype=self.dtype)
        self.fill = 0
        self.n_tokens = 0           # tokens emitted into chunks so far
        self.shards: list[dict] = []
        self._tar = self._file = self._hash = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.n_symbols:
            bad = lo if lo < 0 else hi
            raise ValueError(f"split {self.split}: token id {bad} out of range for a vocabulary of "
                             f"{self.n_symbols} symbols (near token {self.n_tokens + self.fill})")
        pos = 0
        while pos < ids.size:
            take = min(self.chunk_tokens - self.fill, ids.size - pos)
            self.buf[self.fill:self.fill + take] = ids[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.chunk_tokens:
                self._emit()

    @property
    def tokens_written(self) -> int:
        return self.n_tokens + self.fill

    def _open_shard(self):
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self._partial = self.out / f".{name}.partial"
        self._file = open(self._partial, "wb")
        self._hash = _HashingFile(self._file)
        self._tar = wds.TarWriter(self._hash, mtime=0)   # fixed mtime: same input, same shard bytes
        self.shards.append({"name": name, "offset": self.n_tokens, "n_tokens": 0, "n_chunks": 0})

    def _emit(self):
        if self._tar is None:
            self._open_shard()
        n = self.fill
        arr = self.buf[:n]
        payload = self.cctx.compress(arr.tobytes())
        meta = json.dumps({"offset": self.n_tokens, "n_tokens": n, "dtype": dtype_name(self.dtype)}).encode()
        self._tar.write({"__key__": chunk_key(self.n_tokens), "json": meta, "tokens.zst": payload})
        entry = self.shards[-1]
        entry["n_tokens"] += n
        entry["n_chunks"] += 1
        self.n_tokens += n
        self.fill = 0
        if self._hash.n >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self):
        self._tar.close()
        self._file.close()
        entry = self.shards[-1]
        entry["bytes"] = self._hash.n
        entry["sha256"] = self._hash.sha.hexdigest()
        os.replace(self._partial, self.out / entry["name"])
        self._tar = self._file = self._hash = None

    def close(self) -> dict:
        if self.fill:
            self._emit()
        if self._tar is not None:
            self._close_shard()
        return {"n_tokens": self.n_tokens, "n_chunks": sum(s["n_chunks"] for s in self.shards),
                "shards": self.shards}


def _parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build(corpus: Corpus, out_dir: str | Path, chunk_tokens: int = 1 << 16, shard_bytes: int | str = 256 << 20,
          zstd_level: int = 3, overwrite: bool = False, log: Callable[[str], None] | None = None,
          progress_every: float = 2.0, bar: bool | None = False) -> dict:
    """Write every split of ``corpus`` as shards under ``out_dir`` and return the manifest (also written).
    Progress: a line to `log` every `progress_every` seconds, or a tqdm bar on stderr (bar=True; None: when
    stderr is a terminal)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = out / MANIFEST
    if old.exists():
        if not overwrite:
            raise FileExistsError(f"{old} exists; pass --overwrite to replace the shards it lists")
        for entry in _listed_files(out):
            (out / entry).unlink(missing_ok=True)
    shard_bytes = _parse_size(shard_bytes)
    vocab = corpus.vocab
    dtype = dtype_name(vocab.dtype)
    vocab_sha = vocab.save(out / VOCAB_FILE)
    log(f"[prepare] {corpus.name} ({corpus.mode}): vocabulary of {len(vocab)} symbols, tokens as {dtype}, "
        f"chunks of {chunk_tokens} tokens, shards of ~{shard_bytes / 2**20:.0f} MiB -> {out}")
    splits = {}
    t_start = time.time()
    for split, gen in corpus.splits.items():
        w = SplitWriter(out, split, len(vocab), dtype, chunk_tokens, shard_bytes, zstd_level)
        stats: dict = {}
        t0 = time.time()
        with Progress(f"[prepare] {split}", total=corpus.input_bytes.get(split, 0), unit="B", scale=True,
                      every=progress_every, bar=bar, log=log, line=_progress_line(split)) as progress:
            for ids in gen(stats):
                w.write(ids)
                progress.update_to(stats.get("input_bytes", 0), tokens=w.tokens_written, shards=len(w.shards))
        info = w.close()
        if stats.get("n_unk_mapped"):
            info["n_unk_mapped"] = stats["n_unk_mapped"]
        splits[split] = info
        dt = max(time.time() - t0, 1e-9)
        size = sum(s["bytes"] for s in info["shards"])
        log(f"[prepare] {split}: {info['n_tokens']:,} tokens in {len(info['shards'])} shards "
            f"({size / 2**20:.1f} MiB), {info['n_tokens'] / dt / 1e6:.1f} M tokens/s"
            + (f", {info['n_unk_mapped']:,} unknown words -> <unk>" if info.get("n_unk_mapped") else ""))
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "corpus": corpus.name, "mode": corpus.mode, "tokenizer": corpus.tokenizer,
        "vocab": {"file": VOCAB_FILE, "kind": vocab.kind, "size": len(vocab), "sha256": vocab_sha},
        "dtype": dtype, "chunk_tokens": chunk_tokens,
        "compression": {"codec": "zstd", "level": zstd_level, "checksum": True},
        "sample": {"key": "%012d token offset of the chunk in its split's stream",
                   "json": "offset, n_tokens, dtype", "tokens.zst": "zstd frame of n_tokens little-endian ids"},
        "source": corpus.source,
        "splits": splits,
    }
    tmp = out / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, old)
    log(f"[prepare] done in {time.time() - t_start:.1f}s: {out / MANIFEST}")
    return manifest


def _progress_line(split: str):
    def line(p: Progress) -> str:
        pct = f" ({100 * p.n / p.total:.0f}%)" if p.total else ""
        return (f"[prepare] {split}: {p.n / 2**20:.1f} MiB read{pct}, {p.info['tokens']:,} tokens, "
                f"{p.info['shards']} shards, {p.rate / 2**20:.1f} MiB/s")
    return line


def _listed_files(out: Path) -> list[str]:
    try:
        m = json.loads((out / MANIFEST).read_text())
        names = [s["name"] for sp in m["splits"].values() for s in sp["shards"]]
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

    def need(obj, key, typ, where):
        if not isinstance(obj, dict) or key not in obj:
            raise ManifestError(f"{path}: missing field {where}{key}")
        v = obj[key]
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ManifestError(f"{path}: field {where}{key} has type {type(v).__name__}, expected {typ.__name__}")
        return v

    if need(m, "format", str, "") != FORMAT:
        raise ManifestError(f"{path}: field format is {m['format']!r}, expected {FORMAT!r}")
    if need(m, "format_version", int, "") != FORMAT_VERSION:
        raise ManifestError(f"{path}: format_version {m['format_version']} is not supported (this reader reads "
                            f"version {FORMAT_VERSION})")
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
                raise ManifestError(f"{path}: shard {name}: {cnt} tokens in {nch} chunks at offset {off} do not "
                                    f"fit chunks of {ct} tokens (fields {ws}n_tokens / n_chunks / offset)")
            if cnt % ct and pos + cnt != n:
                raise ManifestError(f"{path}: shard {name} ends with a short chunk but is not the last of {split}")
            pos += cnt
        if pos != n:
            raise ManifestError(f"{path}: field {w}n_tokens is {n} but its shards hold {pos} tokens")
    return m


# ================================================================================================ reading
def scan_tar(fd: int, size: int, shard: str | Path) -> list[tuple[str, int, int]]:
    """(name, data offset, data size) of every member, reading headers only. Unlike tarfile (which stops
    quietly at a cut-off header), a truncation anywhere is an error with the byte offset."""
    members, pos = [], 0
    while True:
        if pos + 512 > size:
            raise ShardError(shard, f"truncated tar: the file ends at byte {size} where a header or the "
                                    f"end-of-archive marker should start (byte {pos})", pos)
        hdr = os.pread(fd, 512, pos)
        if hdr == _ZERO_BLOCK:
            if pos + 1024 > size:
                raise ShardError(shard, f"truncated tar: end-of-archive marker at byte {pos} is cut short", pos)
            return members
        try:
            stored = int(hdr[148:156].strip(b"\0 ") or b"0", 8)
            size_field = int(hdr[124:136].strip(b"\0 ") or b"0", 8)
        except ValueError:
            raise ShardError(shard, f"corrupt tar header at byte {pos}", pos) from None
        if stored != sum(hdr[:148]) + 256 + sum(hdr[156:]):
            raise ShardError(shard, f"corrupt tar header at byte {pos} (checksum mismatch)", pos)
        name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = hdr[345:500].split(b"\0", 1)[0] if hdr[257:262] == b"ustar" else b""
        if prefix:
            name = prefix.decode("utf-8", "replace") + "/" + name
        if hdr[156:157] not in (b"0", b"\0"):
            raise ShardError(shard, f"tar member {name!r} at byte {pos} has type {hdr[156:157]!r}, expected a "
                                    f"regular file", pos)
        data = pos + 512
        if data + size_field > size:
            raise ShardError(shard, f"truncated tar: member {name!r} (header at byte {pos}) needs bytes up to "
                                    f"{data + size_field} but the file ends at byte {size}", pos)
        members.append((name, data, size_field))
        pos = data + (size_field + 511) // 512 * 512


class ShardFile:
    """One open shard: its tar structure checked against the manifest entry, chunks readable by index."""

    def __init__(self, root: Path, entry: dict, dtype: np.dtype, chunk_tokens: int, check_sha: bool = False):
        self.path = root / entry["name"]
        self.entry, self.dtype, self.chunk_tokens = entry, dtype, chunk_tokens
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardError(self.path, "missing (listed in manifest.json)") from None
        try:
            self._check(check_sha)
        except BaseException:
            os.close(self.fd)
            raise
        self.dctx = zstandard.ZstdDecompressor()

    def _check(self, check_sha: bool):
        e, path = self.entry, self.path
        size = os.fstat(self.fd).st_size
        try:
            members = scan_tar(self.fd, size, path)
        except ShardError as err:
            if size != e["bytes"]:
                raise ShardError(path, f"{err.detail}; the file is {size} bytes, "
                                       f"manifest.json says {e['bytes']}", err.offset) from None
            raise
        if size != e["bytes"]:
            raise ShardError(path, f"the file is {size} bytes, manifest.json says {e['bytes']}")
        self.index = np.empty((e["n_chunks"], 2), dtype=np.int64)
        k = 0
        for name, off, n in members:
            key, _, ext = name.partition(".")
            if ext == "json":
                continue
            expect = chunk_key(e["offset"] + k * self.chunk_tokens)
            if ext != "tokens.zst" or key != expect or k >= e["n_chunks"]:
                raise ShardError(path, f"unexpected tar member {name!r} (data at byte {off}); expected "
                                       f"{expect}.tokens.zst as chunk {k} of {e['n_chunks']}", off)
            self.index[k] = (off, n)
            k += 1
        if k != e["n_chunks"]:
            raise ShardError(path, f"holds {k} chunks, manifest.json says {e['n_chunks']}")
        if check_sha:
            digest = file_sha256(path)
            if digest != e["sha256"]:
                raise ShardError(path, f"sha256 {digest} does not match manifest.json ({e['sha256']})")

    def chunk_count(self, k: int) -> int:
        return min(self.chunk_tokens, self.entry["n_tokens"] - k * self.chunk_tokens)

    def read_chunk(self, k: int) -> np.ndarray:
        off, n = (int(x) for x in self.index[k])
        tok = self.entry["offset"] + k * self.chunk_tokens
        where = f"chunk at token offset {tok} (byte {off})"
        data = os.pread(self.fd, n, off)
        if len(data) != n:
            raise ShardError(self.path, f"{where}: truncated, read {len(data)} of {n} bytes", off)
        expected = self.chunk_count(k) * self.dtype.itemsize
        try:
            content = zstandard.frame_content_size(data)
            if content != expected:
                raise ShardError(self.path, f"{where}: holds {content / self.dtype.itemsize:g} tokens by its zstd "
                                            f"frame header, expected {self.chunk_count(k)}", off)
            raw = self.dctx.decompress(data)
        except zstandard.ZstdError as err:
            raise ShardError(self.path, f"{where}: broken zstd frame: {err}", off) from None
        if len(raw) != expected:
            raise ShardError(self.path, f"{where}: holds {len(raw) // self.dtype.itemsize} tokens, "
                                        f"expected {self.chunk_count(k)}", off)
        return np.frombuffer(raw, dtype=self.dtype)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


class SplitSource:
    """Random access to one split's token stream: ``read(start, stop, out, slot)``.

    Memory is bounded: at most ``max_open`` shards open (file handle + chunk index) and, per caller slot
    (one per batch column), the one decompressed chunk it last used."""

    def __init__(self, data_dir: str | Path, split: str, verify: str = "size", max_open: int = 64,
                 manifest: dict | None = None):
        if verify not in ("size", "sha256"):
            raise ValueError(f"verify must be 'size' or 'sha256', got {verify!r}")
        self.root = Path(data_dir)
        self.manifest = manifest or load_manifest(self.root)
        if split not in self.manifest["splits"]:
            raise ManifestError(f"{self.root / MANIFEST}: no split {split!r} (has {sorted(self.manifest['splits'])})")
        self.split, self.verify, self.max_open = split, verify, max(1, max_open)
        sp = self.manifest["splits"][split]
        self.n_tokens = sp["n_tokens"]
        self.entries = sp["shards"]
        self.starts = [e["offset"] for e in self.entries]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.chunk_tokens = self.manifest["chunk_tokens"]
        for e in self.entries:  # cheap up-front check that the files are the ones the manifest lists
            p = self.root / e["name"]
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise ShardError(p, "missing (listed in manifest.json)") from None
            if size != e["bytes"]:
                raise ShardError(p, f"the file is {size} bytes, manifest.json says {e['bytes']}"
                                    + (" (truncated?)" if size < e["bytes"] else ""))
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._sha_checked: set[int] = set()
        self._slots: dict[int, tuple[int, np.ndarray]] = {}
        self.chunks_decoded = 0

    def _shard(self, i: int) -> ShardFile:
        f = self._open.get(i)
        if f is not None:
            self._open.move_to_end(i)
            return f
        check = self.verify == "sha256" and i not in self._sha_checked
        f = ShardFile(self.root, self.entries[i], self.dtype, self.chunk_tokens, check_sha=check)
        if check:
            self._sha_checked.add(i)
        self._open[i] = f
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].close()
        return f

    def chunk(self, g: int) -> np.ndarray:
        """Chunk g of the split (tokens g·chunk_tokens ...)."""
        start = g * self.chunk_tokens
        i = bisect.bisect_right(self.starts, start) - 1
        f = self._shard(i)
        self.chunks_decoded += 1
        return f.read_chunk((start - self.starts[i]) // self.chunk_tokens)

    def read(self, start: int, stop: int, out: np.ndarray, slot: int = 0) -> None:
        """Copy tokens [start, stop) into ``out``; ``slot`` keeps the last chunk for the next call."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"split {self.split}: token range [{start}, {stop}) outside [0, {self.n_tokens})")
        ct, o, pos = self.chunk_tokens, 0, start
        while pos < stop:
            g = pos // ct
            cached = self._slots.get(slot)
            if cached is None or cached[0] != g:
                cached = (g, self.chunk(g))
                self._slots[slot] = cached
            arr = cached[1]
            a = pos - g * ct
            b = min(stop - g * ct, arr.size)
            out[o:o + b - a] = arr[a:b]
            o += b - a
            pos += b - a

    def read_all(self) -> np.ndarray:
        out = np.empty(self.n_tokens, dtype=self.dtype)
        self.read(0, self.n_tokens, out, slot=-1)
        self._slots.pop(-1, None)
        return out

    def cache_info(self) -> dict:
        return {"open_shards": len(self._open), "cached_chunks": len(self._slots),
                "cached_bytes": sum(a.nbytes for _, a in self._slots.values())}

    def close(self):
        for f in self._open.values():
            f.close()
        self._open.clear()
        self._slots.clear()


def read_split(data_dir: str | Path, split: str, verify: str = "size") -> np.ndarray:
    """The whole token stream of a split (for small splits and tests), every chunk checked."""
    src = SplitSource(data_dir, split, verify=verify)
    try:
        return src.read_all()
    finally:
        src.close()


def load_vocab(data_dir: str | Path) -> Vocab:
    m = load_manifest(data_dir)
    path = Path(data_dir) / m["vocab"]["file"]
    if "sha256" in m["vocab"] and file_sha256(path) != m["vocab"]["sha256"]:
        raise ManifestError(f"{path}: sha256 does not match manifest.json field vocab.sha256")
    v = Vocab.load(path, m["vocab"]["kind"])
    if len(v) != m["vocab"]["size"]:
        raise ManifestError(f"{path}: {len(v)} symbols, manifest.json field vocab.size says {m['vocab']['size']}")
    return v


# ================================================================================================ verify
def verify_shards(data_dir: str | Path, splits: list[str] | None = None,
                  log: Callable[[str], None] = print) -> list[str]:
    """Check every shard against the manifest: size, sha256, tar structure, each chunk's json member, zstd frame,
    token count and id range. Returns the list of problems (empty when all is well); logs progress."""
    root = Path(data_dir)
    try:
        m = load_manifest(root)
        vocab = load_vocab(root)
    except (ManifestError, OSError, ValueError) as e:
        return [str(e)]
    problems = []
    listed = set()
    chosen = splits or list(m["splits"])
    for split in chosen:
        if split not in m["splits"]:
            problems.append(f"{root / MANIFEST}: no split {split!r}")
            continue
        dtype, ct = np.dtype(m["dtype"]), m["chunk_tokens"]
        for e in m["splits"][split]["shards"]:
            listed.add(e["name"])
            t0 = time.time()
            f = None
            try:
                f = ShardFile(root, e, dtype, ct, check_sha=True)
                for k in range(e["n_chunks"]):
                    ids = f.read_chunk(k)
                    if ids.size and int(ids.max()) >= len(vocab):
                        raise ShardError(f.path, f"chunk at token offset {e['offset'] + k * ct}: token id "
                                                 f"{int(ids.max())} >= vocabulary size {len(vocab)}")
                _check_json_members(f)
                dt = time.time() - t0
                log(f"ok   {e['name']}: {e['n_tokens']:,} tokens, {e['n_chunks']} chunks, "
                    f"{e['bytes'] / 2**20 / max(dt, 1e-9):.0f} MiB/s")
            except ShardError as err:
                problems.append(str(err))
                log(f"FAIL {err}")
            finally:
                if f is not None:
                    f.close()
    if splits is None:
        for p in sorted(root.glob("*.tar")):
            if p.name not in listed:
                log(f"note {p.name}: not listed in manifest.json (ignored by readers)")
    return problems


def _check_json_members(f: ShardFile) -> None:
    size = os.fstat(f.fd).st_size
    k = 0
    for name, off, n in scan_tar(f.fd, size, f.path):
        if not name.endswith(".json"):
            continue
        tok = f.entry["offset"] + k * f.chunk_tokens
        try:
            meta = json.loads(os.pread(f.fd, n, off))
        except ValueError as e:
            raise ShardError(f.path, f"member {name!r} (byte {off}): bad json: {e}", off) from None
        want = {"offset": tok, "n_tokens": f.chunk_count(k), "dtype": dtype_name(f.dtype)}
        if name != f"{chunk_key(tok)}.json" or meta != want:
            raise ShardError(f.path, f"member {name!r} (byte {off}) says {meta}, expected {want}", off)
        k += 1
    if k != f.entry["n_chunks"]:
        raise ShardError(f.path, f"holds {k} json members, expected {f.entry['n_chunks']}")
