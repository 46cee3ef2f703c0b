"""Byte-level enwik8 shard directories by size, made from the repository's fixture (tests/fixtures), and the
session's cache of them (the `shards_by_size` fixture of tests/conftest.py). Tests read them, never write them.

Sizes: None, the whole fixture through `megamemo prepare enwik8` (what a user's run reads: its chunking, its
splits); a byte count, that head of the fixture split 80/10/10 into small chunks and shards (many shards from few
bytes: what the eval, export and analyze tests want).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.fixture_data import ENWIK8

SMALL = 60_000  # bytes: the eval tests' size


def prepared_enwik8(out: Path) -> Path:
    """The whole enwik8 fixture prepared as `megamemo prepare enwik8 --raw FIXTURE --out OUT` prepares it."""
    from megamemo.data.cli import prepare_main

    assert prepare_main(["enwik8", "--raw", str(ENWIK8), "--out", str(out), "--quiet"]) == 0
    return out


def enwik8_slice_shards(out: Path, n_bytes: int = SMALL) -> Path:
    """Byte-level shards of the first n_bytes of the enwik8 fixture, split 80/10/10, small chunks and shards."""
    from megamemo.data import build
    from megamemo.data.corpora import from_arrays
    from megamemo.data.vocab import Vocab

    raw = np.frombuffer(ENWIK8.read_bytes()[:n_bytes], dtype=np.uint8)
    a, b = int(n_bytes * 0.8), int(n_bytes * 0.9)
    corpus = from_arrays({"train": raw[:a], "valid": raw[a:b], "test": raw[b:]}, Vocab.identity_bytes(), "enwik8")
    build(corpus, out, chunk_tokens=1000, shard_bytes=2000, log=lambda m: None)
    return out


class ShardsBySize:
    """One shard directory per size, made on first use under `root` (a session's temporary folder)."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[int | None, Path] = {}

    def get(self, n_bytes: int | None = None) -> Path:
        if n_bytes not in self.made:
            if n_bytes is None:
                self.made[n_bytes] = prepared_enwik8(self.root / "enwik8")
            else:
                self.made[n_bytes] = enwik8_slice_shards(self.root / f"enwik8-head-{n_bytes}", n_bytes)
        return self.made[n_bytes]


def sized(n_bytes: int | None):
    """A `shards` fixture for a test module whose tests want that size (`shards = sized(200_000)` at module level
    overrides the session's whole-fixture `shards`); made once per session per size."""

    @pytest.fixture(scope="session")
    def shards(shards_by_size: ShardsBySize) -> Path:
        return shards_by_size.get(n_bytes)

    return shards
