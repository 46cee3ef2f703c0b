"""BlendReader: columns built from whole documents (or, for manifests without a document index, chunks) of
several sources by weight. Checked against the documents as they were generated (not the manifest's index), the
sources' own token streams, and token ids that tell the sources apart (an independent count of the mix)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.fixture_data import ENWIK8, TEXT8

from megamemo.data import Vocab, build, corpora, read_split
from megamemo.data.blend import BlendError, BlendReader

VOCAB = Vocab("words", [f"w{i}" for i in range(64)])
CT = 256  # chunk_tokens: the unit of a source without documents; documents span chunks and shards


def source(out, seed: int, low: int, n: int):
    """A flat corpus (no document index) whose ids lie in [low, low + 32): the id says which source it came from."""
    ids = np.random.default_rng(seed).integers(low, low + 32, size=n).astype(np.uint8)
    build(corpora.from_arrays({"train": ids}, VOCAB), out, chunk_tokens=CT, shard_bytes="4K", log=lambda m: None)
    return out


def doc_source(out, seed: int, low: int, n_docs: int, mean_len: int) -> list[np.ndarray]:
    """A corpus of n_docs documents of 1 .. 2·mean_len - 1 tokens (ids in [low, low + 32)); returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(low, low + 32, size=int(n)).astype(np.uint8) for n in rng.integers(1, 2 * mean_len, n_docs)]
    build(
        corpora.from_arrays({"train": np.concatenate(docs)}, VOCAB, documents={"train": [d.size for d in docs]}),
        out,
        chunk_tokens=CT,
        shard_bytes="4K",
        log=lambda m: None,
    )
    return docs


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    return source(root / "a", 1, 0, 60_000 + 77), source(root / "b", 2, 32, 25_000)


@pytest.fixture(scope="module")
def doc_sources(tmp_path_factory):
    """Documents of very different mean lengths (150 and 800 tokens): drawn by count instead of by tokens, a 7:3
    blend would give 30% : 70% of the tokens."""
    root = tmp_path_factory.mktemp("blend_docs")
    return (root / "a", doc_source(root / "a", 1, 0, 400, 150)), (root / "b", doc_source(root / "b", 2, 32, 60, 800))


def columns(batches):
    """Each column's token stream: the inputs of consecutive steps, plus the last target row."""
    x = np.concatenate([b[0].numpy() for b in batches])
    return np.concatenate([x, batches[-1][1].numpy()[-1:]]).T


def take(reader, n):
    out = []
    for k, b in enumerate(reader):
        out.append((b[0].clone(), b[1].clone()))
        if k + 1 == n:
            return out


@pytest.mark.parametrize("units", ["documents", "chunks"])
def test_token_mix_follows_the_weights(units, doc_sources, two_sources):
    (a, _), (b, _) = doc_sources if units == "documents" else [(d, None) for d in two_sources]
    r = BlendReader([(a, 7), (b, 3)], "train", batch_size=8, tgt_len=256, seed=5)
    assert [u.kind for u in r.units] == [units, units]
    got = take(r, 2000)  # 4,096,000 tokens
    ids = np.concatenate([x.numpy().ravel() for x, _ in got])
    from_a = float((ids < 32).mean())  # counted from the tokens themselves
    assert abs(from_a - 0.7) <= 0.02 and abs((1 - from_a) - 0.3) <= 0.02
    # what the log reports is what was read: integer counts over the same total, each quotient rounded once in
    # float64 (1 - from_a once more): 2 u64 relative (eps = 2 u64, twice that allowed)
    assert np.allclose(r.token_mix(), [from_a, 1 - from_a], rtol=2 * np.finfo(np.float64).eps, atol=0)
    assert r.mix_line() == (
        f"[data] blend token mix over steps 1-2000: {a} {from_a:.1%} (weight 70.0%), "
        f"{b} {1 - from_a:.1%} (weight 30.0%)"
    )


def test_columns_are_whole_documents_of_the_sources_in_order(doc_sources):
    """Every unit of a column is one whole generated document (the last one cut by the end of the run), and each
    source is walked document after document: the memory stream never crosses into the middle of a document."""
    (a, docs_a), (b, docs_b) = doc_sources
    docs = [docs_a, docs_b]
    r = BlendReader([(a, 1), (b, 1)], "train", batch_size=4, tgt_len=100, seed=9)
    cols = columns(take(r, 60))
    for c, col in enumerate(cols):
        sch = r.schedule(c)
        pos, j, seen = 0, 0, {0: [], 1: []}
        while pos < col.size:
            s, u, first, last = sch.entry(j)
            assert first == pos
            doc = docs[s][u]
            n = min(doc.size, col.size - pos)
            assert last - first == doc.size
            assert np.array_equal(col[pos : pos + n], doc[:n])  # the document, from its first token
            seen[s].append(u)
            pos, j = pos + n, j + 1
        for s, units in seen.items():  # each source walked in order
            assert all((v - u) % len(docs[s]) == 1 for u, v in zip(units, units[1:], strict=False))
        assert seen[0] and seen[1]  # both sources in every column


def test_without_a_document_index_columns_are_whole_chunks(two_sources):
    """Manifests without a document index (flat corpora, directories prepared before indexes existed) blend
    chunks of chunk_tokens tokens."""
    a, b = two_sources
    streams = [read_split(a, "train"), read_split(b, "train")]
    r = BlendReader([(a, 1), (b, 1)], "train", batch_size=4, tgt_len=100, seed=9)
    cols = columns(take(r, 40))
    for c, col in enumerate(cols):
        sch = r.schedule(c)
        pos, j = 0, 0
        while pos < col.size:
            s, u, first, last = sch.entry(j)
            unit = streams[s][u * CT : (u + 1) * CT]
            n = min(unit.size, col.size - pos)
            assert first == pos and last - first == unit.size
            assert np.array_equal(col[pos : pos + n], unit[:n])
            pos, j = pos + n, j + 1


