"""Unit tests of the training system's parts that need no process group: config, rank discovery, LR schedule,
the checkpoint registry and the commit protocol of the store."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megamemo import config as C
from megamemo.checkpoint.state import CheckpointStateError, Counters, RNGState, StateRegistry
from megamemo.checkpoint.store import (CheckpointError, CheckpointStore, list_checkpoints, newest_complete,
                                       tag_for, verify)
from megamemo.model import Memory
from megamemo.train import dist
from megamemo.train.engine import lr_factor

REPO = Path(__file__).resolve().parents[1]


# ---- config ------------------------------------------------------------------------------------------------
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_every_shipped_config_is_checked():
    assert {p.stem for p in CONFIGS} >= {"tiny-cpu", "enwik8-base", "text8-base", "wt103-base", "enwik8-xl",
                                         "wt103-xl", "lamemo-1.3b", "lamemo-7b"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load(path):
    """Every config in configs/ loads, and its parallel layout is one the code accepts: heads, FFN width and
    vocabulary split over tp (the softmax full under tp > 1), layers over pp (the full tied softmax under pp > 1),
    the global batch over one data-parallel replica's micro-batches - and its model builds (on the meta device)."""
    from megamemo.model import MemTransformerLM
    from megamemo.parallel import pipeline, tensor

    cfg = C.load(path)
    m, tp, pp = cfg.model, cfg.parallel.tp, cfg.parallel.pp
    assert cfg.optim.clip >= 0 and cfg.optim.lr > 0 and cfg.train.max_steps > 0
    assert tp >= 1 and pp >= 1 and cfg.parallel.zero_stage in (0, 1, 2)
    tensor.check_supported(m, tp)
    pipeline.check_supported(m, pp)
    assert m.n_head % tp == 0 and m.d_inner % tp == 0 and m.n_token % tp == 0 and m.n_layer >= pp
    assert cfg.layout(tp * pp) == (1, cfg.data.batch_size // cfg.train.grad_accum)
    if cfg.eval.every:
        assert cfg.eval.batch_size >= 1
    with torch.device("meta"):
        model = MemTransformerLM(m)
    assert model.cfg.variant == m.variant and len(model.layers) == m.n_layer
    if tp == 1 and pp == 1:
        assert cfg.precision.dtype in ("fp32", "bf16", "fp16")
    else:   # the large configs: a cluster layout, and a header naming the cluster `megamemo plan` checks
        assert f"megamemo plan --config configs/{path.name}" in path.read_text()


def test_large_configs_have_their_documented_shapes():
    b = C.load(REPO / "configs" / "lamemo-1.3b.yaml")
    assert (b.model.n_layer, b.model.d_model, b.model.n_head, b.model.d_inner) == (24, 2048, 16, 8192)
    assert (b.parallel.tp, b.parallel.pp, b.precision.dtype) == (2, 1, "fp16")
    s = C.load(REPO / "configs" / "lamemo-7b.yaml")
    assert (s.model.n_layer, s.model.d_model, s.model.n_head, s.model.d_inner) == (32, 4096, 32, 16384)
    assert (s.parallel.tp, s.parallel.pp, s.precision.dtype) == (4, 2, "bf16")


def test_paper_configs_have_paper_shapes():
    e = C.load(REPO / "configs" / "enwik8-base.yaml")
    assert (e.model.n_layer, e.model.d_model, e.model.tgt_len, e.model.mem_len) == (12, 512, 512, 512)
    assert (e.optim.lr, e.optim.clip) == (2.5e-4, 0.25)
    w = C.load(REPO / "configs" / "wt103-base.yaml")
    assert (w.model.n_layer, w.model.d_model, w.model.tgt_len, w.model.mem_len) == (16, 410, 150, 150)


@pytest.mark.parametrize("override, names", [
    ("optim.lrr=1", "optim.lrr"),
    ("optim.lr=fast", "optim.lr"),
    ("model.n_layer=two", "model.n_layer"),
    ("model.bogus=1", "model.bogus"),
    ("train.grad_accum=true", "train.grad_accum"),
    ("precision.dtype=fp8", "precision.dtype"),
    ("parallel.tp=3", "model.n_head=2 is not divisible by tp=3"),
    ("parallel.pp=0", "parallel.pp"),
    ("parallel.zero_stage=3", "parallel.zero_stage"),
    ("nosection.x=1", "nosection"),
])
def test_bad_config_values_name_the_field(override, names):
    with pytest.raises(C.ConfigError, match=names.replace(".", r"\.")):
        C.load(REPO / "configs" / "tiny-cpu.yaml", [override])


def test_bad_key_in_yaml_file_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  n_layer: 2\noptim:\n  learning_rate: 0.1\n")
    with pytest.raises(C.ConfigError, match=r"optim\.learning_rate: unknown field"):
        C.load(p)


def test_overrides_and_round_trip(tmp_path):
    cfg = C.load(REPO / "configs" / "tiny-cpu.yaml", ["optim.lr=1e-4", "optim.betas=[0.9, 0.98]", "eval.tgt_len=null",
                                                     "data.dir=/x y/z"])
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == [0.9, 0.98] and cfg.eval.tgt_len is None
    p = tmp_path / "resolved.yaml"
    p.write_text(cfg.to_yaml())
    again = C.load(p)
    assert again.to_dict() == cfg.to_dict()
    assert again.model_fingerprint() == cfg.model_fingerprint()


def test_layout_splits_the_global_batch():
    cfg = C.load(REPO / "configs" / "tiny-cpu.yaml", ["data.batch_size=8", "train.grad_accum=2"])
    assert cfg.layout(1) == (1, 4) and cfg.layout(2) == (2, 2) and cfg.layout(4) == (4, 1)
    with pytest.raises(C.ConfigError, match="data.batch_size"):
        cfg.layout(3)
    cfg = C.load(REPO / "configs" / "tiny-cpu.yaml", ["data.batch_size=8", "eval.every=10", "eval.batch_size=6"])
    with pytest.raises(C.ConfigError, match="eval.batch_size"):
        cfg.layout(4)


# ---- rank discovery ----------------------------------------------------------------------------------------
def test_discover_torchrun_env():
    d = dist.discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.launcher) == (3, 4, 1, "h", 1234, "env")


