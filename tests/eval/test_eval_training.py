"""eval on a training run: the score of a (converted) checkpoint equals the run's own periodic validation at the
same lengths; conversion gathers the fp32 master weights of ZeRO-2 bf16 data-parallel runs; an uncommitted
checkpoint is refused."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.bounds import sum_bound
from helpers.eval_fixtures import one_thread  # noqa: F401 (one_thread: autouse fixture)
from helpers.shards import SMALL, sized
from safetensors.torch import load_file

from megamemo import cli
from megamemo.commands import convert as convert_cmd
from megamemo.commands import eval as evaluate
from megamemo.interop import load

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


shards = sized(SMALL)


def train(run_dir: Path, data: Path, *extra: str, procs: int = 1) -> list[dict]:
    args = [
        "--config",
        str(REPO / "configs/tiny-cpu.yaml"),
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "6",
        "--save-every",
        "6",
        "--set",
        "eval.every=6",
        "--set",
        "log.tensorboard=false",
        *extra,
    ]
    cmd = (
        [str(REPO / "launch/local.sh"), str(procs)] if procs > 1 else [sys.executable, "-m", "megamemo", "train"]
    ) + args
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("kind") == "eval"]


def run_eval(ckpt, data, *extra) -> dict:
    out = Path(str(ckpt).rstrip("/") + ".eval.json")
    assert (
        evaluate.main(["--ckpt", str(ckpt), "--data", str(data), "--split", "valid", "--json", str(out), *extra]) == 0
    )
    return json.loads(out.read_text())


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_eval_of_a_run_equals_its_validation(shards, tmp_path):
    run = tmp_path / "run"
    evals = train(run, shards, "--set", "eval.max_segments=0")
    val = evals[-1]
    assert val["step"] == 6
    got = run_eval(run, shards, "--batch-size", "8")  # the run directory, converted in memory
    assert (got["tgt_len"], got["mem_len"]) == (val["tgt_len"], val["mem_len"])
    assert got["tokens"] == val["tokens"]
    # the same weights, shapes and kernels in one process each: the per-token fp32 values are equal bit for bit;
    # only the fp64 totals' order may differ: 2 N u64 relative to the (positive) mean, bpc one division more
    assert got["nll"] == pytest.approx(val["loss"], rel=sum_bound(got["tokens"], 1.0, torch.float64), abs=0)
    assert got["bpc"] == pytest.approx(val["bpc"], rel=sum_bound(got["tokens"] + 1, 1.0, torch.float64), abs=0)

    single = tmp_path / "single"
    assert convert_cmd.main(["to-single", "--ckpt", str(run), "--out", str(single)]) == 0
    assert run_eval(single, shards, "--batch-size", "8")["nll"] == got["nll"]
    meta = json.loads((single / "config.json").read_text())["meta"]
    assert meta["step"] == 6 and meta["vocab"]["kind"] == "bytes" and meta["tokenizer"]["kind"] == "bytes"
    # the weights are the run's fp32 module weights, as its one rank wrote them (read here with plain safetensors)
    step_dir = run / "checkpoints" / "step_00000006"
    module = {
        k[len("model/") : -2]: v
        for k, v in load_file(str(step_dir / "rank_00000.safetensors")).items()
        if k.startswith("model/") and k.endswith("#0")
    }
    sd = load_file(str(single / "model.safetensors"))
    assert sd.keys() == module.keys() and all(torch.equal(sd[k], module[k].reshape(sd[k].shape)) for k in sd)
    # the marker's layout is the one kept; the request's flags reach the conversion (--no-check: no self-check)
    assert meta["layout"] == json.loads((step_dir / "COMMITTED").read_text())["layout"] and meta["check"]
    half = tmp_path / "half"
    assert convert_cmd.main(["to-single", "--ckpt", str(run), "--out", str(half), "--dtype", "bf16", "--no-check"]) == 0
    assert "check" not in json.loads((half / "config.json").read_text())["meta"]
    assert {v.dtype for v in load_file(str(half / "model.safetensors")).values()} == {torch.bfloat16}

    # an interrupted save (no COMMITTED marker) is refused, naming it
    broken = run / "checkpoints" / "step_00000009"
    shutil.copytree(step_dir, broken)
    (broken / "COMMITTED").unlink()
    with pytest.raises(load.LoadError, match="COMMITTED"):
        load.load_model(broken)
    assert cli.run_command("eval", evaluate.main, ["--ckpt", str(broken), "--data", str(shards)]) == 2
    assert (
        cli.run_command("convert", convert_cmd.main, ["to-single", "--ckpt", str(broken), "--out", str(tmp_path / "x")])
        == 2
    )
    assert not (tmp_path / "x").exists()
    # the run directory still resolves to the newest *committed* checkpoint
    assert load.resolve_committed(run)[0] == step_dir


def test_bf16_zero2_data_parallel_run_is_consolidated(shards, tmp_path):
    """Two ranks, ZeRO-2, bf16: the fp32 masters are split over two optimizer files; conversion joins them (and
    checks they round to the module's bf16 copy); eval in bf16 reproduces the run's validation."""
    run = tmp_path / "run"
    evals = train(run, shards, "--set", "precision.dtype=bf16", "--set", "parallel.zero_stage=2", procs=2)
    step_dir = run / "checkpoints" / "step_00000006"
    ranks = [load_file(str(step_dir / f"rank_{r:05d}.safetensors")) for r in range(2)]
    assert all(any(k.startswith("master/") for k in t) for t in ranks)  # each rank wrote its fp32 fragments
    model, meta = load.load_model(run)
    assert meta["precision"] == "bf16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the module's bf16 weights, written once each, spread over the two DP ranks (pieces.spread_writers)
    module = {k[len("model/") : -2]: v for t in ranks for k, v in t.items() if k.startswith("model/")}
    assert sum(k.startswith("model/") for t in ranks for k in t) == len(module)
    assert all(any(k.startswith("model/") for k in t) for t in ranks)
    sd = model.state_dict()
    assert sd.keys() == module.keys()
    assert all(torch.equal(sd[k].to(torch.bfloat16), v.reshape(sd[k].shape)) for k, v in module.items())
    assert any(not torch.equal(sd[k], v.float().reshape(sd[k].shape)) for k, v in module.items())  # not upcasts
    val = evals[-1]
    got = run_eval(run, shards, "--batch-size", "8", "--max-segments", "20", "--dtype", "bf16")
    assert got["tokens"] == val["tokens"]
    # bf16 both: eval's bf16 forward against the validation's bf16 forward in DeepSpeed's engine (its own casts and
    # module; not derived here: bf16's u = 3.9e-3 makes the operation-count bound exceed the value itself)
    assert got["nll"] == pytest.approx(val["loss"], rel=1e-4)
