"""StreamReader: batches equal Transformer-XL's LMOrderedIterator (reference golden data and a plain oracle on
the raw enwik8 bytes), ranks partition the W=1 batch, roll is seeded per epoch, and resume is exact."""

import itertools

import numpy as np
import pytest
import torch
from helpers.fixture_data import ENWIK8, reference_file

from megamemo.data import StreamReader, Vocab, build, corpora
from megamemo.data.shard_reader import SplitSource


def xl_batches(stream: torch.Tensor, bsz: int, bptt: int, shifts=None):
    """LMOrderedIterator (spec §4.1): data = stream[:n·B].view(B, n).T; batch at i = 0, bptt, ... < n−1 has
    seq_len = min(bptt, n−1−i), input rows [i, i+seq_len), target rows [i+1, i+1+seq_len).
    `shifts`: LaMemo roll, column b rotated left by shifts[b]."""
    n = stream.size(0) // bsz
    data = stream[: n * bsz].view(bsz, n).t().clone()
    if shifts is not None:
        for b in range(bsz):
            data[:, b] = torch.roll(data[:, b], -int(shifts[b]))
    out = []
    for i in range(0, n - 1, bptt):
        seq_len = min(bptt, n - 1 - i)
        out.append((data[i : i + seq_len], data[i + 1 : i + 1 + seq_len]))
    return out