def test_discover_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-08,10]"}
    d = dist.discover(env)
    assert (d.rank, d.world_size, d.local_rank, d.launcher) == (5, 8, 1, "slurm")
    assert d.master_addr == "gpu07"
    assert d.master_port == dist.slurm_port("4242") == dist.discover(dict(env, SLURM_PROCID="0")).master_port
    # srun with a PMI plugin: PMI_RANK agrees with SLURM_PROCID, so the Slurm mapping is used without MPI
    assert dist.discover(dict(env, PMI_RANK="5", PMI_SIZE="8")).launcher == "slurm"


def test_expand_nodelist_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert dist.expand_nodelist("a1,b[1-2],c-[08-09]-x") == ["a1", "b1", "b2", "c-08-x", "c-09-x"]


def test_mpirun_inside_sbatch_is_not_taken_for_srun():
    # mpirun in a batch script: every rank inherits SLURM_PROCID=0; the MPI ranks must win
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}
    assert dist._mpirun_inside_slurm(env)
    assert dist._mpirun_inside_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_RANK": "0"})


def test_discover_under_mpirun(tmp_path):
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun in the environment")
    script = tmp_path / "d.py"
    script.write_text("import sys, pathlib\nfrom megamemo.train import dist\nd = dist.discover()\n"
                      "pathlib.Path(sys.argv[1], f'rank{d.rank}').write_text("
                      "f'{d.rank} {d.world_size} {d.local_rank} {d.master_addr} {d.master_port} {d.launcher}')\n")
    out = subprocess.run([str(mpirun), "-np", "2", sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = sorted(p.read_text().split() for p in tmp_path.glob("rank*"))
    assert [r[:3] for r in rows] == [["0", "2", "0"], ["1", "2", "1"]]
    assert rows[0][3:] == rows[1][3:] and rows[0][5] == "mpi"      # same master address and port everywhere


# ---- schedule ----------------------------------------------------------------------------------------------
def test_lr_schedule_matches_torch_cosine_and_warms_up():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50, eta_min=0.1)
    for s in range(50):
        assert lr_factor(s, 0, 50, "cosine", 0.1) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        cos.step()
    assert [lr_factor(s, 4, 50, "cosine", 0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(50, 4, 50, "cosine", 0.0) == 0.0 and lr_factor(70, 4, 50, "cosine", 0.0) == 0.0
    assert lr_factor(30, 4, 50, "constant", 0.0) == 1.0


# ---- registry ----------------------------------------------------------------------------------------------
class Box:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, d):
        self.value = d


def test_registry_round_trip_is_exact_and_pickle_free(tmp_path):
    torch.manual_seed(0)
    mem = Memory({"emb": torch.randn(3, 2, 4).bfloat16(), "lse.0": torch.randn(3, 2, 2)}, batch_size=2)
    mem_view = Memory({"hid.0": torch.randn(6, 4, 4)[2:5, 1:3]}, batch_size=2)     # a non-contiguous view
    reg = StateRegistry()
    box = Box({"memory": {"mb0": mem.state_dict(), "mb1": mem_view.state_dict()},
               "cursor": {"epoch": 1, "step": 7, "split": "train"}, "nested": [1, 2.5, None, "x"]})
    reg.register("box", box)
    rng = RNGState()
    reg.register("rng", rng)
    counters = Counters(step=12, skipped=1)
    reg.register("counters", counters)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    files = reg.save_rank(tmp_path, rank=0, extra={"layout": {"columns": [0, 2]}})
    expect = (random.random(), np.random.rand(), torch.rand(3))

    # the files hold no pickle: JSON + safetensors only
    assert {f.suffix for f in files} == {".json", ".safetensors"}
    assert json.loads((tmp_path / "rank_00000.json").read_text())["layout"] == {"columns": [0, 2]}

    fresh = Box(None)
    reg2 = StateRegistry()
    reg2.register("box", fresh)
    reg2.register("rng", RNGState())
    c2 = Counters(step=0, skipped=0)
    reg2.register("counters", c2)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    reg2.load_rank(tmp_path, rank=0)
    assert (random.random(), np.random.rand()) == expect[:2] and torch.equal(torch.rand(3), expect[2])
    assert c2.state_dict() == {"step": 12, "skipped": 1}
    assert fresh.value["cursor"] == box.value["cursor"] and fresh.value["nested"] == [1, 2.5, None, "x"]
    back = Memory.from_state_dict(fresh.value["memory"]["mb0"])
    assert back.equal(mem) and back["emb"].dtype == torch.bfloat16
    assert Memory.from_state_dict(fresh.value["memory"]["mb1"]).equal(mem_view)


def test_registry_refuses_missing_entries(tmp_path):
    reg = StateRegistry()
    reg.register("a", Box({"x": 1}))
    reg.save_rank(tmp_path, 0)
    other = StateRegistry()
    other.register("b", Box(None))
    with pytest.raises(CheckpointStateError, match=r"missing \['b'\], unexpected \['a'\]"):
        other.load_rank(tmp_path, 0)


# ---- store: commit protocol, newest complete, retention ---------------------------------------------------
class FakeSharded:
    """Writes a file per rank the way DeepSpeed does (into root/tag), to exercise the store without it."""

    def __init__(self, rank):
        self.rank = rank
        self.loaded = None

    def save_sharded(self, root, tag):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / f"optim_{self.rank}.bin").write_bytes(bytes(100 + self.rank))

    def load_sharded(self, root, tag):
        self.loaded = tag


def _store(root, rank=0, world=1, keep=2, model=None, barrier=lambda: None):
    meta = {"model": model or {"n_layer": 2}, "layout": {"dp": world}, "precision": "fp32"}
    return CheckpointStore(root, rank, world, keep, meta, barrier=barrier)


def _registry(rank, step):
    reg = StateRegistry()
    reg.register_sharded("engine", FakeSharded(rank))
    reg.register("counters", Counters(step=step))
    return reg


def _save_as_two_ranks(root, step, keep=2):
    """Two ranks as two threads with a real barrier between them, as the processes of a run."""
    bar = threading.Barrier(2, timeout=30)
    errors = []

    def rank(r):
        try:
            _store(root, rank=r, world=2, keep=keep, barrier=bar.wait).save(step, _registry(r, step))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_commit_protocol_and_retention(tmp_path):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6):
        _save_as_two_ranks(root, step)
        info = verify(root / tag_for(step))
        assert info["step"] == step and info["world_size"] == 2
        assert {"megamemo/rank_00000.json", "megamemo/rank_00001.safetensors", "optim_1.bin"} <= set(info["files"])
    assert [s for s, _, c in list_checkpoints(root) if c] == [4, 6]          # keep_last=2
    assert newest_complete(root) == root / tag_for(6)
    assert not list(root.rglob("*.tmp"))


