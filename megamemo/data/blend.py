"""BlendReader: batches whose columns draw whole units from several shard directories by weight.

Every column c of the global batch is an endless stream of units. A unit is a document where the split has a
document index (megamemo/data/doc_index.py: `megamemo prepare` writes one for corpora of documents), and otherwise
one chunk (the manifest's ``chunk_tokens`` tokens: flat corpora, and directories prepared before indexes existed),
so the memory stream of a column is contiguous within a unit. Unit j of column c comes from source s drawn by
``numpy.random.default_rng([seed, c, j // 256])`` (256 draws at a time) and is the next unit of that source for
this column: column c walks each source from its own seeded start, wrapping at the end.

Weights are shares of TOKENS: units differ in length (documents of one source, and from source to source), so
source s is drawn with probability proportional to weight_s / mean unit length_s (its tokens / its units): every
draw then brings, in expectation, tokens in proportion to the weights, and the realized mix converges to them.

The schedule is a pure function of (seed, column, unit), and the position is a single step counter: resume is
exact, on any number of ranks (a rank builds only its own columns' schedules). A column's schedule keeps, per 256
draws, only the tokens and units taken from each source so far (the draws themselves for the few latest blocks),
so its memory grows by a few dozen bytes per 256 units. Sources must share one tokenizer (the vocabulary's kind,
size and sha256, and the tokenizer's kind and sha256 where recorded), else BlendError. The realized token mix
(over all B columns, so every rank computes the same numbers) is logged every ``mix_every`` steps by rank 0 and
returned by ``token_mix()``.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from megamemo.util.errors import MegamemoError

from .remote import RemoteOptions
from .shard_reader import SplitSource

STATE_VERSION = 2  # 2: units are documents where indexed; draws weighted by tokens
DRAWS = 256  # units drawn per generator (a column's schedule grows by this many at a time)
ENDLESS = 1 << 62  # steps_per_epoch of a blend: one endless epoch
KEEP_BLOCKS = 4  # blocks of draws kept per column (older ones are drawn again when asked for)


class BlendError(MegamemoError, ValueError):
    """Sources that cannot be blended (another tokenizer, a bad weight); the message names the source."""


def tokenizer_identity(manifest: dict) -> dict:
    v, t = manifest["vocab"], manifest.get("tokenizer") or {}
    return {
        "vocab.kind": v.get("kind"),
        "vocab.size": v.get("size"),
        "vocab.sha256": v.get("sha256"),
        "tokenizer.kind": t.get("kind"),
        "tokenizer.sha256": t.get("sha256"),
    }


class Units:
    """A source's units: its documents (from the document index) or, without one, its chunks."""

    def __init__(self, src: SplitSource):
        self.n_tokens, self.chunk_tokens = src.n_tokens, src.chunk_tokens
        self.starts = src.document_starts()
        self.kind = "chunks" if self.starts is None else "documents"
        self.n = -(-self.n_tokens // self.chunk_tokens) if self.starts is None else int(self.starts.size)
        self.mean_tokens = self.n_tokens / self.n

    def start(self, u):
        """First token (in the source's split) of unit(s) u."""
        return u * self.chunk_tokens if self.starts is None else self.starts[u]

    def length(self, u: np.ndarray) -> np.ndarray:
        nxt = u + 1
        ends = np.where(nxt < self.n, self.start(np.minimum(nxt, self.n - 1)), self.n_tokens)
        return ends - self.start(u)


class _Schedule:
    """One column's units. Block b holds draws b·256 ... b·256+255; per block the column keeps where it starts
    (token), and the units and tokens taken from each source before it; the draws of the latest blocks are kept."""

    def __init__(self, column: int, seed: int, probs: np.ndarray, units: list[Units]):
        self.column, self.seed, self.probs, self.units = column, seed, probs, units
        n = len(units)
        self.first = np.array(
            [np.random.default_rng([seed, 7919, column, s]).integers(u.n) for s, u in enumerate(units)], dtype=np.int64
        )
        self.block_start = [0]  # first token of block b; [-1]: the next block's
        self.used_before = [np.zeros(n, dtype=np.int64)]  # units of each source drawn before block b
        self.tokens_before = [np.zeros(n, dtype=np.int64)]  # tokens of each source before block b
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self.current: tuple[int, int, int, int] | None = None  # the unit last read: source, offset, first, end

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, unit, first token in the column) of the draws of block b; starts has one more entry: the end."""
        got = self._blocks.get(b)
        if got is not None:
            self._blocks.move_to_end(b)
            return got
        while len(self.block_start) <= b:  # blocks before b first (their counts)
            self.block(len(self.block_start) - 1)
        src = np.random.default_rng([self.seed, self.column, b]).choice(len(self.probs), size=DRAWS, p=self.probs)
        unit, lens = np.empty(DRAWS, dtype=np.int64), np.empty(DRAWS, dtype=np.int64)
        for s, units in enumerate(self.units):
            sel = np.flatnonzero(src == s)
            u = (self.first[s] + self.used_before[b][s] + np.arange(sel.size)) % units.n
            unit[sel], lens[sel] = u, units.length(u)
        starts = self.block_start[b] + np.concatenate(([0], np.cumsum(lens)))
        if b + 1 == len(self.block_start):
            n = len(self.units)
            self.used_before.append(self.used_before[b] + np.bincount(src, minlength=n))
            tokens = np.bincount(src, weights=lens, minlength=n).astype(np.int64)
            self.tokens_before.append(self.tokens_before[b] + tokens)
            self.block_start.append(int(starts[-1]))
        got = self._blocks[b] = (src, unit, starts)
        while len(self._blocks) > KEEP_BLOCKS:
            self._blocks.popitem(last=False)
        return got

    def find(self, token: int) -> int:
        """Index of the unit holding the column's token `token`."""
        while self.block_start[-1] <= token:
            self.block(len(self.block_start) - 1)
        b = bisect.bisect_right(self.block_start, token) - 1
        return b * DRAWS + int(np.searchsorted(self.block(b)[2], token, side="right")) - 1

    def entry(self, j: int) -> tuple[int, int, int, int]:
        """Unit j of the column: (source, unit of that source, first token in the column, end token)."""
        b, i = divmod(j, DRAWS)
        src, unit, starts = self.block(b)
        return int(src[i]), int(unit[i]), int(starts[i]), int(starts[i + 1])

    def tokens_by_source(self, stop: int) -> np.ndarray:
        """Tokens [0, stop) of this column, counted per source."""
        if stop <= 0:
            return np.zeros(len(self.units), dtype=np.int64)
        b, i = divmod(self.find(stop - 1), DRAWS)
        src, _, starts = self.block(b)
        out = self.tokens_before[b].copy()
        np.add.at(out, src[:i], np.diff(starts[: i + 1]))
        out[src[i]] += stop - starts[i]
        return out


