"""The checkpoint layer on its own: the layout-free description (pieces written by one layout, read back by
another, against plain slicing of the global tensor), the registry's round trip, and the store's commit protocol,
checksums, retention and move-aside, with ranks as threads."""
from __future__ import annotations

import json
import random
import shutil
import threading

import numpy as np
import pytest
import torch

from megamemo.checkpoint.pieces import Piece, PieceError, ShardedReader, write_pieces
from megamemo.checkpoint.state import (Counters, LoadContext, RNGState, StateRegistry, rank_files, save_snapshot)
from megamemo.checkpoint.store import (MARKER, CheckpointError, CheckpointStore, list_checkpoints, newest_complete,
                                       tag_for, verify)
from megamemo.parallel.tensor import global_box, shard_tensor


# ---- pieces --------------------------------------------------------------------------------------------------
def _zero_fragments(n: int, dp: int, rng: random.Random) -> list[tuple[int, int]]:
    """Uneven contiguous ranges tiling [0, n), as ZeRO's flat partitions cut a parameter."""
    cuts = sorted(rng.sample(range(1, n), dp - 1)) if dp > 1 else []
    edges = [0, *cuts, n]
    return [(a, b) for a, b in zip(edges, edges[1:])]


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
    assert torch.equal(reader.read("exp_avg/w"), g)                                # whole (to-single)
    assert torch.equal(reader.read("exp_avg/w", ((3, 6), (0, 10))), g[3:6])        # TP=4 on the other dim
    assert torch.equal(reader.read("exp_avg/w", ((0, 12), (4, 9))), g[:, 4:9])     # a box across both TP shards
    box = ((0, 12), (0, 5))                                                        # a new ZeRO fragment of a box
    assert torch.equal(reader.read("exp_avg/w", box, (7, 41)), g[:, :5].reshape(-1)[7:41])


def test_the_same_layout_reads_exactly_its_own_piece(tmp_path, monkeypatch):
    g = torch.arange(40.0).view(8, 5)
    files = _write_tp_dp(tmp_path, "m", g, dim=0, tp=2, dp=2, seed=3)
    reader = ShardedReader(files)
    entry = sorted(reader.entries["m"], key=lambda e: (e.box, e.flat))[1]           # tp 0, dp 1's fragment
    monkeypatch.setattr(ShardedReader, "_assemble", lambda *a: pytest.fail("assembled instead of read"))
    got = reader.read("m", entry.box, entry.flat)
    assert torch.equal(got, g[:4].reshape(-1)[entry.flat[0]:entry.flat[1]])


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
        ShardedReader([files[0], files[2], files[3]]).read("w")                  # a ZeRO partition file lost
    with pytest.raises(PieceError, match=r"cover 12 of the 24 values"):
        ShardedReader(files[:2]).read("w")                                       # a TP shard lost
    dup = tmp_path / "dup.safetensors"
    write_pieces(dup, [Piece("x", g, (6, 4)), Piece("x", g.clone(), (6, 4))])
    with pytest.raises(PieceError, match="written twice"):
        ShardedReader([dup]).read("x")
    with pytest.raises(PieceError, match="does not fit box"):
        write_pieces(tmp_path / "bad.safetensors", [Piece("y", g, (6, 4), ((0, 3), (0, 4)))])


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
        return [Piece("t", self.full[self.rank * per:(self.rank + 1) * per], (4, 3),
                      ((self.rank * per, (self.rank + 1) * per), (0, 3)))]

    def load_pieces(self, ctx: LoadContext):
        self.loaded = ctx.reader.read("t")


def test_registry_round_trip_is_exact_and_pickle_free(tmp_path):
    torch.manual_seed(0)
    full = torch.randn(4, 3)
    value = {"cursor": {"epoch": 1, "step": 7}, "nested": [1, 2.5, None, "x"], "t": torch.randn(2, 2).bfloat16()}
    regs = []
    for r in range(2):                                    # two ranks write; a one-rank layout reads
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
    torch.manual_seed(9)                                  # another layout: rank-scope state is left alone
    reg2.load(tmp_path, 0, lambda reader: LoadContext(reader, same_layout=False, marker={}))
    assert torch.equal(torch.rand(3), (torch.manual_seed(9), torch.rand(3))[1])


def test_registry_refuses_missing_entries(tmp_path):
    reg = StateRegistry()
    reg.register("a", Box({"x": 1}))
    save_snapshot(reg.snapshot(0), tmp_path)
    other = StateRegistry()
    other.register("b", Box(None))
    with pytest.raises(RuntimeError, match=r"state entries missing: \['b'\]"):
        other.load(tmp_path, 0, lambda reader: LoadContext(reader, True, {}))


