"""`megamemo convert` and resuming under another layout, on real multi-process checkpoints (fp32 on CPU, gloo):
* TP=2, PP=2 and TP=2 x PP=2 runs convert to one single-device model whose per-token NLL over the 3 probe segments,
  from the converted memory of the same streams, equals what the sharded model computed during training (within
  rounding: tests/helpers/bounds.py);
* `megamemo train` started in a run directory under another layout resumes in place, resharding on load:
  N ranks -> 1 (TP=2, DP=2, PP=2, TP=2 x PP=2), 1 -> N (TP=2, DP=2) and TP=2 -> PP=2; the next steps' losses and
  the final weights equal those of the run that stayed in its layout (up to rounding's drift), dropout 0.1 and
  dropatt 0.1 with keyed
  masks (helpers/runs_cache.py KEYED: the resumed layout drops what the original one would have); `convert relayout`
  copies a checkpoint
  into a new run directory that resumes the same way;
* a different global batch resumes at the same fraction of the epoch with empty memory (checked by hand);
* broken checkpoints (missing, truncated or flipped file, wrong config, a piece written twice, memory of the wrong
  heads) are refused with the file named and nothing written at --out."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.bounds import drift_bound, forward_bound, weight_drift
from helpers.runs_cache import KEYED
from safetensors import safe_open
from safetensors.torch import load_file
from test_train_runs import ONE_PROCESS_EXACT, logs, losses, run

from megamemo import cli
from megamemo.commands import convert as convert_cmd
from megamemo.interop import convert, load
from megamemo.kernels import DropoutKey, apply_dropout_masks
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.util.files import file_sha256

# starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset); tolerances from rounding
pytestmark = [pytest.mark.multiproc, pytest.mark.numerics]

EXACT = ["--max-steps", "6", *KEYED, "--set", "log.tensorboard=false"]


def _train(tmp_path_factory, tiny_cfg, shards, name, n, *args):
    run_dir = tmp_path_factory.mktemp(name) / "run"
    run(n, tiny_cfg, shards, run_dir, *args, *EXACT, timeout=120 * n)
    return run_dir


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, tiny_cfg, shards):
    return _train(tmp_path_factory, tiny_cfg, shards, "tp2", 2, "--tp", "2")


@pytest.fixture(scope="module")
def pp2(tmp_path_factory, tiny_cfg, shards):
    return _train(tmp_path_factory, tiny_cfg, shards, "pp2", 2, "--pp", "2")


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory, tiny_cfg, shards):
    return _train(tmp_path_factory, tiny_cfg, shards, "tp2pp2", 4, "--tp", "2", "--pp", "2")


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, tiny_cfg, shards):
    return _train(tmp_path_factory, tiny_cfg, shards, "dp2", 2)


def step_dir(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def recorded_probe(step):
    """The probe the training run wrote (independently of the conversion code)."""
    with safe_open(str(step / "probe.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["probe"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    return meta, [(t[f"inputs.{i}"], t[f"targets.{i}"], t[f"nll.{i}"]) for i in range(meta["segments"])]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2pp2"])
def test_sharded_checkpoint_converts_to_the_same_model(layout, request, tmp_path):
    run_dir = request.getfixturevalue(layout)
    out = tmp_path / "single"
    assert convert_cmd.main(["to-single", "--ckpt", str(run_dir), "--out", str(out), "--memory", "all"]) == 0
    meta, segments = recorded_probe(step_dir(run_dir, 6))
    assert meta["layout"] == {"dp": 1, "tp": 2 if "tp2" in layout else 1, "pp": 2 if "pp2" in layout else 1}
    assert len(segments) == 3 and not meta["empty_start"]

    # the converted directory, loaded by hand as the README shows
    doc = json.loads((out / "config.json").read_text())
    model = MemTransformerLM(ModelConfig(**doc["model"])).eval()
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    memory = Memory.from_state_dict(load_file(str(out / "memory.safetensors")))
    assert memory.batch_size == 4 and memory.length == 16 and doc["meta"]["memory_columns"] == [0, 1, 2, 3]
    c0, c1 = meta["columns"]
    mem = memory.select_batch(slice(c0, c1))
    worst, without_memory = 0.0, 0.0
    with torch.no_grad():
        empty = None
        for x, y, sharded_nll in segments:
            nll, mem = model(x, y, mem)
            nll0, empty = model(x, y, empty)
            worst = max(worst, float((nll - sharded_nll).abs().max()))
            without_memory = max(without_memory, float((nll0 - sharded_nll).abs().max()))
    # the same weights in another layout: two orders of the forward pass's fp32 sums over the 3 segments the memory
    # carried (tests/helpers/bounds.py), at the NLLs' size; the memory matters beyond that, and the tool's own check too
    tol = 3 * forward_bound(model.cfg, max(float(t.abs().max()) for _, _, t in segments))
    assert worst <= tol, (worst, tol)
    assert without_memory > tol
    assert doc["meta"]["check"]["max_abs_diff"] <= tol

    # eval / generate read the run directory directly: the same weights
    in_memory, _ = load.load_model(run_dir)
    sd = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(in_memory.state_dict()[k], v) for k, v in sd.items())


@pytest.fixture
def one(tiny_cfg, shards, reference_runs):
    """One process with EXACT's settings (and a validation at step 6, which changes no training loss): the session's
    one-process reference (tests/helpers/runs_cache.py ONE_PROCESS_EXACT), copied before any test writes to it."""
    return reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT)


def _resume_in_place(src, tmp_path, tiny_cfg, shards, n, *args):
    """A copy of run `src` cut back to its step-3 checkpoint (as if it had stopped there), then `megamemo train`
    in that directory on n ranks with other layout arguments."""
    new = tmp_path / "run"
    shutil.copytree(src, new)
    for s in (6,):
        shutil.rmtree(step_dir(new, s))
    run(n, tiny_cfg, shards, new, *EXACT, *args, timeout=120 * n)
    return new


@pytest.mark.parametrize(
    "layout,n,extra",
    [
        ("dp2", 1, ["--set", "train.grad_accum=2"]),
        ("tp2", 1, []),  # N -> 1
        ("tp2pp2", 1, []),  # N -> 1 (TP and PP joined at once)
        ("one", 2, ["--tp", "2"]),
        ("one", 2, ["--set", "train.grad_accum=2"]),
        ("one", 2, ["--pp", "2"]),  # 1 -> N
        ("tp2", 2, ["--pp", "2"]),
    ],
)  # TP -> PP
def test_resume_in_place_under_another_layout_continues_the_run(layout, n, extra, request, tiny_cfg, shards, tmp_path):
    """Saved at step 3 under one layout, resumed in the same run directory under another: steps 4-6 and the
    step-6 weights equal the original run's (the same global batch)."""
    src = request.getfixturevalue(layout)
    new = _resume_in_place(src, tmp_path, tiny_cfg, shards, n, *extra)
    assert "resharding on load" in logs(new) and "resumed from" in logs(new)
    want, got = losses(src), losses(new)
    assert sorted(got) == list(range(1, 7))
    # the layouts' sums run in other orders: the step-6 weights drift apart by rounding (rho, tests/helpers/bounds.py;
    # < 1e-3: not a run gone elsewhere), which bounds steps 4-6's losses by drift_bound
    a, _ = load.load_model(step_dir(src, 6))
    b, _ = load.load_model(step_dir(new, 6))
    rho = weight_drift(a.state_dict(), b.state_dict())
    assert rho < 1e-3, rho
    assert all(abs(got[s] - want[s]) <= drift_bound(a.cfg, rho, want[s]) for s in (4, 5, 6)), (got, want, rho)


