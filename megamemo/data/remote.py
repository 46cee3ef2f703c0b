"""Shard directories on object storage (s3://, gs://, https://) through fsspec, read from a verified node-local
cache.

Design: every shard is fetched WHOLE into ``cache_dir`` (one streaming GET per shard, hashed while it is written
to a temporary file; used only after its sha256 equals the manifest's, then renamed into place atomically), and
the reader then reads it exactly like a local shard. Cached files are named by their sha256, so two corpora
never collide; a process hashes each cached file again the first time it uses it (a file damaged in place
keeps its size: it is fetched again, with a line saying so), then trusts it; the cache is shared by the ranks of
a node (a lock file per shard: one download, the others wait) and kept under ``cache_bytes`` by evicting the
least recently used files (mtime = last use). Why not range reads: the manifest's sha256 covers whole shards, so
a range read could not be verified before use; the B columns of a batch read B far-apart places of the split,
which as range requests would be B small latency-bound GETs per step instead of one large GET per shard; and a
cache serves every later epoch and every rank of the node from local disk.

Read-ahead: ``prefetch(i)`` queues shard i on a small thread pool; the reader asks for the next shard of every
column as soon as it opens one (SplitSource) and for the shards its next block needs (StreamReader), so in
steady state a shard is local before the column reaches it.

Faults: a missing, truncated or mismatching object is a ShardError naming the object (and the reader adds the
chunk); any other error of the storage library (connection reset, 5xx, throttling, timeouts) is retried
``retries`` times with exponential backoff, one log line each, and then is a ``StoreUnavailableError``.
The libraries' own retries are switched off where they can be (s3fs/botocore) so that this is the one retry
policy. Credentials come only from each library's standard environment and configuration files: a URL with
``user:password@`` is refused, and nothing here writes them anywhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from megamemo.util.files import (
    HashingWriter,
    bytes_sha256,
    entry_mismatch,
    file_sha256,
    write_atomic,
    write_bytes_atomic,
)

from .shards import MANIFEST, ManifestError, ShardError, _parse_size, load_manifest

SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "https": None, "http": None}  # scheme -> pip extra


class StoreUnavailableError(ShardError):
    """The object store did not answer after every retry."""

    def __init__(self, shard, message: str, offset: int | None = None):
        super().__init__(shard, message, offset)
        self.args = (f"object store unavailable: {shard}: {message}",)


# manifests staged by this process, by URL: a process reads one manifest per directory for its whole life (the
# trainer's readers, the checkpoint probe's and the evaluator's agree, and a save needs no request to the store)
_STAGED: dict[str, dict] = {}
_LISTED: dict[str, dict] = {}  # URL -> {object name: size} of its one listing
# cached files this process has hashed (or downloaded and hashed as they streamed): trusted from then on
_VERIFIED: set[str] = set()


def is_remote(data_dir) -> bool:
    return isinstance(data_dir, str) and urlsplit(data_dir).scheme in SCHEMES and "://" in data_dir


def manifest_of(data_dir, options: RemoteOptions | None = None) -> dict:
    """The checked manifest of a local directory or of an s3:// gs:// https:// one (staged through the cache like
    the reader's: read once per process)."""
    if not is_remote(data_dir):
        return load_manifest(data_dir)
    remote = RemoteShards(str(data_dir), options)
    remote.close()
    return remote.manifest


def default_cache_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megamemo" / "shards")


@dataclass
class RemoteOptions:
    """How a remote shard directory is read (data.cache_dir, data.cache_size, data.retries, ...)."""

    cache_dir: str = ""  # "" -> $XDG_CACHE_HOME/megamemo/shards (~/.cache/...)
    cache_size: str | int = "50G"  # size limit of the cache directory; least recently used shards are evicted
    retries: int = 5  # retries of a transient error (then StoreUnavailableError)
    retry_backoff_s: float = 1.0  # first wait; doubled after each retry, at most 30 s
    fetch_threads: int = 4  # concurrent shard downloads of the read-ahead
    log: Callable[[str], None] = print


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _permanent(e: BaseException) -> bool:
    """Errors that retrying cannot cure: a missing object, refused access, a damaged shard, a bug."""
    return isinstance(
        e,
        (
            FileNotFoundError,
            PermissionError,
            ShardError,
            ManifestError,
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            MemoryError,
        ),
    )