# ---- the store --------------------------------------------------------------------------------------------------
def _store(root, rank=0, world=1, keep=2, model=None, barrier=lambda: None, async_save=False):
    meta = {"model": model or {"n_layer": 2}, "layout": {"world_size": world, "dp": world, "batch_size": 4},
            "precision": "fp32"}
    return CheckpointStore(root, rank, world, keep, meta, barrier=barrier, async_save=async_save, commit_timeout_s=30,
                           log=lambda m: None)


def _registry(rank, world, step):
    reg = StateRegistry()
    reg.register("counters", Counters(step=step))
    reg.register_sharded("t", Sharded(rank, world, torch.full((4, 3), float(step))))
    return reg


def _save_as_ranks(root, step, world=2, keep=2, async_save=False):
    """The ranks of a run as threads with a real barrier between them."""
    bar = threading.Barrier(world, timeout=30)
    errors = []

    def rank(r):
        try:
            store = _store(root, rank=r, world=world, keep=keep, barrier=bar.wait, async_save=async_save)
            store.save(step, _registry(r, world, step), files={"extra.txt": lambda p: p.write_text("x")} if r else {})
            store.finish()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("async_save", [False, True])
def test_commit_protocol_checksums_and_retention(tmp_path, async_save):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6):
        _save_as_ranks(root, step, async_save=async_save)
        info = verify(root / tag_for(step))
        assert info["step"] == step and info["world_size"] == 2
        assert set(info["files"]) == {"rank_00000.json", "rank_00000.safetensors", "rank_00001.json",
                                      "rank_00001.safetensors", "extra.txt"}
        assert all(len(f["sha256"]) == 64 for f in info["files"].values())
        reader = ShardedReader(sorted((root / tag_for(step)).glob("rank_*.safetensors")))
        assert torch.equal(reader.read("t"), torch.full((4, 3), float(step)))
    assert [s for s, _, c in list_checkpoints(root) if c] == [4, 6]          # keep_last=2
    assert newest_complete(root) == root / tag_for(6)
    assert not list(root.rglob("*.tmp"))


def test_rank_zero_does_not_commit_without_the_other_ranks_files(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="rank_00001.json: missing"):
        _store(root, rank=0, world=2).save(2, _registry(0, 2, 2))   # rank 1 never wrote (a barrier that lied)
    assert newest_complete(root) is None


def test_half_written_flipped_or_truncated_checkpoints_are_never_resumed(tmp_path, capsys):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6, 8):
        _store(root, keep=9).save(step, _registry(0, 1, step))
    (root / tag_for(8) / MARKER).unlink()                          # a crash before the commit of step 8
    victim = root / tag_for(6) / "rank_00000.safetensors"          # one byte flipped in step 6, size unchanged
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    truncated = root / tag_for(4) / "rank_00000.json"
    truncated.write_bytes(truncated.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors: sha256 differs"):
        verify(root / tag_for(6))
    verify(root / tag_for(6), checksums=False)                     # sizes alone cannot see it

    store = _store(root, keep=9)
    store.log = print
    assert store.select("auto") == root / tag_for(2)
    out = capsys.readouterr().out
    assert "step_00000006/rank_00000.safetensors: sha256 differs" in out and "aside to step_00000006.corrupt" in out
    assert "step_00000004/rank_00000.json: size" in out and "aside to step_00000004.corrupt" in out
    assert (root / "step_00000006.corrupt").is_dir() and (root / "step_00000004.corrupt").is_dir()
    assert [s for s, _, c in list_checkpoints(root)] == [2, 8]    # bad ones out of the way; 8 never committed
    elsewhere = tmp_path / "elsewhere" / tag_for(6)                # an explicit path is refused, never moved
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
    monkeypatch.setattr(shutil, "rmtree", lambda p, ignore_errors=False: None)   # a kill during the removal
    _store(root, keep=1).save(4, _registry(0, 1, 4))
    assert (root / tag_for(2)).is_dir() and not (root / tag_for(2) / MARKER).exists()
    assert [s for s, _, c in list_checkpoints(root) if c] == [4]


def test_different_model_is_a_clear_error_and_layouts_are_described(tmp_path):
    root = tmp_path / "ckpt"
    _store(root, model={"n_layer": 2, "d_model": 64}).save(2, _registry(0, 1, 2))
    other = _store(root, model={"n_layer": 2, "d_model": 128})
    with pytest.raises(CheckpointError, match=r"model\.d_model: checkpoint 64 vs config 128"):
        other.check_compatible(root / tag_for(2))
    _, same, note = _store(root, world=2, model={"n_layer": 2, "d_model": 64}).check_compatible(root / tag_for(2))
    assert not same and "resharding on load" in note and "dp=1 (1 ranks" in note and "dp=2 (2 ranks" in note