class BlendReader:
    """Iterate over ``(input, target)`` int64 tensors [tgt_len, batch_size // world_size] drawn from a blend.

    Args:
        sources: [(dir or URL, weight), ...]; weights are normalised.
        split, batch_size, tgt_len, world_size, rank: as StreamReader.
        seed: seed of the schedule.
        mix_every: rank 0 logs the realized token mix every this many steps (0: never).
        remote_options: for s3:// gs:// https:// sources (megamemo.data.remote.RemoteOptions).
    """

    def __init__(
        self,
        sources: list[tuple[str | Path, float]],
        split: str,
        batch_size: int,
        tgt_len: int,
        world_size: int = 1,
        rank: int = 0,
        *,
        seed: int = 0,
        mix_every: int = 0,
        log=print,
        remote_options: RemoteOptions | None = None,
    ):
        if not sources:
            raise BlendError("a blend needs at least one source")
        if batch_size < 1 or tgt_len < 1 or world_size < 1 or batch_size % world_size or not 0 <= rank < world_size:
            raise ValueError(
                f"batch_size {batch_size} / tgt_len {tgt_len} / world_size {world_size} / rank {rank} "
                f"do not make a layout"
            )
        w = np.array([float(x) for _, x in sources])
        for i, x in enumerate(w):
            if not np.isfinite(x) or x <= 0:
                raise BlendError(f"blend source {i} ({sources[i][0]}): weight {x} is not a positive number")
        self.dirs = [str(d) for d, _ in sources]
        self.weights = w / w.sum()
        self.split, self.batch_size, self.tgt_len = split, batch_size, tgt_len
        self.world_size, self.rank, self.seed = world_size, rank, int(seed)
        self.local_batch = batch_size // world_size
        self.col0 = rank * self.local_batch
        self.mix_every, self.log = mix_every, log
        self.sources: list[SplitSource] = []
        try:
            for d in self.dirs:
                self.sources.append(
                    SplitSource(d, split, remote_options=remote_options, max_open=min(self.local_batch + 2, 256))
                )
            ident = [tokenizer_identity(s.manifest) for s in self.sources]
            for i in range(1, len(ident)):
                diff = [k for k in ident[0] if ident[i][k] != ident[0][k]]
                if diff:
                    raise BlendError(
                        f"blend source {i} ({self.dirs[i]}) has another tokenizer than source 0 "
                        f"({self.dirs[0]}): " + ", ".join(f"{k} {ident[i][k]!r} vs {ident[0][k]!r}" for k in diff)
                    )
            self.units = [Units(s) for s in self.sources]  # reads (and verifies) the document indexes
        except BaseException:
            self.close()
            raise
        self.manifest = self.sources[0].manifest
        self.vocab_sha256 = self.manifest["vocab"].get("sha256", "")
        self.n_tokens = sum(s.n_tokens for s in self.sources)
        self.steps_per_epoch = ENDLESS
        self.n_units = [u.n for u in self.units]
        p = self.weights / np.array([u.mean_tokens for u in self.units])  # weights are shares of tokens
        self.probs = p / p.sum()
        self._schedules: dict[int, _Schedule] = {}
        self.epoch, self.step = 0, 0

    # ---- schedule ---------------------------------------------------------------------------------------
    def schedule(self, column: int) -> _Schedule:
        sch = self._schedules.get(column)
        if sch is None:
            sch = self._schedules[column] = _Schedule(column, self.seed, self.probs, self.units)
        return sch

    def _read_column(self, column: int, start: int, stop: int, out: np.ndarray) -> None:
        sch, pos, o = self.schedule(column), start, 0
        while pos < stop:
            cur = sch.current
            if cur is None or not cur[2] <= pos < cur[3]:  # entering another unit
                j = sch.find(pos)
                s, u, first, last = sch.entry(j)
                cur = sch.current = (s, int(self.units[s].start(u)) - first, first, last)
                ns, nu, _, _ = sch.entry(j + 1)  # read-ahead (remote sources): the column's next unit
                self.sources[ns].prefetch_at(int(self.units[ns].start(nu)))
            s, base, _, last = cur
            end = min(stop, last)
            self.sources[s].read(base + pos, base + end, out[o : o + end - pos], slot=column)
            o += end - pos
            pos = end

    def get_batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if epoch != 0 or step < 0:
            raise IndexError(f"a blend is one endless epoch: (epoch {epoch}, step {step}) does not exist")
        i, m = step * self.tgt_len, self.tgt_len + 1
        buf = np.empty((self.local_batch, m), dtype=np.int64)
        for k in range(self.local_batch):
            self._read_column(self.col0 + k, i, i + m, buf[k])
        t = torch.from_numpy(np.ascontiguousarray(buf.T))
        return t[:-1], t[1:]

    def __iter__(self):
        while True:
            step = self.step
            batch = self.get_batch(0, step)
            if self.step != step:
                raise RuntimeError("BlendReader: the state was reloaded while this iteration was running")
            self.step = step + 1
            if self.mix_every and self.rank == 0 and self.step % self.mix_every == 0:
                self.log(self.mix_line())
            yield batch

    # ---- the realized mix -------------------------------------------------------------------------------
    def token_mix(self, steps: int | None = None) -> np.ndarray:
        """Fraction of the input tokens of steps [0, steps) (default: those handed out) from each source, over
        all batch_size columns."""
        stop = (self.step if steps is None else steps) * self.tgt_len
        total = np.zeros(len(self.sources), dtype=np.int64)
        for c in range(self.batch_size):
            total += self.schedule(c).tokens_by_source(stop)
        return total / max(1, total.sum())

    def mix_line(self) -> str:
        mix = self.token_mix()
        parts = ", ".join(f"{d} {m:.1%} (weight {w:.1%})" for d, m, w in zip(self.dirs, mix, self.weights, strict=True))
        return f"[data] blend token mix over steps 1-{self.step}: {parts}"

    # ---- state ------------------------------------------------------------------------------------------
    # a source is known by its size and weight, not its address: a blend may resume with a source moved (a local
    # directory uploaded to s3://, say); "dirs" is recorded for people only
    _IDENTITY = ("kind", "split", "batch_size", "tgt_len", "seed", "sources", "vocab_sha256")

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": "blend",
            "epoch": 0,
            "step": self.step,
            "split": self.split,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "roll": False,
            "seed": self.seed,
            "sources": [
                [s.n_tokens, u.kind, u.n, float(w)]
                for s, u, w in zip(self.sources, self.units, self.weights, strict=True)
            ],
            "dirs": list(self.dirs),
            "n_tokens": self.n_tokens,
            "vocab_sha256": self.vocab_sha256,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"BlendReader.load_state_dict: state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        for k in self._IDENTITY:
            theirs = state.get(k)
            if k == "sources" and theirs is not None:
                theirs = [[int(n), str(kind), int(nu), float(w)] for n, kind, nu, w in theirs]
            if theirs != mine[k]:
                raise ValueError(
                    f"BlendReader.load_state_dict: field {k!r} is {theirs!r} in the saved state but "
                    f"{mine[k]!r} in this reader"
                )
        if int(state["epoch"]) != 0 or int(state["step"]) < 0:
            raise ValueError(
                f"BlendReader.load_state_dict: position (epoch {state['epoch']}, step "
                f"{state['step']}) is not in a blend's one epoch"
            )
        self.step = int(state["step"])

    def cache_info(self) -> dict:
        out: dict = {}
        for s in self.sources:
            for k, v in s.cache_info().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for s in self.sources:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