def test_relayout_copies_a_checkpoint_that_resumes_under_any_layout(tp2, tiny_cfg, shards, tmp_path):
    new = tmp_path / "relaid"
    assert convert_cmd.main(["relayout", "--ckpt", str(step_dir(tp2, 3)), "--out", str(new)]) == 0
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == ["step_00000003"]
    run(1, tiny_cfg, shards, new, *EXACT)
    assert "resharding on load" in logs(new)
    want, got = losses(tp2), losses(new)
    # as above: the step-6 weights' drift bounds the losses
    a, _ = load.load_model(step_dir(tp2, 6))
    rho = weight_drift(a.state_dict(), load.load_model(step_dir(new, 6))[0].state_dict())
    assert rho < 1e-3, rho
    assert sorted(got) == [4, 5, 6] and all(abs(got[s] - want[s]) <= drift_bound(a.cfg, rho, want[s]) for s in got)


def test_another_global_batch_restarts_streams_with_empty_memory(tp2, tiny_cfg, shards, tmp_path):
    from megamemo.data import StreamReader

    new = _resume_in_place(tp2, tmp_path, tiny_cfg, shards, 1, "--set", "data.batch_size=2")
    assert "global batch 4 -> 2 streams" in logs(new)
    # by hand: the step-3 weights, the same fraction of the epoch in the 2-column cut, empty memory, and the masks
    # keyed dropout draws at step 3 (train.seed 1111) for global columns 0 and 1
    old = StreamReader(shards, "train", 4, 16).steps_per_epoch
    reader = StreamReader(shards, "train", 2, 16, roll=True, seed=1111, epochs=None)
    pos = 3 * reader.steps_per_epoch // old
    x, y = reader.get_batch(0, pos)
    model, _ = load.load_model(step_dir(tp2, 3))
    apply_dropout_masks(model.train(), "keyed", DropoutKey(1111).set(step=3))
    with torch.no_grad():
        nll, _ = model(x, y, None)
    # the same weights and masks, one process against one: two orders of the forward pass, per token relative to its
    # (positive) NLL and so to the mean (tests/helpers/bounds.py)
    assert abs(float(nll.mean()) - losses(new)[4]) <= forward_bound(model.cfg, float(nll.mean()))
    state = json.loads((step_dir(new, 6) / "rank_00000.json").read_text())["state"]["data"]
    assert (state["epoch"], state["step"], state["batch_size"]) == (0, pos + 3, 2)


