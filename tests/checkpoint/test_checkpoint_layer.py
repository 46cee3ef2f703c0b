"""The checkpoint layer on its own: the layout-free description (pieces written by one layout, read back by
another, against plain slicing of the global tensor), the registry's round trip, and the store's commit protocol,
checksums, retention and move-aside, with ranks as threads."""

from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.distributed import run_distributed

from megamemo.checkpoint.commit import LocalOutcomes
from megamemo.checkpoint.faults import FaultPoints
from megamemo.checkpoint.index import INDEX_FILE, coverage_problems, open_reader
from megamemo.checkpoint.layout import RunLayout, RunMeta
from megamemo.checkpoint.pieces import Piece, PieceError, ShardedReader, spread_writers, write_pieces
from megamemo.checkpoint.state import Counters, LoadContext, RNGState, StateRegistry, rank_files, save_snapshot
from megamemo.checkpoint.store import (
    MARKER,
    CheckpointError,
    CheckpointStore,
    SaveFailed,
    list_checkpoints,
    newest_complete,
    tag_for,
    verify,
)
from megamemo.parallel.tensor import global_box, shard_tensor


# ---- pieces --------------------------------------------------------------------------------------------------
def _zero_fragments(n: int, dp: int, rng: random.Random) -> list[tuple[int, int]]:
    """Uneven contiguous ranges tiling [0, n), as ZeRO's flat partitions cut a parameter."""
    cuts = sorted(rng.sample(range(1, n), dp - 1)) if dp > 1 else []
    edges = [0, *cuts, n]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def _write_tp_dp(tmp_path, name, full, dim, tp, dp, seed=0):
    """Pieces of `full` written as TP=tp ranks cut on `dim`, each box's flattening split over dp ZeRO ranks:
    one file per (tp, dp) rank, as a run would write them."""
    rng = random.Random(seed)
    files = []
    per = full.shape[dim] // tp
    for t in range(tp):
        box = [(0, n) for n in full.shape]
        box[dim] = (t * per, (t + 1) * per)
        data = full.narrow(dim, t * per, per).contiguous().reshape(-1)
        for d, (a, b) in enumerate(_zero_fragments(data.numel(), dp, rng)):
            path = tmp_path / f"rank_{t * dp + d:05d}.safetensors"
            write_pieces(path, [Piece(name, data[a:b].clone(), tuple(full.shape), tuple(box), (a, b))])
            files.append(path)
    return files


def test_pieces_written_by_one_layout_read_by_another(tmp_path):
    g = torch.randn(12, 10, dtype=torch.float64)
    reader = ShardedReader(_write_tp_dp(tmp_path, "exp_avg/w", g, dim=1, tp=2, dp=3))
    assert reader.shape("exp_avg/w") == (12, 10)
    assert torch.equal(reader.read("exp_avg/w"), g)  # whole (to-single)
    assert torch.equal(reader.read("exp_avg/w", ((3, 6), (0, 10))), g[3:6])  # TP=4 on the other dim
    assert torch.equal(reader.read("exp_avg/w", ((0, 12), (4, 9))), g[:, 4:9])  # a box across both TP shards
    box = ((0, 12), (0, 5))  # a new ZeRO fragment of a box
    assert torch.equal(reader.read("exp_avg/w", box, (7, 41)), g[:, :5].reshape(-1)[7:41])


def test_the_same_layout_reads_exactly_its_own_piece(tmp_path, monkeypatch):
    g = torch.arange(40.0).view(8, 5)
    files = _write_tp_dp(tmp_path, "m", g, dim=0, tp=2, dp=2, seed=3)
    reader = ShardedReader(files)
    entry = sorted(reader.entries["m"], key=lambda e: (e.box, e.flat))[1]  # tp 0, dp 1's fragment
    monkeypatch.setattr(ShardedReader, "_assemble", lambda *a: pytest.fail("assembled instead of read"))
    got = reader.read("m", entry.box, entry.flat)
    assert torch.equal(got, g[:4].reshape(-1)[entry.flat[0] : entry.flat[1]])