class Retry:
    def __init__(self, tries: int, backoff_s: float, log: Callable[[str], None]):
        self.retries, self.backoff_s, self.log = max(0, tries), max(0.0, backoff_s), log

    def __call__(self, what: str, fn):
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # classified below: permanent ones are raised as they are
                if _permanent(e):
                    raise
                if attempt == self.retries:
                    raise StoreUnavailableError(
                        what, f"the store did not answer after {self.retries + 1} tries (last: {_one_line(e)})"
                    ) from None
                self.log(f"[data] {what}: {_one_line(e)}; retry {attempt + 1}/{self.retries} in {wait:.1f}s")
                time.sleep(wait)
                wait = min(2 * wait, 30.0)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _filesystem(url: str):
    scheme = urlsplit(url).scheme
    parts = urlsplit(url)
    if parts.username or parts.password or parts.query:
        raise ManifestError(
            f"{parts.scheme}://{parts.hostname}{parts.path}: credentials in the URL (user:password@ "
            f"or a signed query string) are not accepted; they come from the storage library's "
            f"standard environment/config"
        )
    try:
        import fsspec  # optional (the s3 / gcs extras), only for remote shard directories

        opts = {}
        if scheme == "s3":  # one retry policy (ours, logged): botocore's and s3fs's own retries off
            opts = {
                "config_kwargs": {
                    "retries": {"max_attempts": 1, "mode": "standard"},
                    "connect_timeout": 10,
                    "read_timeout": 60,
                },
                "skip_instance_cache": True,
            }
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        extra = SCHEMES.get(scheme)
        hint = f"pip install 'megamemo[{extra}]'" if extra else "pip install fsspec aiohttp"
        raise ManifestError(f"{url}: reading {scheme}:// needs a library that is not installed ({e}); {hint}") from None
    if scheme == "s3":
        fs.retries = 1
    return fs, root.rstrip("/")