# ---- broken inputs ------------------------------------------------------------------------------------------------
def _recommit(step):
    """Record the damaged files' sizes and sha256 in the marker, so that our own checks (not the checksums) meet
    the damage."""
    marker = json.loads((step / "COMMITTED").read_text())
    for rel in marker["files"]:
        p = step / rel
        marker["files"][rel] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    (step / "COMMITTED").write_text(json.dumps(marker))


def _damage_missing(s):
    (s / "rank_00001.safetensors").unlink()
    return "rank_00001.safetensors: listed in"


def _damage_truncated(s):
    f = s / "rank_00001.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    return "rank_00001.safetensors: size"


def _damage_flipped(s):
    f = s / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    return "rank_00000.safetensors: sha256 differs"


def _damage_config(s):
    marker = json.loads((s / "COMMITTED").read_text())
    marker["model"]["d_inner"] = 96
    (s / "COMMITTED").write_text(json.dumps(marker))
    return "COMMITTED: the model config does not match the weights"


def _damage_twice(s):
    """A checkpoint of format 2 (no merged index: read through every rank file's header) whose rank 1 file is
    a copy of rank 0's."""
    marker = json.loads((s / "COMMITTED").read_text())
    (s / marker.pop("index")).unlink()
    del marker["files"]["index.json"]
    marker["format"] = 2
    (s / "COMMITTED").write_text(json.dumps(marker))
    shutil.copyfile(s / "rank_00000.safetensors", s / "rank_00001.safetensors")
    _recommit(s)
    return "written twice"


def _damage_replaced(s):
    """The same copy in a checkpoint of format 3: the file contradicts the merged index."""
    shutil.copyfile(s / "rank_00000.safetensors", s / "rank_00001.safetensors")
    _recommit(s)
    return "rank_00001.safetensors: its pieces differ from the ones"


def _damage_memory_heads(s):
    """The two TP ranks' LaMemo context caches swapped: every file is intact and every piece well formed, but the
    memory's heads are in the wrong order; only the NLL check can tell."""
    from safetensors.torch import save_file

    files = [s / f"rank_{r:05d}.safetensors" for r in range(2)]
    data, meta = [], []
    for f in files:
        with safe_open(str(f), "pt") as h:
            meta.append(h.metadata())
            data.append({k: h.get_tensor(k) for k in h.keys()})
    keys = [k for k in data[0] if k.startswith("memory/ctx.")]
    assert keys
    for k in keys:
        data[0][k], data[1][k] = data[1][k], data[0][k]
    for f, d, m in zip(files, data, meta, strict=True):
        save_file(d, str(f), metadata=m)
    _recommit(s)
    return "per-token NLL differs"