def test_qkv_shards_move_between_tensor_parallel_sizes(tmp_path):
    """[Q;K;V] described as [3, n*dh, d]: what TP=2 wrote, TP=4 reads as its own heads of Q, K and V - the
    per-head split tensor.py's shard_tensor makes from the single-device weight."""
    key, full = "layers.0.attn.qkv.weight", torch.randn(3 * 8, 6)
    files = []
    for r in range(2):
        local = shard_tensor(key, full, r, 2)
        shape, box, view = global_box(key, local.shape, r, 2)
        files.append(tmp_path / f"rank_{r:05d}.safetensors")
        write_pieces(files[-1], [Piece(f"model/{key}", local.reshape(view), shape, box)])
    reader = ShardedReader(files)
    assert torch.equal(reader.read(f"model/{key}").reshape(full.shape), full)
    for r in range(4):
        want = shard_tensor(key, full, r, 4)
        _, box, _ = global_box(key, want.shape, r, 4)
        assert torch.equal(reader.read(f"model/{key}", box).reshape(want.shape), want)


def test_missing_or_duplicate_pieces_are_named(tmp_path):
    g = torch.randn(6, 4)
    files = _write_tp_dp(tmp_path, "w", g, dim=0, tp=2, dp=2)
    with pytest.raises(PieceError, match=r"w: box .* (fragments|unwritten)"):
        ShardedReader([files[0], files[2], files[3]]).read("w")  # a ZeRO partition file lost
    with pytest.raises(PieceError, match=r"cover 12 of the 24 values"):
        ShardedReader(files[:2]).read("w")  # a TP shard lost
    dup = tmp_path / "dup.safetensors"
    write_pieces(dup, [Piece("x", g, (6, 4)), Piece("x", g.clone(), (6, 4))])
    with pytest.raises(PieceError, match="written twice"):
        ShardedReader([dup]).read("x")
    with pytest.raises(PieceError, match="does not fit box"):
        write_pieces(tmp_path / "bad.safetensors", [Piece("y", g, (6, 4), ((0, 3), (0, 4)))])


def test_replicated_tensors_are_spread_over_the_ranks_that_hold_them():
    sizes = {"d": 1, "c": 5, "b": 6, "a": 10, "e": 5}
    # by hand, largest first to the least loaded: a->0 (10, 0); b->1 (10, 6); c->1 (10, 11); e->0 (15, 11); d->1
    assert spread_writers(sizes, 2) == {"a": 0, "b": 1, "c": 1, "e": 0, "d": 1}
    assert spread_writers(dict(reversed(list(sizes.items()))), 2) == spread_writers(sizes, 2)  # any order
    assert set(spread_writers(sizes, 1).values()) == {0}
    assert sorted(spread_writers(sizes, 8).values()) == [0, 1, 2, 3, 4]  # more ranks than tensors


# ---- the registry ----------------------------------------------------------------------------------------------
class Box:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, d):
        self.value = d


class Sharded:
    """This rank's rows of a global [4, 3] tensor."""

    def __init__(self, rank, world, full):
        self.rank, self.world, self.full = rank, world, full
        self.loaded = None

    def pieces(self):
        per = 4 // self.world
        return [
            Piece(
                "t",
                self.full[self.rank * per : (self.rank + 1) * per],
                (4, 3),
                ((self.rank * per, (self.rank + 1) * per), (0, 3)),
            )
        ]

    def load_pieces(self, ctx: LoadContext):
        self.loaded = ctx.reader.read("t")