def test_rank_zero_does_not_commit_without_the_other_ranks_files(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="rank_00001"):
        _store(root, rank=0, world=2).save(2, _registry(0, 2))   # rank 1 never wrote (a barrier that lied)
    assert newest_complete(root) is None


def test_half_written_checkpoint_is_never_resumed(tmp_path):
    root = tmp_path / "ckpt"
    _store(root, world=1, keep=5).save(2, _registry(0, 2))
    # a crash during the save of step 4: files written, no marker
    FakeSharded(0).save_sharded(root, tag_for(4))
    _registry(0, 4).save_rank(root / tag_for(4) / "megamemo", 0)
    assert newest_complete(root) == root / tag_for(2)
    with pytest.raises(CheckpointError, match="not committed"):
        verify(root / tag_for(4))
    # a committed checkpoint whose file was truncated afterwards is refused too
    _store(root, world=1, keep=5).save(6, _registry(0, 6))
    victim = root / tag_for(6) / "optim_0.bin"
    victim.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="optim_0.bin"):
        verify(root / tag_for(6))
    assert newest_complete(root) == root / tag_for(2)
    # the next save of step 4 replaces the incomplete directory and commits it; step 6 is newer but broken
    _store(root, world=1, keep=5).save(4, _registry(0, 4))
    assert newest_complete(root) == root / tag_for(4)
    # start-up clean-up removes never-committed directories only
    FakeSharded(0).save_sharded(root, tag_for(8))
    assert _store(root).remove_incomplete() == [root / tag_for(8)]
    assert [s for s, _, c in list_checkpoints(root)] == [2, 4, 6]


def test_different_model_is_a_clear_error(tmp_path):
    root = tmp_path / "ckpt"
    _store(root, model={"n_layer": 2, "d_model": 64}).save(2, _registry(0, 2))
    other = _store(root, model={"n_layer": 2, "d_model": 128})
    with pytest.raises(CheckpointError, match=r"model\.d_model: checkpoint 64 vs config 128"):
        other.load(root / tag_for(2), _registry(0, 0))
    with pytest.raises(CheckpointError, match="layout"):
        _store(root, world=2, model={"n_layer": 2, "d_model": 64}).check_compatible(root / tag_for(2))
