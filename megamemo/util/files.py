"""Files and directories that are either whole or absent, and their sha256: the one atomic write of a file and of
a directory, the one digest of bytes, of a file and of a stream, and the one check of a file against the size and
sha256 a manifest records.

A write goes to a temporary file beside the target (a unique name, so concurrent writers never share one), is
flushed to disk with fsync when `durable` (checkpoints, manifests: what a crash must not leave half-written under
its final name), then renamed over the target; on any error the temporary file is removed and the target is as
it was. `fsync_dir` makes a rename itself durable (the directory entry). `write_atomic` fills the file in one
call; `AtomicFile` is the same for a file written over time (a shard, a download): `commit()` or `abort()`.
`atomic_directory` is the same for a directory (a single-device checkpoint, an export): filled under a temporary
name beside it, renamed into place when complete, removed on any error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BLOCK = 1 << 22


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename or a new file in it); a file system that refuses is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_beside(path: Path) -> Path:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    return Path(name)


def _put_in_place(tmp: Path, path: Path, durable: bool) -> None:
    if durable:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: Path, write: Callable[[Path], object], *, durable: bool = True) -> None:
    """write(tmp) fills a temporary file beside `path`, which then replaces `path` in one rename."""
    path = Path(path)
    tmp = _temp_beside(path)
    try:
        write(tmp)
        _put_in_place(tmp, path, durable)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class AtomicFile:
    """A file written over time under a temporary name beside `path` (`.file`, binary): `commit()` gives it its
    name in one rename, `abort()` (or any error inside a `with` block) deletes it; `path` is untouched until then."""

    def __init__(self, path: Path, *, durable: bool = True):
        self.path, self.durable = Path(path), durable
        self.tmp = _temp_beside(self.path)
        self.file = open(self.tmp, "wb")

    def commit(self) -> None:
        try:
            self.file.close()
            _put_in_place(self.tmp, self.path, self.durable)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    write_atomic(path, lambda p: p.write_bytes(data), durable=durable)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    write_atomic(path, lambda p: p.write_text(text), durable=durable)


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True, indent: int = 1, sort_keys: bool = True) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys), durable=durable)


@contextlib.contextmanager
def atomic_directory(path: Path, *, replace: bool = False) -> Iterator[Path]:
    """A directory that appears whole or not at all. Yields a new, empty directory beside `path` under a temporary
    name (hidden, unique) to fill; when the block ends, it takes `path`'s name in one rename. With `replace` an
    existing `path` is moved aside only then, and deleted once the new one is in place. On any error - in the block
    or in the renames - the temporary directory is deleted and `path` is as it was. An existing `path` without
    `replace` is a FileExistsError before anything is made."""
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"{path}: already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_beside(path, "partial")
    tmp.mkdir()
    old = None
    try:
        yield tmp
        if path.exists():
            old = _unique_beside(path, "old")
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                old = None
                raise
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _unique_beside(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.{suffix}")


def save_tensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' save_file, but the file gets the mode any new file gets here (0666 less the umask, as the
    config.json beside it): save_file writes 0600, which colleagues on a shared file system cannot read."""
    from safetensors.torch import save_file  # brings torch: util/files serves torch-free callers (the CLI, plan)

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    probe = _unique_beside(path, "mode")
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()
    os.chmod(path, mode)


def bytes_sha256(data: bytes) -> str:
    """sha256 of bytes in memory, hex."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file, hex (about 0.9 GB/s on one core here, as fast as zlib's crc32: bench/checkpoint_io.py)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fd_sha256(fd: int) -> str:
    """sha256 of an open file descriptor's whole content, read with pread (the descriptor's offset is untouched)."""
    h, pos = hashlib.sha256(), 0
    while block := os.pread(fd, BLOCK, pos):
        h.update(block)
        pos += len(block)
    return h.hexdigest()


class HashingWriter:
    """A stream's sha256 and byte count as it goes by: write(b) passes b on to `file` (if any) and hashes it, so a
    file written or fetched is never read back to hash it. `n` bytes so far; hexdigest() their sha256."""

    def __init__(self, file=None):
        self.file, self.n, self._sha = file, 0, hashlib.sha256()

    def write(self, data) -> int:
        if self.file is not None:
            self.file.write(data)
        self._sha.update(data)
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def entry_mismatch(
    entry: dict, size: int, sha256: Callable[[], str] | None = None, *, recorded: str, what: str = "the file"
) -> str | None:
    """What differs between a file and the manifest entry that records it ({"bytes": N, "sha256": hex}; either may
    be absent, and is then not checked), in one line, or None when nothing does. The size comes first (cheap);
    `sha256()` (the file's digest, computed on demand; None: not checked here) only once the size agrees.
    `recorded`: where the entry is (named in the line), `what`: what the file is.
        {what} is 100 bytes, {recorded} says 108 (truncated?)
        sha256 differs: {digest} does not match {recorded} ({the recorded digest})"""
    expected = entry.get("bytes")
    if expected is not None and size != expected:
        return f"{what} is {size} bytes, {recorded} says {expected}" + (" (truncated?)" if size < expected else "")
    if sha256 is not None and entry.get("sha256") is not None:
        digest = sha256()
        if digest != entry["sha256"]:
            return f"sha256 differs: {digest} does not match {recorded} ({entry['sha256']})"
    return None