def test_registry_round_trip_is_exact_and_pickle_free(tmp_path):
    torch.manual_seed(0)
    full = torch.randn(4, 3)
    value = {"cursor": {"epoch": 1, "step": 7}, "nested": [1, 2.5, None, "x"], "t": torch.randn(2, 2).bfloat16()}
    regs = []
    for r in range(2):  # two ranks write; a one-rank layout reads
        reg = StateRegistry()
        reg.register("box", Box(value))
        reg.register("rng", RNGState(), scope="rank")
        reg.register("counters", Counters(step=12, skipped=1))
        reg.register_sharded("t", Sharded(r, 2, full))
        regs.append(reg)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    for r, reg in enumerate(regs):
        save_snapshot(reg.snapshot(r, {"layout": {"rank": r}}), tmp_path)
    expect = (random.random(), np.random.rand(), torch.rand(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f for r in range(2) for f in rank_files(r))
    doc = json.loads((tmp_path / "rank_00001.json").read_text())
    assert doc["layout"] == {"rank": 1} and doc["files"]["rank_00001.safetensors"]["bytes"] > 0

    fresh, c2, sh = Box(None), Counters(step=0, skipped=0), Sharded(0, 1, None)
    reg2 = StateRegistry()
    reg2.register("box", fresh)
    reg2.register("rng", RNGState(), scope="rank")
    reg2.register("counters", c2)
    reg2.register_sharded("t", sh)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    reg2.load(tmp_path, 1, lambda reader: LoadContext(reader, same_layout=True, marker={}))
    assert (random.random(), np.random.rand()) == expect[:2] and torch.equal(torch.rand(3), expect[2])
    assert c2.state_dict() == {"step": 12, "skipped": 1} and torch.equal(sh.loaded, full)
    assert fresh.value["cursor"] == value["cursor"] and fresh.value["nested"] == [1, 2.5, None, "x"]
    assert torch.equal(fresh.value["t"], value["t"]) and fresh.value["t"].dtype == torch.bfloat16
    torch.manual_seed(9)  # another layout: rank-scope state is left alone
    reg2.load(tmp_path, 0, lambda reader: LoadContext(reader, same_layout=False, marker={}))
    assert torch.equal(torch.rand(3), (torch.manual_seed(9), torch.rand(3))[1])
    # a rank the saved layout did not have (rank 2 of 3): the global state from rank 0's file, its own streams alone
    box3, c3 = Box(None), Counters(step=0, skipped=0)
    reg3 = StateRegistry()
    reg3.register("box", box3)
    reg3.register("rng", RNGState(), scope="rank")
    reg3.register("counters", c3)
    reg3.register_sharded("t", Sharded(0, 1, None))
    torch.manual_seed(9)
    reg3.load(tmp_path, 2, lambda reader: LoadContext(reader, same_layout=False, marker={}))
    assert c3.state_dict() == {"step": 12, "skipped": 1} and box3.value["cursor"] == value["cursor"]
    assert torch.equal(torch.rand(3), (torch.manual_seed(9), torch.rand(3))[1])


def test_snapshots_reuse_their_host_buffers_and_share_nothing_with_the_live_state():
    full = torch.arange(12.0).view(4, 3)
    reg = StateRegistry()
    reg.register_sharded("t", Sharded(0, 1, full))
    first = reg.snapshot(0).pieces[0].tensor
    assert torch.equal(first, full) and first.data_ptr() != full.data_ptr()
    full.add_(100)  # training goes on: the snapshot keeps the old values
    assert torch.equal(first, torch.arange(12.0).view(4, 3))
    second = reg.snapshot(0).pieces[0].tensor  # the next save (after the first was written): same buffer
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, full)
    reg.sharded["t"].full = torch.zeros(4, 3, dtype=torch.float64)
    third = reg.snapshot(0).pieces[0].tensor  # another dtype: a buffer of its own
    assert third.dtype == torch.float64 and third.data_ptr() != first.data_ptr()
    assert len(reg.staging.buffers) == 1


def test_registry_refuses_missing_entries(tmp_path):
    reg = StateRegistry()
    reg.register("a", Box({"x": 1}))
    save_snapshot(reg.snapshot(0), tmp_path)
    other = StateRegistry()
    other.register("b", Box(None))
    with pytest.raises(RuntimeError, match=r"state entries missing: \['b'\]"):
        other.load(tmp_path, 0, lambda reader: LoadContext(reader, True, {}))


# ---- the store --------------------------------------------------------------------------------------------------
def _store(root, rank=0, world=1, keep=2, model=None, barrier=lambda: None, async_save=False, outcomes=None):
    meta = RunMeta(
        model or {"n_layer": 2}, layout=RunLayout(world_size=world, dp=world, batch_size=4), precision="fp32"
    )
    return CheckpointStore(
        root,
        rank,
        world,
        keep,
        meta,
        barrier=barrier,
        async_save=async_save,
        commit_timeout_s=30,
        log=lambda m: None,
        outcomes=outcomes,
    )


def _registry(rank, world, step):
    reg = StateRegistry()
    reg.register("counters", Counters(step=step))
    reg.register_sharded("t", Sharded(rank, world, torch.full((4, 3), float(step))))
    return reg


class ThreadOutcomes:
    """commit.py's outcome channel (gather to rank 0, broadcast from it) for ranks that are threads."""

    def __init__(self, world):
        self.slots, self.barrier = [None] * world, threading.Barrier(world, timeout=30)

    def rank(self, r):
        shared = self

        class View:
            def gather(self, obj):
                shared.slots[r] = obj
                shared.barrier.wait()
                out = list(shared.slots) if r == 0 else None
                shared.barrier.wait()
                return out

            def broadcast(self, obj):
                if r == 0:
                    shared.slots[0] = obj
                shared.barrier.wait()
                out = shared.slots[0]
                shared.barrier.wait()
                return out

        return View()