@pytest.mark.parametrize(
    "damage",
    [
        _damage_missing,
        _damage_truncated,
        _damage_flipped,
        _damage_config,
        _damage_twice,
        _damage_replaced,
        _damage_memory_heads,
    ],
    ids=lambda f: f.__name__[len("_damage_") :],
)
def test_broken_checkpoint_is_refused_by_name(damage, tp2, tmp_path, capsys):
    s = tmp_path / "checkpoints" / "step_00000006"
    shutil.copytree(step_dir(tp2, 6), s)
    expect = damage(s)
    # relayout copies what verifies (sizes, sha256); to-single also reads and checks every piece and the probe
    checksum_level = damage in (_damage_missing, _damage_truncated, _damage_flipped)
    for cmd in ("to-single", "relayout") if checksum_level else ("to-single",):
        out = tmp_path / f"out-{cmd}"
        assert cli.run_command("convert", convert_cmd.main, [cmd, "--ckpt", str(s), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert expect in err, (cmd, err)
        assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
        assert not list(tmp_path.glob(f".{out.name}.*"))  # util.files.atomic_directory's temporary name


def test_bf16_tensor_parallel_checkpoint_checks_within_the_bf16_tolerance(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "run"
    run(2, tiny_cfg, shards, run_dir, "--tp", "2", "--set", "precision.dtype=bf16", *EXACT, "--max-steps", "3")
    out = tmp_path / "single"
    assert convert_cmd.main(["to-single", "--ckpt", str(run_dir), "--out", str(out)]) == 0
    check = json.loads((out / "config.json").read_text())["meta"]["check"]
    assert check["precision"] == "bf16" and check["max_abs_diff"] <= 0.1 and check["mean_abs_diff"] <= 0.01
    # the fp32 masters, not the bf16 copies: conversion gathered them from the ZeRO optimizer files
    sd = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in sd.values())


def test_to_single_reports_progress_tensor_by_tensor(tp2, tmp_path):
    lines = []
    convert.to_single(
        tp2, convert.ToSingle(out=str(tmp_path / "single"), no_check=True), log=lines.append, progress_every=0
    )
    pat = re.compile(r"\[convert\] ([\d.,]+)M of ([\d.,]+)M parameters written, (\S+)")
    got = [pat.fullmatch(ln) for ln in lines if ln.startswith("[convert]")]
    sd = load_file(str(tmp_path / "single" / "model.safetensors"))
    total = sum(v.numel() for v in sd.values())
    assert len(got) == len(sd) and all(got), lines
    assert [m.group(3) for m in got] == list(sd)  # in file order, one line per tensor
    assert got[-1].group(1) == got[-1].group(2) == f"{total / 1e6:,.1f}"


def _rng_of(step: Path, rank: int) -> dict:
    """The RNG streams rank `rank` saved in a checkpoint (its `rng` state: python, numpy, torch, the TP stream)."""
    from megamemo.checkpoint.pieces import read_local
    from megamemo.checkpoint.state import join_tensors, rank_files, read_json

    st, js = rank_files(rank)
    return join_tensors(read_json(step / js)["state"]["rng"], read_local(step / st), str(step / js))


def _seed_of(generator_state: torch.Tensor) -> int:
    """The seed a torch CPU generator state was started from (its state carries it, however far it has drawn)."""
    g = torch.Generator()
    g.set_state(generator_state)
    return g.initial_seed()


def test_a_resume_under_another_layout_with_dropout_reseeds_every_stream(tiny_cfg, shards, reference_runs, tmp_path):
    """With dropout on (TINY's 0.1): the 2-rank data-parallel reference cut back to its step-3 checkpoint, resumed in
    place under TP 2. A new layout cannot replay the old ranks' masks, so (README, Checkpoints: "Dropout streams are
    re-seeded") each rank seeds its streams as a fresh start does, salted with the step (train.loop.seed_streams,
    parallel.groups.dropout_seeds(seed, dp, tp, pp, step)): the default streams (torch, python, numpy) shared by the
    TP ranks of the group, the TP stream its own. What each rank saved at step 4 shows the seeds it drew from; the
    step-3 checkpoint shows the old ranks' (salt 0, one per DP rank), none of them reused."""
    import random

    import numpy as np
    from helpers.runs_cache import TWO_RANKS_12_STEPS

    from megamemo.parallel.groups import TP_RNG, dropout_seeds
    from megamemo.train.config import load

    src = reference_runs.get(2, tiny_cfg, shards, *TWO_RANKS_12_STEPS)
    new = tmp_path / "run"
    shutil.copytree(src, new)
    for s in (6, 9, 12):
        shutil.rmtree(step_dir(new, s))
    run(
        2, tiny_cfg, shards, new, "--tp", "2", "--max-steps", "4", "--save-every", "1", "--set", "log.tensorboard=false"
    )
    assert "resharding on load" in logs(new) and f"resumed from {step_dir(new, 3)}" in logs(new)
    seed = load(tiny_cfg).train.seed
    assert load(tiny_cfg).model.dropout == 0.1
    old = [_seed_of(_rng_of(step_dir(src, 3), r)["torch"]) for r in (0, 1)]
    assert old == [dropout_seeds(seed, dp, 0, 0)[0] for dp in (0, 1)]  # the fresh start's, per DP rank
    for tp in (0, 1):
        rng = _rng_of(step_dir(new, 4), tp)
        default, tp_seed = dropout_seeds(seed, 0, tp, 0, 3)  # dp 0, pp 0, salted with step 3
        assert _seed_of(rng["torch"]) == default and default not in old
        assert _seed_of(rng["tensor_parallel"][TP_RNG]) == tp_seed != default
        random.seed(default)  # python's and numpy's: seeded,
        assert tuple(rng["python"]["state"]) == random.getstate()[1]  # not drawn from since
        np.random.seed(default % 2**32)
        keys, pos = np.random.get_state()[1:3]
        assert rng["numpy"]["keys"] == keys.tolist() and rng["numpy"]["pos"] == pos
