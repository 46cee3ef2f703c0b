"""Reading token shards (the format: megamemo/data/shards.py): a tar scanned header by header, chunks
decompressed and checked against the manifest, a split as random-access token ranges (`SplitSource`), whole
splits (`read_split`), the vocabulary, and `verify_shards`. Every inconsistency is a `ShardError` naming the
shard and the byte or token offset."""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from megamemo.util.files import entry_mismatch, fd_sha256, file_sha256

from .doc_index import DocumentIndexError
from .doc_index import parse as parse_document_index
from .remote import RemoteOptions, RemoteShards, is_remote
from .shards import _ZERO_BLOCK, MANIFEST, ManifestError, ShardError, chunk_key, dtype_name, load_manifest
from .tokenizer import KIND as SUBWORD
from .tokenizer import SubwordTokenizer, TokenizerError, load_recorded
from .vocab import Vocab


def scan_tar(fd: int, size: int, shard: str | Path) -> list[tuple[str, int, int]]:
    """(name, data offset, data size) of every member, reading headers only. Unlike tarfile (which stops
    quietly at a cut-off header), a truncation anywhere is an error with the byte offset."""
    members: list[tuple[str, int, int]] = []
    pos = 0
    while True:
        if pos + 512 > size:
            raise ShardError(
                shard,
                f"truncated tar: the file ends at byte {size} where a header or the "
                f"end-of-archive marker should start (byte {pos})",
                pos,
            )
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
            raise ShardError(
                shard, f"tar member {name!r} at byte {pos} has type {hdr[156:157]!r}, expected a regular file", pos
            )
        data = pos + 512
        if data + size_field > size:
            raise ShardError(
                shard,
                f"truncated tar: member {name!r} (header at byte {pos}) needs bytes up to "
                f"{data + size_field} but the file ends at byte {size}",
                pos,
            )
        members.append((name, data, size_field))
        pos = data + (size_field + 511) // 512 * 512