def _as_ranks(root, step, world=2, keep=2, async_save=False, registry=_registry, faults=None) -> dict:
    """The ranks of a run as threads with a real barrier and outcome channel between them. -> {rank: error}.
    With async saves each rank first waits until its store says the save failed or its thread ended."""
    bar, chan, errors = threading.Barrier(world, timeout=30), ThreadOutcomes(world), {}

    def rank(r):
        try:
            store = _store(
                root, rank=r, world=world, keep=keep, barrier=bar.wait, async_save=async_save, outcomes=chan.rank(r)
            )
            if faults:
                store.faults = FaultPoints(r, faults)
            store.overlap_late_files = True  # async: the extra files made beside the write, as on a GPU
            extra = {"extra.txt": lambda p: p.write_text("x")} if r else {}
            # async: made after the snapshot, as the probe is (the writer waits for them)
            store.save(step, registry(r, world, step), files=(lambda: extra) if async_save else extra)
            if async_save:
                store._thread.join(30)
                assert store.failed() == (store._error is not None)  # what the training loop asks every step
            store.finish()
        except Exception as e:  # surfaced by the caller
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _save_as_ranks(root, step, world=2, keep=2, async_save=False):
    errors = _as_ranks(root, step, world, keep, async_save)
    assert not errors, errors


