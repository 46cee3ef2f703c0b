"""`megamemo convert` on real multi-process checkpoints (fp32 on CPU, gloo):
  * TP=2, PP=2 and TP=2 x PP=2 runs convert to one single-device model whose per-token NLL over the 3 probe segments, from the
    converted memory of the same streams, equals what the sharded model computed during training (1e-5);
  * a checkpoint saved under TP=2 / DP=2 / PP=2 / TP=2 x PP=2 and relaid out resumes in one process: the next steps' losses and
    the final weights equal those of the run that stayed in its layout (1e-5);
  * a different global batch resumes at the same fraction of the epoch with empty memory (checked by hand);
  * broken checkpoints (missing, extra or truncated shard, wrong config, rank files that disagree, memory of the
    wrong heads) are refused with the file named and nothing written at --out."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megamemo.checkpoint import convert
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from test_train_runs import logs, losses, run, shards, tiny_cfg  # noqa: F401 (fixtures)

EXACT = ["--max-steps", "6", "--set", "model.dropout=0.0", "--set", "log.tensorboard=false"]


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
    with safe_open(str(step / "megamemo" / "probe.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["probe"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    return meta, [(t[f"inputs.{i}"], t[f"targets.{i}"], t[f"nll.{i}"]) for i in range(meta["segments"])]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2pp2"])
def test_sharded_checkpoint_converts_to_the_same_model(layout, request, tmp_path):
    run_dir = request.getfixturevalue(layout)
    out = tmp_path / "single"
    assert convert.main(["to-single", "--ckpt", str(run_dir), "--out", str(out), "--memory", "all"]) == 0
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
    assert worst < 1e-5, worst
    assert without_memory > 1e-4          # the memory matters at this tolerance: the probe checks it too
    assert doc["meta"]["check"]["max_abs_diff"] < 1e-5

    # eval / generate read the run directory directly: the same weights
    in_memory, _ = convert.load_model(run_dir)
    sd = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(in_memory.state_dict()[k], v) for k, v in sd.items())


@pytest.mark.parametrize("layout,extra", [("tp2", []), ("dp2", ["--set", "train.grad_accum=2"]), ("pp2", []),
                                          ("tp2pp2", [])])
def test_resume_under_another_layout_continues_the_run(layout, extra, request, tiny_cfg, shards, tmp_path):
    """Saved at step 3 under TP=2 / DP=2 / PP=2 / TP=2 x PP=2, resumed in one process (DP=2 -> 1 x 2 micro-batches): steps 4-6
    and the step-6 weights equal the original run's (the same global batch)."""
    src = request.getfixturevalue(layout)
    new = tmp_path / "relaid"
    assert convert.main(["relayout", "--ckpt", str(step_dir(src, 3)), "--out", str(new)]) == 0
    run(1, tiny_cfg, shards, new, *EXACT, *extra)
    assert "layout-free checkpoint" in logs(new)
    want, got = losses(src), losses(new)
    assert sorted(got) == [4, 5, 6]
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)
    a, _ = convert.load_model(step_dir(src, 6))
    b, _ = convert.load_model(step_dir(new, 6))
    sa, sb = a.state_dict(), b.state_dict()
    assert max(float((sa[k] - sb[k]).abs().max()) for k in sa) < 1e-5


def test_another_global_batch_restarts_streams_with_empty_memory(tp2, tiny_cfg, shards, tmp_path):
    from data_pipeline import StreamReader

    new = tmp_path / "relaid"
    assert convert.main(["relayout", "--ckpt", str(step_dir(tp2, 3)), "--out", str(new)]) == 0
    run(1, tiny_cfg, shards, new, *EXACT, "--set", "data.batch_size=2")
    assert "global batch 4 -> 2 streams" in logs(new)
    # by hand: the step-3 weights, the same fraction of the epoch in the 2-column cut, empty memory
    old = StreamReader(shards, "train", 4, 16).steps_per_epoch
    reader = StreamReader(shards, "train", 2, 16, roll=True, seed=1111, epochs=None)
    pos = 3 * reader.steps_per_epoch // old
    x, y = reader.get_batch(0, pos)
    model, _ = convert.load_model(step_dir(tp2, 3))
    with torch.no_grad():
        nll, _ = model(x, y, None)
    assert abs(float(nll.mean()) - losses(new)[4]) < 1e-5
    state = json.loads((step_dir(new, 6) / "megamemo" / "rank_00000.json").read_text())["state"]["data"]
    assert (state["epoch"], state["step"], state["batch_size"]) == (0, pos + 3, 2)