class ShardFile:
    """One open shard: its tar structure checked against the manifest entry, chunks readable by index."""

    def __init__(
        self,
        path: Path | str,
        entry: dict,
        dtype: np.dtype,
        chunk_tokens: int,
        check_sha: bool = False,
        fd: int | None = None,
    ):
        """`path` names the shard in errors; `fd`, when given, is an open copy of it (a verified cached object)."""
        self.path = path
        self.entry, self.dtype, self.chunk_tokens = entry, dtype, chunk_tokens
        if fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                raise ShardError(self.path, "missing (listed in manifest.json)") from None
        self.fd = fd
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
            if wrong_size := entry_mismatch(e, size, recorded="manifest.json"):
                raise ShardError(path, f"{err.detail}; {wrong_size}", err.offset) from None
            raise
        if wrong_size := entry_mismatch(e, size, recorded="manifest.json"):
            raise ShardError(path, wrong_size)
        self.index = np.empty((e["n_chunks"], 2), dtype=np.int64)
        k = 0
        for name, off, n in members:
            key, _, ext = name.partition(".")
            if ext == "json":
                continue
            expect = chunk_key(e["offset"] + k * self.chunk_tokens)
            if ext != "tokens.zst" or key != expect or k >= e["n_chunks"]:
                raise ShardError(
                    path,
                    f"unexpected tar member {name!r} (data at byte {off}); expected "
                    f"{expect}.tokens.zst as chunk {k} of {e['n_chunks']}",
                    off,
                )
            self.index[k] = (off, n)
            k += 1
        if k != e["n_chunks"]:
            raise ShardError(path, f"holds {k} chunks, manifest.json says {e['n_chunks']}")
        if check_sha and (wrong_sha := entry_mismatch(e, size, lambda: fd_sha256(self.fd), recorded="manifest.json")):
            raise ShardError(path, wrong_sha)

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
                raise ShardError(
                    self.path,
                    f"{where}: holds {content / self.dtype.itemsize:g} tokens by its zstd "
                    f"frame header, expected {self.chunk_count(k)}",
                    off,
                )
            raw = self.dctx.decompress(data)
        except zstandard.ZstdError as err:
            raise ShardError(self.path, f"{where}: broken zstd frame: {err}", off) from None
        if len(raw) != expected:
            raise ShardError(
                self.path,
                f"{where}: holds {len(raw) // self.dtype.itemsize} tokens, expected {self.chunk_count(k)}",
                off,
            )
        return np.frombuffer(raw, dtype=self.dtype)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SplitSource:
    """Random access to one split's token stream: ``read(start, stop, out, slot)``.

    Memory is bounded: at most ``max_open`` shards open (file handle + chunk index) and, per caller slot
    (one per batch column), the one decompressed chunk it last used."""

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        verify: str = "size",
        max_open: int = 64,
        manifest: dict | None = None,
        remote: RemoteShards | None = None,
        remote_options: RemoteOptions | None = None,
    ):
        """`data_dir` is a local directory or an s3:// gs:// https:// URL (read through `remote`, a
        RemoteShards: whole shards fetched, sha256-verified, into a local cache; megamemo/data/remote.py)."""
        if verify not in ("size", "sha256"):
            raise ValueError(f"verify must be 'size' or 'sha256', got {verify!r}")
        self._own_remote = remote is None and is_remote(data_dir)
        self.remote = RemoteShards(str(data_dir), remote_options) if self._own_remote else remote
        self.root = self.remote.url if self.remote is not None else Path(data_dir)
        self.manifest = manifest or (self.remote.manifest if self.remote is not None else load_manifest(self.root))
        if split not in self.manifest["splits"]:
            raise ManifestError(f"{self.root}/{MANIFEST}: no split {split!r} (has {sorted(self.manifest['splits'])})")
        self.split, self.verify, self.max_open = split, verify, max(1, max_open)
        sp = self.manifest["splits"][split]
        self.n_tokens = sp["n_tokens"]
        self.entries = sp["shards"]
        self.starts = [e["offset"] for e in self.entries]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.chunk_tokens = self.manifest["chunk_tokens"]
        d = sp.get("documents")  # the document index, as a file entry (None: no documents, chunks)
        self.documents = None if d is None else {"name": d["file"], "bytes": d["bytes"], "sha256": d["sha256"]}
        self._starts: np.ndarray | None = None
        files = self.entries + ([self.documents] if self.documents else [])
        if self.remote is not None:  # one listing: every object there at its size (sha256: when fetched)
            self.remote.check_listing(files)
        for e in files if self.remote is None else ():  # cheap check that the files are the listed ones
            p = self.root / e["name"]
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise ShardError(p, "missing (listed in manifest.json)") from None
            if size != e["bytes"]:
                raise ShardError(
                    p,
                    f"the file is {size} bytes, manifest.json says {e['bytes']}"
                    + (" (truncated?)" if size < e["bytes"] else ""),
                )
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._sha_checked: set[int] = set()
        self._slots: dict[int, tuple[int, np.ndarray]] = {}
        self.chunks_decoded = 0

    def _shard(self, i: int, where: str) -> ShardFile:
        f = self._open.get(i)
        if f is not None:
            self._open.move_to_end(i)
            return f
        e = self.entries[i]
        if self.remote is not None:  # verified against the manifest's sha256 when it was fetched
            f = ShardFile(
                self.remote.object_url(e["name"]), e, self.dtype, self.chunk_tokens, fd=self.remote.open(e, where)
            )
            if i + 1 < len(self.entries):
                self.remote.prefetch(self.entries[i + 1])  # read-ahead: the column's next shard
        else:
            check = self.verify == "sha256" and i not in self._sha_checked
            f = ShardFile(self.root / e["name"], e, self.dtype, self.chunk_tokens, check_sha=check)
            if check:
                self._sha_checked.add(i)
        self._open[i] = f
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].close()
        return f

    def document_starts(self) -> np.ndarray | None:
        """Token offset of each document's first token (int64, ascending from 0), verified against the manifest;
        None for a split without a document index (a flat corpus, or one prepared before indexes existed)."""
        if self.documents is None or self._starts is not None:
            return self._starts
        e = self.documents
        if self.remote is not None:
            path, fd = self.remote.object_url(e["name"]), self.remote.open(e, f"document index of split {self.split}")
        else:
            path = self.root / e["name"]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise ShardError(path, "missing (listed in manifest.json)") from None
        try:
            data = os.pread(fd, e["bytes"] + 1, 0)
        finally:
            os.close(fd)
        entry = self.manifest["splits"][self.split]["documents"]
        try:
            self._starts = parse_document_index(data, entry, self.n_tokens, path)
        except DocumentIndexError as err:
            raise ShardError(err.file, err.detail) from None
        return self._starts

    def shard_index(self, token: int) -> int:
        return bisect.bisect_right(self.starts, token) - 1

    def prefetch_at(self, token: int) -> None:
        """Read-ahead hint: the shard holding `token` will be read soon (remote directories only)."""
        if self.remote is not None and 0 <= token < self.n_tokens:
            i = self.shard_index(token)
            if i not in self._open:
                self.remote.prefetch(self.entries[i])

    def chunk(self, g: int) -> np.ndarray:
        """Chunk g of the split (tokens g·chunk_tokens ...)."""
        start = g * self.chunk_tokens
        i = self.shard_index(start)
        f = self._shard(i, f"chunk at token offset {start} (chunk {g} of split {self.split})")
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
            out[o : o + b - a] = arr[a:b]
            o += b - a
            pos += b - a

    def read_all(self) -> np.ndarray:
        out = np.empty(self.n_tokens, dtype=self.dtype)
        self.read(0, self.n_tokens, out, slot=-1)
        self._slots.pop(-1, None)
        return out

    def cache_info(self) -> dict:
        info = {
            "open_shards": len(self._open),
            "cached_chunks": len(self._slots),
            "cached_bytes": sum(a.nbytes for _, a in self._slots.values()),
        }
        if self.remote is not None:
            info.update(self.remote.info())
        return info

    def close(self):
        for f in self._open.values():
            f.close()
        self._open.clear()
        self._slots.clear()
        if self._own_remote and self.remote is not None:
            self.remote.close()