@pytest.mark.parametrize("async_save", [False, True])
def test_commit_protocol_checksums_and_retention(tmp_path, async_save):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6):
        _save_as_ranks(root, step, async_save=async_save)
        info = verify(root / tag_for(step))
        assert info["step"] == step and info["world_size"] == 2
        assert set(info["files"]) == {
            "rank_00000.json",
            "rank_00000.safetensors",
            "rank_00001.json",
            "rank_00001.safetensors",
            "extra.txt",
            "index.json",
        }
        assert all(len(f["sha256"]) == 64 for f in info["files"].values())
        reader = ShardedReader(sorted((root / tag_for(step)).glob("rank_*.safetensors")))
        assert torch.equal(reader.read("t"), torch.full((4, 3), float(step)))
    assert [s for s, _, c in list_checkpoints(root) if c] == [4, 6]  # keep_last=2
    assert newest_complete(root) == root / tag_for(6)
    assert not list(root.rglob("*.tmp"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path, async_save):
    root = tmp_path / "ckpt"
    _save_as_ranks(root, 2, async_save=async_save)
    errors = _as_ranks(root, 4, async_save=async_save, faults={"MEGAMEMO_FAULT_FAIL_WRITE": "4:1"})
    assert sorted(errors) == [0, 1] and all(isinstance(e, SaveFailed) for e in errors.values()), errors
    assert (
        str(errors[0])
        == str(errors[1])
        == (
            f"checkpoint step 4 failed: rank 1 could not write {root / tag_for(4) / 'rank_00001.safetensors'}: "
            f"No space left on device (injected: MEGAMEMO_FAULT_FAIL_WRITE); nothing committed"
        )
    )
    assert [s for s, _, c in list_checkpoints(root)] == [2] and newest_complete(root) == root / tag_for(2)


def _holed(rank, world, step):
    """Rank 1 writes row 2 only of its rows [2, 4): row 3 of t is never written."""
    reg = _registry(rank, world, step)
    if rank == 1:
        full = torch.zeros(4, 3)
        reg.sharded["t"].pieces = lambda: [Piece("t", full[2:3], (4, 3), ((2, 3), (0, 3)))]
    return reg


def _overlapping(rank, world, step):
    """Rank 1 writes rows [1, 4): row 1 is also rank 0's."""
    reg = _registry(rank, world, step)
    if rank == 1:
        full = torch.zeros(4, 3)
        reg.sharded["t"].pieces = lambda: [Piece("t", full[1:4], (4, 3), ((1, 4), (0, 3)))]
    return reg


def test_a_hole_or_an_overlap_in_the_pieces_fails_the_save_naming_the_tensor(tmp_path):
    root = tmp_path / "ckpt"
    errors = _as_ranks(root, 2, registry=_holed)
    assert sorted(errors) == [0, 1] and str(errors[0]) == str(errors[1])
    assert "t: the pieces cover 9 of its 12 values [4, 3] (a hole" in str(errors[0]), errors
    errors = _as_ranks(root, 4, registry=_overlapping)
    assert sorted(errors) == [0, 1] and isinstance(errors[1], SaveFailed)
    assert (
        "t: boxes [[0, 2], [0, 3]] and [[1, 4], [0, 3]] overlap (written twice: rank_00000.safetensors, "
        "rank_00001.safetensors)"
    ) in str(errors[0]), errors
    assert list_checkpoints(root) == []  # nothing committed, nothing left behind


def _index(*pieces):
    """A merged index by hand: (file, name, shape, box, flat) per piece."""
    files = {}
    for i, (rel, name, shape, box, flat) in enumerate(pieces):
        files.setdefault(rel, {})[f"{name}#{i}"] = {
            "name": name,
            "shape": shape,
            "box": box,
            "flat": flat,
            "dtype": "F32",
        }
    return {"files": files}


def test_coverage_of_flat_fragments_and_boxes():
    whole = [[0, 4], [0, 3]]
    ok = _index(
        ("a", "w", [4, 3], whole, [0, 5]),
        ("b", "w", [4, 3], whole, [5, 12]),
        ("a", "v", [4, 3], [[0, 4], [0, 1]], None),
        ("b", "v", [4, 3], [[0, 4], [1, 3]], None),
    )
    assert coverage_problems(ok) == []
    gap = _index(("a", "w", [4, 3], whole, [0, 5]), ("b", "w", [4, 3], whole, [6, 12]))
    assert coverage_problems(gap) == ["w: values [5, 6) of box [[0, 4], [0, 3]] are written by no rank (a hole)"]
    short = _index(("a", "w", [4, 3], whole, [0, 5]), ("b", "w", [4, 3], whole, [5, 11]))
    assert coverage_problems(short) == ["w: values [11, 12) of box [[0, 4], [0, 3]] are written by no rank (a hole)"]
    twice = _index(("a", "w", [4, 3], whole, [0, 6]), ("b", "w", [4, 3], whole, [5, 12]))
    assert coverage_problems(twice) == ["w: values [5, 6) of box [[0, 4], [0, 3]] are written twice (a, b)"]
    whole_and_part = _index(("a", "w", [4, 3], whole, None), ("b", "w", [4, 3], whole, [0, 4]))
    assert "written twice (a, b)" in coverage_problems(whole_and_part)[0]
    cols = _index(("a", "v", [4, 3], [[0, 4], [0, 2]], None), ("b", "v", [4, 3], [[0, 4], [1, 3]], None))
    assert coverage_problems(cols) == ["v: boxes [[0, 4], [0, 2]] and [[0, 4], [1, 3]] overlap (written twice: a, b)"]


def test_the_merged_index_is_committed_and_read_instead_of_the_headers(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _save_as_ranks(root, 2)
    step = root / tag_for(2)
    info = verify(step)
    assert info["format"] == 3 and info["index"] == INDEX_FILE and INDEX_FILE in info["files"]
    merged = json.loads((step / INDEX_FILE).read_text())
    assert sorted(merged["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    from_headers = ShardedReader(sorted(step.glob("rank_*.safetensors")))
    monkeypatch.setattr(ShardedReader, "__init__", lambda *a: pytest.fail("a rank file's header was opened"))
    reader = open_reader(step)
    assert {n: sorted((e.file, e.key, e.box, e.dtype) for e in es) for n, es in reader.entries.items()} == {
        n: sorted((e.file, e.key, e.box, e.dtype) for e in es) for n, es in from_headers.entries.items()
    }
    assert torch.equal(reader.read("t"), torch.full((4, 3), 2.0))
    sh = Sharded(0, 1, None)
    reg = StateRegistry()
    reg.register("counters", Counters(step=0))
    reg.register_sharded("t", sh)
    reg.load(step, 0, lambda r: LoadContext(r, same_layout=False, marker=info))
    assert torch.equal(sh.loaded, torch.full((4, 3), 2.0))
    monkeypatch.undo()
    # a rank file that contradicts the index (replaced after the commit, checksums made to match) is named at its
    # first read, as is one that is no safetensors file
    for rel, data in (
        ("rank_00001.safetensors", (step / "rank_00000.safetensors").read_bytes()),
        ("rank_00000.safetensors", b"\x80\x04not a safetensors file"),
    ):
        damaged = tmp_path / f"damaged-{rel}"
        shutil.copytree(step, damaged)
        (damaged / rel).write_bytes(data)
        with pytest.raises(PieceError, match=f"{rel}: (its pieces differ from the ones .*index.json|unreadable)"):
            open_reader(damaged).read("t")
    # a checkpoint of format 2 (before the index): the same, through the headers
    (step / INDEX_FILE).unlink()
    old = {k: v for k, v in info.items() if k != "index"}
    old["format"], old["files"] = 2, {k: v for k, v in info["files"].items() if k != INDEX_FILE}
    (step / MARKER).write_text(json.dumps(old))
    assert verify(step)["format"] == 2
    assert torch.equal(open_reader(step).read("t"), torch.full((4, 3), 2.0))


def test_half_written_flipped_or_truncated_checkpoints_are_never_resumed(tmp_path, capsys):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6, 8):
        _store(root, keep=9).save(step, _registry(0, 1, step))
    (root / tag_for(8) / MARKER).unlink()  # a crash before the commit of step 8
    victim = root / tag_for(6) / "rank_00000.safetensors"  # one byte flipped in step 6, size unchanged
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    truncated = root / tag_for(4) / "rank_00000.json"
    truncated.write_bytes(truncated.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors: sha256 differs"):
        verify(root / tag_for(6))
    assert verify(root / tag_for(6), checksums=False)["step"] == 6  # sizes alone cannot see it

    store = _store(root, keep=9)
    store.log = print
    assert store.select("auto") == root / tag_for(2)
    out = capsys.readouterr().out
    assert "step_00000006/rank_00000.safetensors: sha256 differs" in out and "aside to step_00000006.corrupt" in out
    assert "step_00000004/rank_00000.json: size" in out and "aside to step_00000004.corrupt" in out
    assert (root / "step_00000006.corrupt").is_dir() and (root / "step_00000004.corrupt").is_dir()
    assert [s for s, _, c in list_checkpoints(root)] == [2, 8]  # bad ones out of the way; 8 never committed
    elsewhere = tmp_path / "elsewhere" / tag_for(6)  # an explicit path is refused, never moved
    shutil.copytree(root / "step_00000006.corrupt", elsewhere)
    with pytest.raises(CheckpointError, match="sha256 differs"):
        _store(root).select(str(elsewhere))
    assert elsewhere.is_dir()
    # the next save of a step that was moved aside writes it afresh
    _store(root, keep=9).save(6, _registry(0, 1, 6))
    assert newest_complete(root, checksums=True) == root / tag_for(6)
    assert _store(root).remove_incomplete() == [root / tag_for(8)]


def test_retention_removes_the_marker_first(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _store(root, keep=1).save(2, _registry(0, 1, 2))
    monkeypatch.setattr(shutil, "rmtree", lambda p, ignore_errors=False: None)  # a kill during the removal
    _store(root, keep=1).save(4, _registry(0, 1, 4))
    assert (root / tag_for(2)).is_dir() and not (root / tag_for(2) / MARKER).exists()
    assert [s for s, _, c in list_checkpoints(root) if c] == [4]


def test_different_model_is_a_clear_error_and_layouts_are_described(tmp_path):
    root = tmp_path / "ckpt"
    _store(root, model={"n_layer": 2, "d_model": 64}).save(2, _registry(0, 1, 2))
    other = _store(root, model={"n_layer": 2, "d_model": 128})
    with pytest.raises(CheckpointError, match=r"model\.d_model: checkpoint 64 vs config 128"):
        other.check_compatible(root / tag_for(2))
    two = _store(root, world=2, model={"n_layer": 2, "d_model": 64}, outcomes=LocalOutcomes())  # reads only
    _, same, note = two.check_compatible(root / tag_for(2))
    assert not same and "resharding on load" in note and "dp=1 (1 ranks" in note and "dp=2 (2 ranks" in note


# ---- the outcome collective across real processes (gloo) ---------------------------------------------------------
def _failing_rank_in_processes(rank, world, root):
    """Rank 1 cannot write step 4 (sync, then async saves), then hangs in its write of step 6 past the timeout."""
    import time

    import torch.distributed as dist

    for async_save in (False, True):
        where = Path(root) / ("async" if async_save else "sync")
        store = CheckpointStore(
            where,
            rank,
            world,
            2,
            RunMeta({}, precision="fp32"),
            barrier=dist.barrier,
            async_save=async_save,
            commit_timeout_s=3,
            log=lambda m: None,
        )
        store.faults = FaultPoints(rank, {"MEGAMEMO_FAULT_FAIL_WRITE": "4:1"})
        store.save(2, _registry(rank, world, 2))
        store.finish()
        t0 = time.monotonic()
        with pytest.raises(SaveFailed) as e:
            store.save(4, _registry(rank, world, 4))
            while not store.failed():  # async: what the training loop polls every step
                assert time.monotonic() - t0 < 20
                time.sleep(0.01)
            store.wait()
        assert time.monotonic() - t0 < 20
        assert str(e.value) == (
            f"checkpoint step 4 failed: rank 1 could not write {where / tag_for(4)}/"
            f"rank_00001.safetensors: No space left on device (injected: "
            f"MEGAMEMO_FAULT_FAIL_WRITE); nothing committed"
        )
        assert [s for s, _, c in list_checkpoints(where)] == [2]
    # a hung file system: rank 1's write of step 6 ends only once rank 0 has given up on it (or after 120 s)
    released = Path(root) / "rank-1-write-released"

    def hung(step, path):
        end = time.monotonic() + 120
        while rank == 1 and not released.exists() and time.monotonic() < end:
            time.sleep(0.01)

    store.faults.write = hung
    t0 = time.monotonic()
    with pytest.raises(
        SaveFailed,
        match=r"checkpoint step 6: the ranks' save outcomes did not all arrive .* "
        r"checkpoint.commit_timeout_s=3 s",
    ):
        store.save(6, _registry(rank, world, 6))
        store.wait()
    if rank == 0:
        waited = time.monotonic() - t0
        released.touch()
        assert 3 <= waited < 60, waited  # the timeout, not rank 1's write (120 s)
    assert (Path(root) / "async" / MARKER).exists() is False and newest_complete(Path(root) / "async").name == tag_for(
        2
    )


@pytest.mark.multiproc
def test_a_failing_rank_fails_the_save_on_every_process(tmp_path):
    run_distributed(_failing_rank_in_processes, 2, str(tmp_path), timeout=120)


# ---- fault points (checkpoint/faults.py): what the crash tests and bench/soak.py replay ------------------------
@pytest.mark.parametrize(
    "env, rank, dies_at",
    [
        ({"MEGAMEMO_FAULT_KILL_AT": "step:3"}, 1, ("step", 3, "SIGKILL")),  # any rank, its 3rd pass
        ({"MEGAMEMO_FAULT_KILL_AT": "step:3:0"}, 1, None),  # only rank 0
        ({"MEGAMEMO_FAULT_KILL_AT": "step:3:0"}, 0, ("step", 3, "SIGKILL")),
        ({"MEGAMEMO_FAULT_STOP_AT": "start-up:1:1"}, 1, ("start-up", 1, "SIGSTOP")),
        ({"MEGAMEMO_FAULT_KILL_AT": "commit:2", "MEGAMEMO_FAULT_STOP_AT": "step:2:1"}, 1, ("step", 2, "SIGSTOP")),
        ({}, 0, None),
    ],
)
def test_a_fault_point_fires_at_its_count_on_its_rank_only(env, rank, dies_at, monkeypatch, capsys):
    """Each point counts its own passes in the process; with a rank, only that rank acts; KILL_AT kills, STOP_AT stops
    (the soak then kills the whole job from outside)."""
    import signal

    from megamemo.checkpoint import faults

    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(signal.Signals(sig).name))
    points = FaultPoints(rank, env)
    seen = None
    for n in range(1, 6):
        for point in ("start-up", "step", "save"):
            if point == "start-up" and n > 1:
                continue
            points.at(point, step=n)
            if sent and seen is None:
                seen = (point, n, sent[0])
    assert seen == dies_at and len(sent) == (dies_at is not None)
    if dies_at:
        verb = "kills" if dies_at[2] == "SIGKILL" else "stops"
        assert capsys.readouterr().out == f"[fault] rank {rank} {verb} itself at {dies_at[0]} #{dies_at[1]}\n"
    with pytest.raises(ValueError, match="MEGAMEMO_FAULT_STOP_AT: unknown point 'lunch'"):
        FaultPoints(0, {"MEGAMEMO_FAULT_STOP_AT": "lunch:1"})
