"""StreamReader: contiguous, rank-sharded, exactly resumable LM batches straight from token shards.

Layout (Transformer-XL ``LMOrderedIterator``, spec §4.1): the split's N tokens are cut into B columns of
n = N // B tokens (the N mod B tail is dropped); column b holds tokens b·n … (b+1)·n−1. Step k of an epoch
covers rows i = k·tgt_len … with ``seq_len = min(tgt_len, n−1−i)``: input = rows [i, i+seq_len),
target = rows [i+1, i+1+seq_len), so the last step of an epoch may be shorter. Rank r of W receives columns
[r·B/W, (r+1)·B/W): B/W streams of its own, each continuing exactly where its previous batch ended.

With ``roll=True`` every column is rotated at the start of each epoch by its own offset in [0, n), drawn from
``numpy.random.default_rng([seed, epoch])`` for all B columns (so ranks agree and the union of ranks is the
W=1 batch) — the LaMemo scripts' ``--roll``.

The position is just (epoch, step): everything else is a function of it, which makes resume exact.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np
import torch

from megamemo.util.errors import UsageError

from .remote import RemoteOptions, is_remote
from .shard_reader import SplitSource

_END = object()
STATE_VERSION = 1


def steps_per_epoch(n_tokens: int, batch_size: int, tgt_len: int) -> int:
    """Segments of one epoch: the split cut into `batch_size` columns of n_tokens // batch_size rows (the reference
    LMOrderedIterator's n_step), each row but the last an input whose target is the next row, in segments of
    tgt_len (the last one shorter)."""
    n_step = n_tokens // batch_size
    return (n_step - 1 + tgt_len - 1) // tgt_len


class StreamReader:
    """Iterate over ``(input, target)`` int64 tensors of shape [seq_len, batch_size // world_size].

    Args:
        data_dir: directory made by ``megamemo prepare`` (manifest.json + shards).
        split: "train", "valid", "test", ...
        batch_size: global batch B (columns over all ranks); must be divisible by world_size.
        tgt_len: rows per step (bptt).
        world_size, rank: data-parallel layout; this reader yields columns [rank·B/W, (rank+1)·B/W).
        roll: rotate each column by a seeded per-epoch offset (LaMemo ``--roll``).
        seed: seed of the roll offsets.
        epochs: how many epochs iteration runs through (counting from epoch 0; a resumed reader stops at the
            same place); None = forever (training).
        prefetch: blocks (``block_tokens`` tokens each) decoded ahead by a background thread (0 = none).
        verify: "size" (default: size, tar structure, zstd checksum and token count of everything read) or
            "sha256" (also hash each shard the first time it is opened).
        block_tokens: tokens decoded per refill of the column buffer (memory/throughput knob).
        remote_options: for an s3:// gs:// https:// data_dir: cache directory and size, retries, read-ahead
            threads (megamemo.data.remote.RemoteOptions).
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        batch_size: int,
        tgt_len: int,
        world_size: int = 1,
        rank: int = 0,
        *,
        roll: bool = False,
        seed: int = 0,
        epochs: int | None = 1,
        prefetch: int = 0,
        verify: str = "size",
        block_tokens: int = 1 << 20,
        max_open_shards: int | None = None,
        remote_options: RemoteOptions | None = None,
    ):
        if batch_size < 1 or tgt_len < 1:
            raise UsageError(f"batch_size ({batch_size}) and tgt_len ({tgt_len}) must be positive")
        if world_size < 1 or batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be positive or None, got {epochs}")
        self.data_dir = str(data_dir).rstrip("/") if is_remote(data_dir) else Path(data_dir)
        self.split = split
        self.batch_size, self.tgt_len, self.world_size, self.rank = batch_size, tgt_len, world_size, rank
        self.roll, self.seed, self.epochs, self.prefetch = bool(roll), int(seed), epochs, int(prefetch)
        self.local_batch = batch_size // world_size
        self.col0 = rank * self.local_batch
        self.source = SplitSource(
            self.data_dir,
            split,
            verify=verify,
            remote_options=remote_options,
            max_open=max_open_shards or min(self.local_batch + 2, 256),
        )
        self.manifest = self.source.manifest
        self.n_tokens = self.source.n_tokens
        self.n_step = self.n_tokens // batch_size  # rows per column (LMOrderedIterator.n_step)
        if self.n_step < 2:
            raise UsageError(
                f"split {split!r} of {self.data_dir} has {self.n_tokens} tokens: too few for "
                f"{batch_size} columns of at least 2 tokens"
            )
        self.steps_per_epoch = steps_per_epoch(self.n_tokens, batch_size, tgt_len)
        rows = max(1, block_tokens // self.local_batch) // tgt_len * tgt_len
        self.block_rows = max(tgt_len, rows)
        self.vocab_sha256 = self.manifest["vocab"].get("sha256", "")
        self.epoch, self.step = 0, 0  # position of the next batch to yield
        self._buf = np.empty((self.local_batch, self.block_rows + 1), dtype=self.source.dtype)
        self._block: tuple[int, int, int] | None = None  # (epoch, first row, end row) held in _buf
        self._shifts: tuple[int, np.ndarray] | None = None
        self._gen = 0
        self._producer: tuple[threading.Thread, threading.Event] | None = None

    # ---- sizes ------------------------------------------------------------------------------------------
    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens this rank yields per epoch."""
        return (self.n_step - 1) * self.local_batch

    def seq_len(self, step: int) -> int:
        return min(self.tgt_len, self.n_step - 1 - step * self.tgt_len)

    # ---- roll -------------------------------------------------------------------------------------------
    def roll_shifts(self, epoch: int) -> np.ndarray:
        """Offsets of all B columns in this epoch (zeros without roll)."""
        if not self.roll:
            return np.zeros(self.batch_size, dtype=np.int64)
        if self._shifts is None or self._shifts[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._shifts = (epoch, rng.integers(0, self.n_step, size=self.batch_size, dtype=np.int64))
        return self._shifts[1]

    # ---- random access ----------------------------------------------------------------------------------
    def _fill(self, buf: np.ndarray, epoch: int, r0: int) -> tuple[int, int, int]:
        """Decode rows [r0, r1) of every local column into buf[:, :r1-r0]; returns the block (epoch, r0, r1)."""
        r1 = min(r0 + self.block_rows + 1, self.n_step)
        m, n = r1 - r0, self.n_step
        shifts = self.roll_shifts(epoch)
        if self.source.remote is not None:  # read-ahead: the shards this block and the next one start in
            for j in range(self.local_batch):
                c = self.col0 + j
                for r in (r0, r1):
                    self.source.prefetch_at(c * n + (r + int(shifts[c])) % n)
        for j in range(self.local_batch):
            c = self.col0 + j
            base = c * n
            q0 = (r0 + int(shifts[c])) % n
            first = min(m, n - q0)
            row = buf[j]
            self.source.read(base + q0, base + q0 + first, row[:first], slot=j)
            if first < m:  # the rotated column wraps to its start
                self.source.read(base, base + m - first, row[first:m], slot=j)
        return epoch, r0, r1

    def _slice(self, buf: np.ndarray, r0: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = step * self.tgt_len
        m = self.seq_len(step) + 1
        out = np.empty((m, self.local_batch), dtype=np.int64)
        out[...] = buf[:, i - r0 : i - r0 + m].T
        t = torch.from_numpy(out)
        return t[:-1], t[1:]

    def _in_block(self, block, epoch: int, step: int) -> bool:
        i = step * self.tgt_len
        return block is not None and block[0] == epoch and block[1] <= i and i + self.seq_len(step) + 1 <= block[2]

    def get_batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at (epoch, step) without moving the reader's position."""
        if not 0 <= step < self.steps_per_epoch or epoch < 0:
            raise IndexError(f"step {step} of epoch {epoch} is outside [0, {self.steps_per_epoch})")
        block = self._block
        if block is None or not self._in_block(block, epoch, step):
            block = self._block = self._fill(self._buf, epoch, step * self.tgt_len)
        return self._slice(self._buf, block[1], step)

    # ---- iteration --------------------------------------------------------------------------------------
    def _next_pos(self, epoch: int, step: int) -> tuple[int, int]:
        return (epoch + 1, 0) if step + 1 >= self.steps_per_epoch else (epoch, step + 1)

    def _positions(self, epoch: int, step: int):
        while self.epochs is None or epoch < self.epochs:
            yield epoch, step
            epoch, step = self._next_pos(epoch, step)

    def _block_starts(self, epoch: int, step: int):
        """(epoch, first row) of the blocks a sequential iteration from (epoch, step) decodes, in order."""
        r0 = step * self.tgt_len
        while self.epochs is None or epoch < self.epochs:
            yield epoch, r0
            r0 += self.block_rows  # a multiple of tgt_len: every step lies inside one block
            if r0 >= self.n_step - 1:
                epoch, r0 = epoch + 1, 0

    def __iter__(self):
        self._stop_producer()
        self._gen += 1
        return self._iter_prefetch(self._gen) if self.prefetch > 0 else self._iter_plain(self._gen)

    def _stale(self, gen: int) -> None:
        if gen != self._gen:
            raise RuntimeError(
                "StreamReader: the reader was re-iterated or its state reloaded while this "
                "iteration was running; start a new `for batch in reader` loop"
            )

    def _iter_plain(self, gen: int):
        for e, k in self._positions(self.epoch, self.step):
            self._stale(gen)
            inp, tgt = self.get_batch(e, k)
            self.epoch, self.step = self._next_pos(e, k)
            yield inp, tgt

    def _iter_prefetch(self, gen: int):
        """A background thread decodes whole blocks (up to `prefetch` ahead) into buffers of their own; this
        thread only slices them, so the two share nothing but the queue."""
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        start = (self.epoch, self.step)

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def produce():
            try:
                for e, r0 in self._block_starts(*start):
                    buf = np.empty_like(self._buf)
                    if stop.is_set() or not put((self._fill(buf, e, r0), buf)):
                        return
                put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                put(exc)

        t = threading.Thread(target=produce, name=f"StreamReader-{self.split}-r{self.rank}", daemon=True)
        self._producer = (t, stop)
        t.start()
        block = buf = None
        try:
            for e, k in self._positions(*start):
                while not self._in_block(block, e, k):
                    item = q.get()
                    self._stale(gen)
                    if item is _END:
                        raise RuntimeError("StreamReader: prefetch ended before the iteration did")
                    if isinstance(item, BaseException):
                        raise item
                    block, buf = item
                assert block is not None and buf is not None  # the while ran until a block came
                self._stale(gen)
                inp, tgt = self._slice(buf, block[1], k)
                self.epoch, self.step = self._next_pos(e, k)
                yield inp, tgt
        finally:
            stop.set()
            if threading.current_thread() is not t:
                t.join()
            if self._producer is not None and self._producer[0] is t:
                self._producer = None

    def _stop_producer(self) -> None:
        if self._producer is not None:
            t, stop = self._producer
            stop.set()
            t.join()
            self._producer = None

    # ---- state ------------------------------------------------------------------------------------------
    _IDENTITY = ("split", "batch_size", "tgt_len", "roll", "n_tokens", "vocab_sha256")

    def state_dict(self) -> dict:
        """Position of the next batch plus what must match on resume. (epoch, step) is global: it may be loaded
        into a reader with another world_size/rank (same batch_size), which then yields its own columns."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "split": self.split,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "roll": self.roll,
            "seed": self.seed,
            "n_tokens": self.n_tokens,
            "vocab_sha256": self.vocab_sha256,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"StreamReader.load_state_dict: state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        keys = self._IDENTITY + (("seed",) if self.roll else ())
        mine = self.state_dict()
        if state.get("vocab_sha256") not in (None, mine["vocab_sha256"]):  # before n_tokens: say why they differ
            raise ValueError(
                f"{self.data_dir}: its vocabulary/tokenizer file (sha256 {mine['vocab_sha256'][:12]})"
                f" differs from the one the checkpoint was trained with (sha256 "
                f"{str(state['vocab_sha256'])[:12]}): a different tokenizer"
            )
        for k in keys:
            if k not in state:
                raise ValueError(f"StreamReader.load_state_dict: field {k!r} is missing from the saved state")
            if state[k] != mine[k]:
                raise ValueError(
                    f"StreamReader.load_state_dict: field {k!r} is {state[k]!r} in the saved state "
                    f"but {mine[k]!r} in this reader"
                )
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step <= self.steps_per_epoch:
            raise ValueError(
                f"StreamReader.load_state_dict: position (epoch {epoch}, step {step}) is outside "
                f"an epoch of {self.steps_per_epoch} steps"
            )
        if step == self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._stop_producer()
        self._gen += 1  # an iteration running from the old position must not continue
        self.epoch, self.step = epoch, step

    # ---- housekeeping -----------------------------------------------------------------------------------
    def cache_info(self) -> dict:
        info = self.source.cache_info()
        info["block_bytes"] = self._buf.nbytes
        return info

    def close(self) -> None:
        self._stop_producer()
        self._gen += 1
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (
            f"StreamReader({str(self.data_dir)!r}, split={self.split!r}, batch_size={self.batch_size}, "
            f"tgt_len={self.tgt_len}, world_size={self.world_size}, rank={self.rank}, roll={self.roll}, "
            f"epoch={self.epoch}, step={self.step}/{self.steps_per_epoch})"
        )