def read_split(data_dir: str | Path, split: str, verify: str = "size") -> np.ndarray:
    """The whole token stream of a split (for small splits and tests), every chunk checked."""
    src = SplitSource(data_dir, split, verify=verify)
    try:
        return src.read_all()
    finally:
        src.close()


def load_vocab(data_dir: str | Path, remote_options: RemoteOptions | None = None) -> Vocab | SubwordTokenizer:
    """The directory's vocabulary (a `Vocab`), or its subword tokenizer (a `SubwordTokenizer`, kind "subword"),
    checked against the manifest's sha256 and size. A remote directory is read from its staged copy."""
    if is_remote(data_dir):  # the staged copy of a remote directory's manifest and vocabulary
        remote = RemoteShards(str(data_dir), remote_options)
        remote.close()
        return load_vocab(remote.meta_dir)
    m = load_manifest(data_dir)
    if m["vocab"]["kind"] == SUBWORD:
        where = str(Path(data_dir) / MANIFEST)
        try:
            return load_recorded(data_dir, m.get("tokenizer") or m["vocab"], where)
        except TokenizerError as e:
            raise ManifestError(str(e)) from None
    path = Path(data_dir) / m["vocab"]["file"]
    if "sha256" in m["vocab"] and file_sha256(path) != m["vocab"]["sha256"]:
        raise ManifestError(f"{path}: sha256 does not match manifest.json field vocab.sha256")
    v = Vocab.load(path, m["vocab"]["kind"])
    if len(v) != m["vocab"]["size"]:
        raise ManifestError(f"{path}: {len(v)} symbols, manifest.json field vocab.size says {m['vocab']['size']}")
    return v


# ================================================================================================ verify
def verify_shards(
    data_dir: str | Path, splits: list[str] | None = None, log: Callable[[str], None] = print
) -> list[str]:
    """Check every shard against the manifest: size, sha256, tar structure, each chunk's json member, zstd frame,
    token count and id range. Returns the list of problems (empty when all is well); logs progress."""
    root = Path(data_dir)
    try:
        m = load_manifest(root)
        vocab = load_vocab(root)
    except (ManifestError, OSError, ValueError) as err:
        return [str(err)]
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
            problem = _verify_shard(root, e, dtype, ct, len(vocab), log)
            if problem is not None:
                problems.append(problem)
        d = m["splits"][split].get("documents")
        if d is not None:
            listed.add(d["file"])
            try:
                path = root / d["file"]
                if not path.is_file():
                    raise ShardError(path, "missing (listed in manifest.json)")
                try:
                    n = parse_document_index(path.read_bytes(), d, m["splits"][split]["n_tokens"], path).size
                except DocumentIndexError as err:
                    raise ShardError(err.file, err.detail) from None
                log(f"ok   {d['file']}: {n:,} documents")
            except ShardError as err:
                problems.append(str(err))
                log(f"FAIL {err}")
    if splits is None:
        for p in sorted(root.glob("*.tar")):
            if p.name not in listed:
                log(f"note {p.name}: not listed in manifest.json (ignored by readers)")
    return problems


def _verify_shard(root: Path, e: dict, dtype, ct: int, n_vocab: int, log: Callable[[str], None]) -> str | None:
    """One listed shard read whole and checked (verify_shards) -> its problem, or None when it is sound."""
    t0 = time.time()
    f = None
    try:
        f = ShardFile(root / e["name"], e, dtype, ct, check_sha=True)
        for k in range(e["n_chunks"]):
            ids = f.read_chunk(k)
            if ids.size and int(ids.max()) >= n_vocab:
                raise ShardError(
                    f.path,
                    f"chunk at token offset {e['offset'] + k * ct}: token id "
                    f"{int(ids.max())} >= vocabulary size {n_vocab}",
                )
        _check_json_members(f)
        dt = time.time() - t0
        log(
            f"ok   {e['name']}: {e['n_tokens']:,} tokens, {e['n_chunks']} chunks, "
            f"{e['bytes'] / 2**20 / max(dt, 1e-9):.0f} MiB/s"
        )
        return None
    except ShardError as err:
        log(f"FAIL {err}")
        return str(err)
    finally:
        if f is not None:
            f.close()


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
