"""train.compile: regional torch.compile of the decoder layers (megamemo/kernels/compiler.py).

  * a real compiled run (inductor, on the CPU) gives the eager run's losses over 20 steps with dropout 0, within
    what the weights' rounding drift explains, with validation and checkpoint probes in it, and compiles at most 4
    graphs (3 recompiles);
  * compiled dropout keeps the law (kept values scaled by 1/(1-p), the kept fraction within 5 sigma, fresh masks
    every call, ReLU+dropout zero wherever ReLU is);
  * every decoder layer is compiled in place and its calls run compiled (not the first layer's alone, nor a compiled
    copy left unused);
  * the switch: auto is on for CUDA only, YAML's on/off, TORCHDYNAMO_DISABLE lifted only where megamemo set it,
    a user's TORCHDYNAMO_DISABLE=1 with train.compile: on is one line, tensor parallelism says why it is off.
(Pipeline stages compiled: tests/train/test_train_parallel.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.bounds import drift_bound, weight_drift
from helpers.runs_cache import REPO, logs, losses, run
from test_train_runs import checkpoint_model

from megamemo.checkpoint.store import newest_complete
from megamemo.config.run import ConfigError
from megamemo.kernels import compiler
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.train.config import from_dict

EXACT_20 = (
    "--set",
    "model.dropout=0.0",
    "--max-steps",
    "20",
    "--save-every",
    "10",
    "--set",
    "eval.every=10",
    "--set",
    "eval.batch_size=4",
    "--set",
    "eval.max_segments=3",
    "--set",
    "log.tensorboard=false",
)


@pytest.mark.multiproc  # not `numerics`: inductor's compiled run stops at ATEN_CPU_CAPABILITY=avx2 on an AVX-512
def test_compiled_run_equals_eager_with_at_most_three_recompiles(tiny_cfg, shards, reference_runs, tmp_path):
    eager = reference_runs.get(1, tiny_cfg, shards, *EXACT_20)
    run_dir = tmp_path / "compiled"
    run(1, tiny_cfg, shards, run_dir, *EXACT_20, "--set", "train.compile=on", timeout=600)
    text = logs(run_dir)
    assert "| compiled layers |" in text, text[-2000:]
    a, b = losses(eager), losses(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    # the compiled layers' fused or reordered sums move the weights apart by rounding: rho at step 20
    # (tests/helpers/bounds.py;
    # < 1e-3: not a run gone elsewhere) grows with the steps, so it bounds each step's loss by drift_bound
    w_eager = checkpoint_model(newest_complete(eager / "checkpoints"))
    rho = weight_drift(w_eager.state_dict(), checkpoint_model(newest_complete(run_dir / "checkpoints")).state_dict())
    assert rho < 1e-3, rho
    assert all(abs(a[s] - b[s]) <= drift_bound(w_eager.cfg, rho, a[s]) for s in a), (a, b, rho)
    m = re.search(r"(\d+) graphs compiled \((\d+) recompiles\)", text)
    assert m and int(m.group(2)) <= 3, text[-1500:]  # memory 0 / full x inner / top layer


def test_compiled_dropout_keeps_the_law():
    from megamemo.model.layers import ReluDropout

    compiler.enable_compiler()
    p, n = 0.3, 200_000
    for drop in (torch.nn.Dropout(p), ReluDropout(p)):
        f = torch.compile(drop.train(), backend="inductor")
        x = torch.ones(n)
        y1, y2 = f(x), f(x)
        for y in (y1, y2):
            keep = y != 0
            # bit-exact: a kept 1.0 times the scale is the scale rounded to fp32 once (equal at both ISAs)
            assert torch.equal(y[keep], torch.tensor(1 / (1 - p)).expand(y[keep].shape))
            assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
        assert not torch.equal(y1 != 0, y2 != 0)  # a fresh mask each call
    x = torch.randn(n)
    assert (torch.compile(ReluDropout(p).train())(x)[x <= 0] == 0).all()


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_every_decoder_layer_is_compiled_and_runs_compiled(variant):
    """compile_layers compiles each decoder layer in place, all of them, and says how many: over two segments (no
    memory, then memory) every layer's call runs under TorchDynamo (a hook on each layer, traced with the layer,
    sees torch.compiler.is_compiling()), not the first layer's alone, nor a compiled copy left unused. Backend
    "eager": TorchDynamo traces, no code is generated."""
    cfg = ModelConfig(
        variant=variant,
        n_token=40,
        n_layer=3,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        tgt_len=4,
        mem_len=4,
    )
    torch.manual_seed(0)
    model = MemTransformerLM(cfg)
    layers, seen = compiler.decoder_layers(model), []
    assert len(layers) == 3
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, torch.compiler.is_compiling())))
    assert compiler.compile_layers(model, "eager") == 3
    x, mem = torch.randint(0, 40, (5, 2), generator=torch.Generator().manual_seed(1)), None
    for _ in range(2):
        _, mem = model(x[:4], x[1:], mem)
    assert seen == [(i, True) for _ in range(2) for i in range(3)], seen


def test_compile_switch(monkeypatch):
    assert compiler.resolve_compile("auto", "cuda") and not compiler.resolve_compile("auto", "cpu")
    assert compiler.resolve_compile("on", "cpu") and not compiler.resolve_compile("off", "cuda")
    base = {"model": {"variant": "xl", "n_token": 40, "mem_len": 8, "tgt_len": 8}}
    assert from_dict(base | {"train": {"compile": True}}).train.compile == "on"  # YAML 1.1 reads on as true
    assert from_dict(base | {"train": {"compile": False}}).train.compile == "off"
    with pytest.raises(ConfigError, match="train.compile: must be auto, on or off"):
        from_dict(base | {"train": {"compile": "fast"}})
    with pytest.raises(ConfigError, match="train.compile: expected Switch, got int 1"):
        from_dict(base | {"train": {"compile": 1}})
    # megamemo's own TORCHDYNAMO_DISABLE is lifted; the user's is kept and named
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setenv(compiler.SET_BY_MEGAMEMO, "1")
    compiler.enable_compiler()
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(compiler.CompilerUnavailable, match="TORCHDYNAMO_DISABLE=1 is set in the environment"):
        compiler.enable_compiler()


def test_under_tensor_parallelism_the_attention_regions_are_compiled_and_said():
    """tp > 1: no whole layer is compiled (megatron-core's async all-reduces cannot be traced); each attention
    module's functions are compiled instead (the same compiled function for every layer), the form still reads as
    eager, and one line says why. tp 1 compiles the layers."""
    from megamemo.kernels import attention_in_use
    from megamemo.kernels.compiler import uncompiled
    from megamemo.model.attention import causal_attention, lookahead_attention
    from megamemo.model.layers import RelAttention
    from megamemo.train.speedups import apply_speedups

    cfg = from_dict(
        {
            "model": {"variant": "lamemo", "n_token": 40, "mem_len": 8, "tgt_len": 8},
            "parallel": {"tp": 2},
            "train": {"compile": "on"},
        }
    )
    lines, model = [], MemTransformerLM(cfg.model)
    got = apply_speedups(cfg, model, "cpu", 2, lines.append)
    assert got.compiled == 2 and len(lines) == 1
    assert lines[0].startswith(
        "[train] compile: attention regions under tensor parallelism (parallel.tp=2): "
        "megatron-core's parallel linears all-reduce with async_op=True"
    ), lines
    attns = [m for m in model.modules() if isinstance(m, RelAttention)]
    assert all(m.causal is not causal_attention and uncompiled(m.causal) is causal_attention for m in attns)
    assert all(uncompiled(m.lookahead) is lookahead_attention for m in attns)
    assert len({id(m.causal) for m in attns}) == 1 and attention_in_use(model) == "eager"
    assert not any(getattr(layer, "_compiled_call_impl", None) for layer in model.layers)
    cfg.parallel.tp = 1
    got = apply_speedups(cfg, MemTransformerLM(cfg.model), "cpu", 2, lines.append)
    assert got.compiled == 2 and len(lines) == 1


def test_a_users_dynamo_switch_with_compile_on_is_one_line(tiny_cfg, shards, tmp_path):
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
        DS_ACCELERATOR="cpu",
    )
    env.pop(compiler.SET_BY_MEGAMEMO, None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "train",
            "--config",
            str(tiny_cfg),
            "--data",
            str(shards),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "train.compile=on",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "train.compile: on: TORCHDYNAMO_DISABLE=1 is set in the environment" in err[0], r.stderr
