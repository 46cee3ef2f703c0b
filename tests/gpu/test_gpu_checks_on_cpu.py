"""The checks of tests/gpu/test_gpu.py that can run on the CPU, run here (issue 35, item 2): each GPU test that uses one
imports it from this file, so what the CPU shows is what the GPU run asserts.

  * TF32 (test_tf32_run_tracks_the_fp32_run): each run's log names the TF32 state its worker process read back from
    torch after setting it (`| TF32 on |` / `| TF32 off |`, runtime/device.py tf32_state). Before, the test compared
    two runs' losses only, and passed as well when TF32 was never switched on.
  * Positions at width (test_bf16_convert_and_eval_at_width): the converted bf16 model's r_net inputs over 1,536
    positions are fp32's sinusoids rounded once, compared with an independent float64 statement. Its NLL comparison
    could not see half-precision angles (a 4-step model barely uses positions); this check fails with a bf16
    inv_freq (shown here on the CPU) and passes with fp32's.
  * The resumed optimizer (test_resumed_adam_step_on_cuda_at_the_call_site): after a real resume, the Adam step
    tensors the optimizer holds have the count, dtype and device torch's own Adam gives them, and the next step runs.
    The older tests check the helper (adam_step_tensor) alone, and say so in their names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.fixture_data import REPO
from helpers.runs_cache import logs, losses, run

from megamemo.runtime.dist import free_port

# ---- TF32 ----------------------------------------------------------------------------------------------------------
TF32_STATES = {"fp32": "| TF32 off |", "tf32": "| TF32 on |"}


def tf32_runs(tiny_cfg, shards, tmp_path, steps: int, env_extra=None, timeout=180):
    """fp32 without and with precision.allow_tf32, `steps` steps each, no dropout; each run's log must name the TF32
    state its worker set. -> (losses without, losses with)."""
    exact = [
        "--set",
        "model.dropout=0.0",
        "--max-steps",
        str(steps),
        "--save-every",
        "0",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "checkpoint.save_at_end=false",
    ]
    run(1, tiny_cfg, shards, tmp_path / "fp32", *exact, env_extra=env_extra, timeout=timeout)
    run(
        1,
        tiny_cfg,
        shards,
        tmp_path / "tf32",
        *exact,
        "--set",
        "precision.allow_tf32=true",
        env_extra=env_extra,
        timeout=timeout,
    )
    for name, state in TF32_STATES.items():
        log = logs(tmp_path / name)
        assert state in log, f"{name} run: {state!r} not in its log:\n{log[-2000:]}"
    return losses(tmp_path / "fp32"), losses(tmp_path / "tf32")


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_tf32_runs_log_the_state_their_worker_set(tiny_cfg, shards, tmp_path):
    """TF32 flags are process state on the CPU too (they only change nothing here): the same runs, one step."""
    a, b = tf32_runs(tiny_cfg, shards, tmp_path, 1)
    assert sorted(a) == sorted(b) == [1]


# ---- positions at width ----------------------------------------------------------------------------------------------
def reference_sinusoid(klen: int, d_model: int) -> torch.Tensor:
    """[klen, d_model] float64: sin then cos of (klen-1 ... 0) x 10000^(-2i/d), stated without megamemo's code."""
    pos = torch.arange(klen - 1, -1, -1, dtype=torch.float64)
    freq = 1.0 / 10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos[:, None] * freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], -1)


def assert_positions_are_fp32s(model, klen: int) -> float:
    """Run `model` (any dtype, on its device) over klen tokens of one stream from empty memory; every layer's r_net
    must receive the sinusoids within one rounding of the exact ones: at most 2 eps of its dtype (fp32 angles are
    off by ~1e-4 rad at 1,536 positions; bf16 angles by radians). -> the largest difference seen."""
    cfg, param = model.cfg, next(model.parameters())
    seen = []
    hooks = [
        layer.attn.r_net.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double().cpu()))
        for layer in model.layers
    ]
    x = torch.randint(0, cfg.n_token, (klen, 1), generator=torch.Generator().manual_seed(5)).to(param.device)
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    want = reference_sinusoid(klen, cfg.d_model)
    assert len(seen) == cfg.n_layer and all(s.shape == want.shape for s in seen), [s.shape for s in seen]
    worst = max(float((s - want).abs().max()) for s in seen)
    bound = 2 * torch.finfo(param.dtype).eps
    assert worst <= bound, (
        f"positions off by up to {worst:.3g} over {klen} positions (bound {bound:.3g} for "
        f"{param.dtype}): angles not computed in fp32"
    )
    return worst