@pytest.fixture(scope="module")
def enwik8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("enwik8_shards")
    build(corpora.enwik8(ENWIK8), out, chunk_tokens=4096, shard_bytes="16K", log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def train_stream():
    raw = ENWIK8.read_bytes()
    n = len(raw)
    return torch.tensor(np.frombuffer(raw[: n - 2 * (n * 5 // 100)], dtype=np.uint8).astype(np.int64))


def collect(reader, limit=None):
    return [(x.clone(), y.clone()) for x, y in itertools.islice(reader, limit)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert xa.dtype == torch.int64 and xa.shape == xb.shape
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_reference_golden_batches(tmp_path):
    """The reference LMOrderedIterator's own output (tests/fixtures/reference)."""
    g = torch.load(reference_file("txl_tgt8_mem8"), weights_only=True)
    vocab = Vocab("words", [f"w{i}" for i in range(64)])
    build(
        corpora.from_arrays({"train": g["stream"].numpy()}, vocab),
        tmp_path,
        chunk_tokens=5,
        shard_bytes=2048,
        log=lambda m: None,
    )
    r = StreamReader(tmp_path, "train", batch_size=2, tgt_len=8)
    assert r.steps_per_epoch == len(g["inputs"]) == 4
    assert_same(collect(r), list(zip(g["inputs"], g["targets"], strict=True)))
    for rank in range(2):  # W=2: each rank owns one column
        got = collect(StreamReader(tmp_path, "train", batch_size=2, tgt_len=8, world_size=2, rank=rank))
        assert_same(
            got,
            [(x[:, rank : rank + 1], y[:, rank : rank + 1]) for x, y in zip(g["inputs"], g["targets"], strict=True)],
        )


@pytest.mark.parametrize(
    "bsz,bptt,block_tokens,prefetch",
    [(7, 333, 1 << 20, 0), (5, 1000, 3000, 0), (5, 1000, 3000, 2), (1, 4096, 1 << 16, 1)],
)
def test_layout_equals_lm_ordered_iterator(enwik8_dir, train_stream, bsz, bptt, block_tokens, prefetch):
    r = StreamReader(enwik8_dir, "train", batch_size=bsz, tgt_len=bptt, block_tokens=block_tokens, prefetch=prefetch)
    expect = xl_batches(train_stream, bsz, bptt)
    assert r.n_tokens == train_stream.numel() and r.steps_per_epoch == len(expect)
    assert r.tokens_per_epoch == sum(x.numel() for x, _ in expect)
    got = collect(r)
    assert_same(got, expect)
    assert got[-1][0].shape[0] < bptt  # the last batch is shorter, as in the XL iterator
    assert list(r) == []  # epochs=1: the reader is exhausted


def test_ranks_partition_the_global_batch(enwik8_dir):
    B, L, W = 8, 2048, 4
    kw = dict(batch_size=B, tgt_len=L, roll=True, seed=3, epochs=2)
    whole = collect(StreamReader(enwik8_dir, "train", **kw))
    parts = [collect(StreamReader(enwik8_dir, "train", world_size=W, rank=r, **kw)) for r in range(W)]
    assert len(whole) == 2 * StreamReader(enwik8_dir, "train", **kw).steps_per_epoch
    for k, (x, y) in enumerate(whole):
        assert all(p[k][0].shape == (x.shape[0], B // W) for p in parts)
        assert torch.equal(torch.cat([p[k][0] for p in parts], 1), x)
        assert torch.equal(torch.cat([p[k][1] for p in parts], 1), y)


def test_roll_is_a_seeded_per_epoch_column_rotation(enwik8_dir, train_stream):
    B, L = 4, 4096
    r = StreamReader(enwik8_dir, "train", batch_size=B, tgt_len=L, roll=True, seed=11, epochs=2)
    got = collect(r)
    n = train_stream.numel() // B
    s0, s1 = r.roll_shifts(0), r.roll_shifts(1)
    assert ((0 <= s0) & (s0 < n)).all() and ((0 <= s1) & (s1 < n)).all()
    assert not np.array_equal(s0, s1)  # reseeded every epoch
    steps = r.steps_per_epoch
    assert_same(got[:steps], xl_batches(train_stream, B, L, s0))
    assert_same(got[steps:], xl_batches(train_stream, B, L, s1))
    same = StreamReader(enwik8_dir, "train", batch_size=B, tgt_len=L, roll=True, seed=11)
    other = StreamReader(enwik8_dir, "train", batch_size=B, tgt_len=L, roll=True, seed=12)
    assert np.array_equal(same.roll_shifts(1), s1) and not np.array_equal(other.roll_shifts(1), s1)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_is_exact_mid_epoch_and_across_epochs(enwik8_dir, prefetch):
    kw = dict(batch_size=4, tgt_len=1024, roll=True, seed=5, epochs=3)
    full = collect(StreamReader(enwik8_dir, "train", **kw))
    steps = StreamReader(enwik8_dir, "train", **kw).steps_per_epoch
    for stop in (37, steps - 1, steps, steps + 5):  # mid-epoch, last batch of epoch 0, just after, epoch 1
        a = StreamReader(enwik8_dir, "train", prefetch=prefetch, **kw)
        head = collect(a, stop)
        state = a.state_dict()  # reflects batches consumed, not prefetched
        a.close()
        assert (state["epoch"], state["step"]) == divmod(stop, steps)
        b = StreamReader(enwik8_dir, "train", prefetch=prefetch, **kw)
        b.load_state_dict(state)
        assert_same(head + collect(b), full)


def test_resume_into_another_world_size(enwik8_dir):
    kw = dict(batch_size=6, tgt_len=300, roll=True, seed=1, epochs=2)
    full = collect(StreamReader(enwik8_dir, "train", **kw))
    a = StreamReader(enwik8_dir, "train", **kw)
    collect(a, 100)
    state = a.state_dict()
    ranks = []
    for r in range(3):
        rd = StreamReader(enwik8_dir, "train", world_size=3, rank=r, **kw)
        rd.load_state_dict(state)
        ranks.append(collect(rd))
    merged = [
        (torch.cat([p[k][0] for p in ranks], 1), torch.cat([p[k][1] for p in ranks], 1)) for k in range(len(ranks[0]))
    ]
    assert_same(merged, full[100:])


def test_state_mismatch_and_stale_iteration_are_errors(enwik8_dir):
    a = StreamReader(enwik8_dir, "train", batch_size=4, tgt_len=512, roll=True, seed=1)
    state = a.state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        StreamReader(enwik8_dir, "train", batch_size=8, tgt_len=512, roll=True, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        StreamReader(enwik8_dir, "train", batch_size=4, tgt_len=512, roll=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="split"):
        StreamReader(enwik8_dir, "valid", batch_size=4, tgt_len=512, roll=True, seed=1).load_state_dict(state)
    it = iter(a)
    next(it)
    a.load_state_dict(state)
    with pytest.raises(RuntimeError, match="reloaded"):
        next(it)
    with pytest.raises(ValueError, match="divisible"):
        StreamReader(enwik8_dir, "train", batch_size=6, tgt_len=8, world_size=4)
    with pytest.raises(ValueError, match="too few"):
        StreamReader(enwik8_dir, "valid", batch_size=300_000, tgt_len=8)


def test_memory_is_bounded_by_columns_not_corpus(enwik8_dir):
    r = StreamReader(enwik8_dir, "train", batch_size=8, tgt_len=1024, block_tokens=1 << 14)
    peak = {"open_shards": 0, "cached_chunks": 0}
    for _ in r:
        info = r.cache_info()
        for k in peak:
            peak[k] = max(peak[k], info[k])
    assert peak["cached_chunks"] <= 8  # one decoded chunk per column
    assert peak["open_shards"] <= 10  # columns + 2 at most
    assert r.cache_info()["cached_bytes"] <= 8 * 4096
    # every chunk of the split decoded about once per epoch (columns share at most their boundary chunks)
    n_chunks = -(-r.n_tokens // 4096)
    assert r.source.chunks_decoded <= n_chunks + 8


def test_split_source_random_access(enwik8_dir, train_stream):
    src = SplitSource(enwik8_dir, "train")
    out = np.empty(10_000, dtype=np.uint8)
    for start in (0, 4095, 123_457, train_stream.numel() - 10_000):
        src.read(start, start + 10_000, out, slot=0)
        assert np.array_equal(out, train_stream[start : start + 10_000].numpy())
    with pytest.raises(IndexError):
        src.read(train_stream.numel() - 5, train_stream.numel() + 5, out)