def test_ranks_partition_and_resume_is_exact(doc_sources):
    (a, _), (b, _) = doc_sources
    kw = dict(batch_size=4, tgt_len=64, seed=3)
    whole = take(BlendReader([(a, 2), (b, 1)], "train", **kw), 30)
    first = BlendReader([(a, 2), (b, 1)], "train", world_size=2, rank=1, **kw)
    head = take(first, 11)
    state = first.state_dict()
    again = BlendReader([(a, 2), (b, 1)], "train", world_size=2, rank=1, **kw)
    again.load_state_dict(state)
    rest = take(again, 19)
    for k, (x, y) in enumerate(head + rest):
        assert np.array_equal(x.numpy(), whole[k][0].numpy()[:, 2:]) and np.array_equal(
            y.numpy(), whole[k][1].numpy()[:, 2:]
        )
    four = BlendReader([(a, 2), (b, 1)], "train", world_size=4, rank=0, **kw)  # on another number of ranks
    four.load_state_dict(state)
    for k, (x, _y) in enumerate(take(four, 19)):
        assert np.array_equal(x.numpy(), whole[11 + k][0].numpy()[:, :1])
    with pytest.raises(ValueError, match="seed"):
        BlendReader([(a, 2), (b, 1)], "train", batch_size=4, tgt_len=64, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="sources"):
        BlendReader([(a, 1), (b, 1)], "train", **kw).load_state_dict(state)


def test_a_damaged_document_index_is_named(doc_sources, tmp_path):
    import json
    import shutil

    from megamemo.data import ShardError

    (a, _), _ = doc_sources
    bad = tmp_path / "a"
    shutil.copytree(a, bad)
    entry = json.loads((bad / "manifest.json").read_text())["splits"]["train"]["documents"]
    data = bytearray((bad / entry["file"]).read_bytes())
    data[9] ^= 1  # document 1 starts elsewhere
    (bad / entry["file"]).write_bytes(bytes(data))
    with pytest.raises(
        ShardError, match=f"shard {bad / entry['file']}: document index: sha256 .* does not match manifest.json"
    ):
        BlendReader([(bad, 1)], "train", batch_size=2, tgt_len=16)
    (bad / entry["file"]).unlink()
    with pytest.raises(ShardError, match=f"shard {bad / entry['file']}: missing"):
        BlendReader([(bad, 1)], "train", batch_size=2, tgt_len=16)


def test_sources_with_another_tokenizer_are_refused(two_sources, tmp_path):
    a, _ = two_sources
    e8 = tmp_path / "enwik8"
    build(corpora.enwik8(ENWIK8), e8, chunk_tokens=4096, shard_bytes="64K", log=lambda m: None)
    t8 = tmp_path / "text8"
    build(corpora.text8(TEXT8), t8, chunk_tokens=4096, shard_bytes="64K", log=lambda m: None)
    with pytest.raises(
        BlendError,
        match=f"blend source 1 \\({t8}\\) has another tokenizer than source 0 "
        f"\\({e8}\\): vocab.kind 'chars' vs 'bytes'",
    ):
        BlendReader([(e8, 1), (t8, 1)], "train", batch_size=2, tgt_len=16)
    with pytest.raises(BlendError, match="another tokenizer"):
        BlendReader([(a, 1), (e8, 1)], "train", batch_size=2, tgt_len=16)
    with pytest.raises(BlendError, match="weight"):
        BlendReader([(a, 1), (a, 0)], "train", batch_size=2, tgt_len=16)


def test_train_refuses_a_blend_of_two_tokenizers_by_name(two_sources, tmp_path, capsys):
    from test_train_runs import TINY

    from megamemo.commands.train import main

    a, _ = two_sources
    e8 = tmp_path / "enwik8"
    build(corpora.enwik8(ENWIK8), e8, chunk_tokens=4096, shard_bytes="64K", log=lambda m: None)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    blend = f"data.blend=[{{dir: {e8}, weight: 2}}, {{dir: {a}, weight: 1}}]"
    assert main(["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--set", blend]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"megamemo train: error: data.blend[1].dir: {a} has another "
        f"tokenizer than data.blend[0].dir (vocab.kind 'words' vs 'bytes'"
    )
    assert main(["--config", str(cfg), "--set", f"data.blend=[{{dir: {e8}, weight: -1}}]"]) == 2
    assert "data.blend[0].weight: expected a positive number" in capsys.readouterr().err


def test_a_resume_with_another_batch_size_keeps_the_step_and_the_columns(two_sources):
    """The trainer's data cursor moves a StreamReader's position to the same fraction of the epoch when the batch
    changes; a blend's columns do not depend on the batch, so it keeps the step and column c goes on as before."""
    from megamemo.train.resumable import DataCursor

    a, b = two_sources
    old = BlendReader([(a, 1), (b, 1)], "train", batch_size=4, tgt_len=32, seed=1)
    take(old, 7)
    cursor = DataCursor(BlendReader([(a, 1), (b, 1)], "train", batch_size=8, tgt_len=32, seed=1), log=lambda m: None)
    cursor.load_state_dict(old.state_dict())
    assert cursor.state["step"] == 7 and cursor.state["batch_size"] == 8
    x_new, _ = cursor.next_batch()
    x_old, _ = next(iter(old))
    assert np.array_equal(x_new.numpy()[:, :4], x_old.numpy())