def _bf16_single(tmp_path):
    """A bf16 single-device checkpoint (as `convert to-single --dtype bf16` writes) loaded as eval/generate do."""
    from megamemo.checkpoint.single import load_single, save_single
    from megamemo.model import MemTransformerLM, ModelConfig

    cfg = ModelConfig(
        variant="lamemo",
        n_token=32,
        n_layer=2,
        d_model=64,
        n_head=2,
        d_head=16,
        d_inner=64,
        dropout=0.0,
        tgt_len=512,
        mem_len=1024,
    )
    torch.manual_seed(0)
    save_single(tmp_path / "single", cfg, MemTransformerLM(cfg).state_dict(), dtype=torch.bfloat16)
    return load_single(tmp_path / "single")[0]


def test_positions_check_passes_with_fp32_inv_freq(tmp_path):
    model = _bf16_single(tmp_path)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert assert_positions_are_fp32s(model, 1536) > 0  # bf16 rounding seen, within one rounding


def test_positions_check_fails_with_bf16_inv_freq(tmp_path, monkeypatch):
    """The frequencies rounded to bf16 (what `model.to(bf16)` did to the old inv_freq buffer): the check fails."""
    from megamemo.model import positions

    model = _bf16_single(tmp_path)
    monkeypatch.setattr(
        positions, "_inv_freq_on", lambda d, device: positions.inv_freq(d).to(torch.bfloat16).float().to(device)
    )
    with pytest.raises(AssertionError, match="angles not computed in fp32"):
        assert_positions_are_fp32s(model, 1536)


# ---- the resumed optimizer's Adam step, at the call site -------------------------------------------------------------
RESUMED_ADAM_SCRIPT = r"""
import json, sys, torch
from megamemo.train.config import load
from megamemo.train.build import build
cfg = load(sys.argv[1], sys.argv[2:])
trainer, _ = build(cfg)                          # resumes from the run directory's newest committed checkpoint

def steps():
    opt = trainer.engine.ds.optimizer
    inner = getattr(opt, "optimizer", opt)       # ZeRO / BF16_Optimizer wrap torch's Adam; fp32 without ZeRO is it
    return inner, [(p, st["step"]) for p, st in inner.state.items() if "step" in st]

inner, resumed = steps()
p, group = resumed[0][0], inner.param_groups[0]
probe = torch.nn.Parameter(torch.zeros(2, device=p.device, dtype=p.dtype))
fresh = type(inner)([probe], lr=0.1, fused=group.get("fused"), capturable=group.get("capturable", False))
probe.grad = torch.zeros_like(probe)
fresh.step()                                     # where torch's own Adam puts its step for such a group
made = fresh.state[probe]["step"]
out = {"resumed_at": trainer.step, "fused": bool(group.get("fused")),
       "optimizer": type(trainer.engine.ds.optimizer).__name__,
       "resumed": [[float(s), str(s.device), str(s.dtype), str(q.device)] for q, s in resumed],
       "torch_makes": [str(made.device), str(made.dtype)]}
trainer.train_step()                             # the resumed optimizer steps (a fused step with a CPU count fails)
out["after_a_step"] = [[float(s), str(s.device)] for _, s in steps()[1]]
trainer.metrics.close()
print("OUT" + json.dumps(out))
"""


def resumed_adam_steps(tiny_cfg, shards, tmp_path, sets=(), env_extra=None, timeout=180) -> dict:
    """Train 2 steps (checkpoint at 2), resume in one process, read the optimizer's step tensors, take a step; checks
    them against torch's own Adam. -> the script's record."""
    run_dir = tmp_path / "run"
    args = [a for s in sets for a in ("--set", s)]
    run(
        1,
        tiny_cfg,
        shards,
        run_dir,
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "model.dropout=0.0",
        *args,
        env_extra=env_extra,
        timeout=timeout,
    )
    script = tmp_path / "resumed_adam.py"
    script.write_text(RESUMED_ADAM_SCRIPT)
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    env.update(env_extra or {})
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            str(tiny_cfg),
            f"data.dir={shards}",
            f"train.run_dir={run_dir}",
            "train.max_steps=3",
            "checkpoint.save_every=0",
            "checkpoint.save_at_end=false",
            "checkpoint.probe=false",
            "log.tensorboard=false",
            "model.dropout=0.0",
            *sets,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.split("OUT", 1)[1])
    assert out["resumed_at"] == 2 and out["resumed"], out
    for count, dev, dtype, _param_dev in out["resumed"]:
        assert count == 2.0 and [dev, dtype] == out["torch_makes"], out
    assert all(a == [3.0, before[1]] for a, before in zip(out["after_a_step"], out["resumed"], strict=True)), out
    return out


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_resumed_adam_step_at_the_call_site(tiny_cfg, shards, tmp_path):
    """On the CPU, bf16 with ZeRO 1 (BF16_Optimizer around a fused torch Adam, as on a GPU): the count and dtype
    are checked here, the device only where it can differ (tests/gpu/test_gpu.py)."""
    out = resumed_adam_steps(
        tiny_cfg, shards, tmp_path, sets=["precision.dtype=bf16", "precision.grad_accum_dtype=fp32"]
    )
    assert out["fused"] and out["optimizer"] == "BF16_Optimizer", out