class RemoteShards:
    """A remote shard directory: its manifest and vocabulary staged locally, shards fetched into the cache."""

    def __init__(self, url: str, options: RemoteOptions | None = None):
        self.opts = options or RemoteOptions()
        self.url = url.rstrip("/")
        self.fs, self.root = _filesystem(self.url)
        self.retry = Retry(self.opts.retries, self.opts.retry_backoff_s, self.opts.log)
        cache = Path(self.opts.cache_dir or default_cache_dir())
        self.shard_dir = cache / "sha256"
        self.meta_dir = cache / "meta" / bytes_sha256(self.url.encode())[:16]
        try:
            self.shard_dir.mkdir(parents=True, exist_ok=True)
            self.meta_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ManifestError(f"data.cache_dir: cannot create {cache}: {e.strerror}") from None
        self.limit = _parse_size(self.opts.cache_size)
        staged = _STAGED.get(self.url)
        if staged is None or not (self.meta_dir / staged["vocab"]["file"]).is_file():
            staged = _STAGED[self.url] = self._stage_meta()
        self.manifest = staged
        self._pool = ThreadPoolExecutor(max(1, self.opts.fetch_threads), thread_name_prefix="shard-fetch")
        self._pending: dict[str, Future] = {}
        self._mutex = threading.Lock()
        self.fetched_bytes = 0
        self.wait_s = 0.0  # time the reader waited for shards (read-ahead not far enough ahead)
        self._over_limit_said = False

    # ---- names ------------------------------------------------------------------------------------------
    def object_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if urlsplit(self.url).scheme not in ("http", "https") else self.object_url(name)

    def cached_path(self, entry: dict) -> Path:
        """Named by content: <sha256>.tar for a shard (<sha256>.bin for a document index)."""
        return self.shard_dir / f"{entry['sha256']}{Path(entry['name']).suffix}"

    # ---- manifest and vocabulary --------------------------------------------------------------------------
    def _stage_meta(self) -> dict:
        """manifest.json (always fetched anew) and the vocabulary file into meta_dir, checked as local ones."""
        man = self.object_url(MANIFEST)
        try:
            data = self.retry(man, lambda: self.fs.cat_file(self._path(MANIFEST)))
        except FileNotFoundError:
            raise ManifestError(
                f"{man}: not found (is {self.url} a directory made by `megamemo prepare` and uploaded whole?)"
            ) from None
        except PermissionError as e:
            raise ManifestError(
                f"{man}: access denied ({_one_line(e)}); credentials come from the storage "
                f"library's standard environment/config"
            ) from None
        write_bytes_atomic(self.meta_dir / MANIFEST, data, durable=False)
        try:
            m = load_manifest(self.meta_dir)
            vocab = m["vocab"]["file"]
            if "/" in vocab or vocab.startswith("."):
                raise ManifestError(f"{self.meta_dir / MANIFEST}: field vocab.file {vocab!r} is not a plain name")
        except ManifestError as e:
            raise ManifestError(str(e).replace(str(self.meta_dir), self.url)) from None
        try:
            vdata = self.retry(self.object_url(vocab), lambda: self.fs.cat_file(self._path(vocab)))
        except FileNotFoundError:
            raise ManifestError(f"{self.object_url(vocab)}: missing (listed in manifest.json as vocab.file)") from None
        sha = m["vocab"].get("sha256")
        if sha and bytes_sha256(vdata) != sha:
            raise ManifestError(f"{self.object_url(vocab)}: sha256 does not match manifest.json field vocab.sha256")
        write_bytes_atomic(self.meta_dir / vocab, vdata, durable=False)
        return m

    def check_listing(self, entries: list[dict]) -> None:
        """One listing of the directory: every shard present at its manifest size (not for http)."""
        if urlsplit(self.url).scheme in ("http", "https"):
            return
        sizes = _LISTED.get(self.url)
        if sizes is None:
            listing = self.retry(self.url, lambda: self.fs.ls(self.root, detail=True))
            sizes = _LISTED[self.url] = {Path(x["name"]).name: x.get("size") for x in listing}
        for e in entries:
            url = self.object_url(e["name"])
            if e["name"] not in sizes:
                raise ShardError(url, "missing (listed in manifest.json)")
            if sizes[e["name"]] is not None and sizes[e["name"]] != e["bytes"]:
                raise ShardError(
                    url,
                    f"the object is {sizes[e['name']]} bytes, manifest.json says {e['bytes']}"
                    + (" (truncated?)" if sizes[e["name"]] < e["bytes"] else ""),
                )

    # ---- shards -----------------------------------------------------------------------------------------
    def prefetch(self, entry: dict) -> None:
        """Start fetching a shard in the background unless it is cached or on its way."""
        key = entry["sha256"]
        with self._mutex:
            if key in self._pending or self._cached(entry):
                return
            self._pending[key] = self._pool.submit(self._fetch, entry)

    def open(self, entry: dict, where: str) -> int:
        """A read-only fd of the verified local copy (fetched now, or waited for if on its way). A file that
        is open stays readable even if another process evicts it."""
        key = entry["sha256"]
        with self._mutex:
            fut = self._pending.pop(key, None)
        t0 = time.perf_counter()
        try:
            if fut is not None:
                fut.result()
            path = self._fetch(entry)
            fd = os.open(path, os.O_RDONLY)
        except ShardError as e:
            raise type(e)(e.shard, f"{where}: {e.detail}", e.offset) from None
        except FileNotFoundError:  # evicted by another process between fetch and open: once more
            fd = os.open(self._fetch(entry), os.O_RDONLY)
        finally:
            self.wait_s += time.perf_counter() - t0
        return fd

    def _cached(self, entry: dict) -> bool:
        try:
            return self.cached_path(entry).stat().st_size == entry["bytes"]
        except FileNotFoundError:
            return False

    def _fetch(self, entry: dict) -> Path:
        dst = self.cached_path(entry)
        url = self.object_url(entry["name"])
        with _locked(self.shard_dir / f".{entry['sha256']}.lock"):
            if self._cached(entry):
                if str(dst) in _VERIFIED or file_sha256(dst) == entry["sha256"]:
                    _VERIFIED.add(str(dst))
                    os.utime(dst)  # least recently used = oldest mtime
                    return dst
                self.opts.log(
                    f"[data] cache {dst}: its sha256 does not match {url}'s in manifest.json (damaged "
                    f"in place); fetching it again"
                )
                dst.unlink()
            self.retry(url, lambda: self._download(entry, url, dst))
            _VERIFIED.add(str(dst))
        self._evict(keep=dst)
        return dst

    def _download(self, entry: dict, url: str, dst: Path) -> None:
        """Fetch one shard into a temporary file beside `dst`, checked against its size and sha256 as it streams:
        only a verified shard gets its name (util.files.write_atomic; not fsync'd: a cache refetches)."""
        fetched = {}

        def fetch(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                try:
                    src = self.fs.open(self._path(entry["name"]), "rb", block_size=8 << 20, cache_type="none")
                except FileNotFoundError:
                    raise ShardError(url, "missing (listed in manifest.json)") from None
                got = HashingWriter(out)
                with src:
                    while block := src.read(8 << 20):
                        got.write(block)
                        if got.n > entry["bytes"]:
                            raise ShardError(url, f"the object is larger than manifest.json's {entry['bytes']} bytes")
            problem = entry_mismatch(entry, got.n, got.hexdigest, recorded="manifest.json", what="the object")
            if problem:
                raise ShardError(url, problem)
            fetched["bytes"] = got.n

        write_atomic(dst, fetch, durable=False)
        self.fetched_bytes += fetched["bytes"]

    def _evict(self, keep: Path) -> None:
        """Delete least recently used shards until the cache fits its limit (never one queued for reading)."""
        with self._mutex:
            pinned = set(self._pending) | {keep.name.split(".")[0]}
        files = []
        for d in os.scandir(self.shard_dir):
            if not d.name.startswith("."):  # not a lock file or a download in progress
                with contextlib.suppress(FileNotFoundError):
                    st = d.stat()
                    files.append((st.st_mtime, st.st_size, d.name))
        total = sum(f[1] for f in files)
        for _, size, name in sorted(files):
            if total <= self.limit:
                return
            if name.split(".")[0] not in pinned:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.shard_dir / name)
                total -= size
        if total > self.limit and not self._over_limit_said:
            self._over_limit_said = True
            self.opts.log(
                f"[data] cache {self.shard_dir}: {_size(total)} in use by shards being read, over "
                f"data.cache_size ({_size(self.limit)}); raise it to at least two shards per column"
            )

    def info(self) -> dict:
        return {"fetched_bytes": self.fetched_bytes, "wait_s": self.wait_s}

    def close(self) -> None:
        with self._mutex:
            pending = list(self._pending.values())
            self._pending.clear()
        for f in pending:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