# ---- broken inputs ------------------------------------------------------------------------------------------------
def _commit_sizes(step):
    """Update the marker's file sizes, so that our own checks (not the size check) meet the damage."""
    marker = json.loads((step / "COMMITTED").read_text())
    marker["files"] = {str(p.relative_to(step)): p.stat().st_size for p in sorted(step.rglob("*"))
                       if p.is_file() and p.name != "COMMITTED"}
    (step / "COMMITTED").write_text(json.dumps(marker))


def _damage_missing_listed(s):
    (s / "mp_rank_01_model_states.pt").unlink()
    return "mp_rank_01_model_states.pt"


def _damage_missing(s):
    (s / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    _commit_sizes(s)
    return "zero_pp_rank_0_mp_rank_01_optim_states.pt: missing"


def _damage_extra(s):
    shutil.copyfile(s / "mp_rank_01_model_states.pt", s / "mp_rank_02_model_states.pt")
    _commit_sizes(s)
    return "mp_rank_02_model_states.pt: unexpected shard"


def _damage_truncated_listed(s):
    f = s / "mp_rank_01_model_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    return "mp_rank_01_model_states.pt: size"


def _damage_truncated(s):
    f = s / "mp_rank_01_model_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    _commit_sizes(s)
    return "mp_rank_01_model_states.pt: cannot be loaded"


def _damage_config(s):
    marker = json.loads((s / "COMMITTED").read_text())
    marker["model"]["d_inner"] = 96
    (s / "COMMITTED").write_text(json.dumps(marker))
    return "COMMITTED: the model config does not match the weights"


def _damage_rank_layout(s):
    doc = json.loads((s / "megamemo" / "rank_00001.json").read_text())
    doc["layout"]["tp_rank"] = 0
    (s / "megamemo" / "rank_00001.json").write_text(json.dumps(doc))
    _commit_sizes(s)
    return "rank_00001.json: (dp, tp, pp) rank (0, 0, 0) also held by rank 0"


def _damage_memory_heads(s):
    """The two TP ranks' per-rank tensors swapped: every file is intact, but the memory's heads are in the wrong
    order; only the NLL check can tell."""
    a, b = s / "megamemo" / "rank_00000.safetensors", s / "megamemo" / "rank_00001.safetensors"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db), b.write_bytes(da)
    _commit_sizes(s)
    return "per-token NLL differs"


@pytest.mark.parametrize("damage", [_damage_missing_listed, _damage_missing, _damage_extra, _damage_truncated_listed,
                                    _damage_truncated, _damage_config, _damage_rank_layout, _damage_memory_heads],
                         ids=lambda f: f.__name__[len("_damage_"):])
def test_broken_checkpoint_is_refused_by_name(damage, tp2, tmp_path, capsys):
    s = tmp_path / "checkpoints" / "step_00000006"
    shutil.copytree(step_dir(tp2, 6), s)
    expect = damage(s)
    for cmd in ("to-single", "relayout"):
        out = tmp_path / f"out-{cmd}"
        assert convert.main([cmd, "--ckpt", str(s), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert expect in err, (cmd, err)
        assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


def test_bf16_tensor_parallel_checkpoint_checks_within_the_bf16_tolerance(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "run"
    run(2, tiny_cfg, shards, run_dir, "--tp", "2", "--set", "precision.dtype=bf16", *EXACT, "--max-steps", "3")
    out = tmp_path / "single"
    assert convert.main(["to-single", "--ckpt", str(run_dir), "--out", str(out)]) == 0
    check = json.loads((out / "config.json").read_text())["meta"]["check"]
    assert check["precision"] == "bf16" and check["max_abs_diff"] <= 0.1 and check["mean_abs_diff"] <= 0.01
    # the fp32 masters, not the bf16 copies: conversion gathered them from the ZeRO optimizer files
    sd = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in sd.values())
