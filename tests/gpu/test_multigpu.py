"""Several GPUs (`pytest -m multigpu tests/gpu/test_multigpu.py`; deselected where torch sees fewer than 2 CUDA devices,
see conftest; the TP 2 x PP 2 test needs 4, marker gpu4, and is skipped naming that count where fewer are seen):

  * TP 2, PP 2 and DP 2 runs through launch/local.sh (NCCL, one process per GPU) against one GPU, fp32, and TP 2 x
    PP 2 on 4 GPUs;
  * the half precision the GPU has in hardware (bf16 from compute capability 8.0, else fp16: what megamemo allows
    there, train/engine.py check_precision) with ZeRO 1, DP 2 and TP 2 against the one-GPU half run and the fp32 run,
    within the bf16 bound of tests/train/test_train_equivalence.py (scaled for fp16);
  * save -> kill -9 of every rank -> resume across NCCL, bit-exact under train.deterministic (TP 2, half, dropout on);
  * the conversion probe and eval after a TP 2 run: `convert to-single` passes its probe and `eval` of the converted
    model on one GPU scores the validation the one-GPU run logged.

fp32 without TF32 and without dropout, so the fp32 runs compute the same sums in other orders: per step within 1e-4
nats (the CPU's DP test holds 1e-5 with gloo; cuBLAS picks other kernels for the halved TP shapes, each fp32 product
off by a few 2^-24 relative, over 5 Adam steps). NCCL takes no CPU tensor, so these runs also prove that every
tensor crossing ranks (p2p headers, meta, loss statistics, the TP grad norm) is on the GPU - what the CPU tests can
only check by device spelling (issue 28, item 5).

The scenarios below the local.sh tests take the devices as an argument: tests/gpu/test_multigpu_on_cpu.py runs the same
functions on the CPU (gloo, bf16), so their logic has run before they ever meet a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.fixture_data import REPO
from test_train_runs import (
    ONE_PROCESS_EXACT,
    assert_no_corrupt_checkpoint,
    committed_steps,
    eval_records,
    launch,
    logs,
    losses,
    run,
    wait,
)

from megamemo.train.engine import BF16_MIN_CAPABILITY

pytestmark = pytest.mark.multigpu
STEPS = 5
EXACT = [
    "--set",
    "model.dropout=0.0",
    "--max-steps",
    str(STEPS),
    "--save-every",
    "0",
    "--set",
    "checkpoint.probe=false",
    "--set",
    "checkpoint.save_at_end=false",
    "--set",
    "precision.dtype=fp32",
]


def local(n, cfg, shards, run_dir, *args):
    env = dict(
        os.environ,
        MEGAMEMO_DEVICE="gpu",
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))),
    )
    env.pop("DS_ACCELERATOR", None)
    r = subprocess.run(
        [
            "bash",
            str(REPO / "launch/local.sh"),
            str(n),
            "--config",
            str(cfg),
            "--data",
            str(shards),
            "--run-dir",
            str(run_dir),
            *EXACT,
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"{n} process(es) on gpu" in r.stderr
    return losses(run_dir)


@pytest.fixture(scope="module")
def one_gpu(tiny_cfg, shards, tmp_path_factory):
    return local(1, tiny_cfg, shards, tmp_path_factory.mktemp("one") / "run")


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], []], ids=["tp2", "pp2", "dp2"])
def test_two_gpus_equal_one(layout, one_gpu, tiny_cfg, shards, tmp_path):
    got = local(2, tiny_cfg, shards, tmp_path / "run", *layout)
    assert sorted(got) == sorted(one_gpu) == list(range(1, STEPS + 1))
    for step, want in one_gpu.items():
        assert abs(got[step] - want) <= 1e-4, (layout, step, got[step], want)
    assert one_gpu[STEPS] < one_gpu[1] - 0.05  # it trained: moving numbers compared


@pytest.mark.gpu4
def test_tp2_x_pp2_on_four_gpus_equals_one(one_gpu, tiny_cfg, shards, tmp_path):
    """TP 2 x PP 2: the stages' p2p of TP-sharded activations and the TP groups inside each stage, over NCCL."""
    got = local(4, tiny_cfg, shards, tmp_path / "run", "--tp", "2", "--pp", "2")
    assert sorted(got) == sorted(one_gpu) == list(range(1, STEPS + 1))
    for step, want in one_gpu.items():
        assert abs(got[step] - want) <= 1e-4, (step, got[step], want)


# ---- the scenarios, for any devices ----------------------------------------------------------------------------
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
# tests/train/test_train_equivalence.py derives 0.005 nats per step for a bf16 run of this model (TINY, lr 2e-3, these
# lengths) against its fp32 run, linear in bf16's unit roundoff U = 2^-8: the bound of a half run against fp32 is
# 0.005 * U(dtype) / 2^-8. Two half runs of different layouts are each within it of the fp32 run: within twice it
# of each other.
BF16_VS_FP32 = 0.005
NO_SAVES = ["--save-every", "0", "--set", "checkpoint.save_at_end=false", "--set", "checkpoint.probe=false"]


def half_precision(capability: tuple[int, int]) -> str:
    """The half precision a GPU of this compute capability has in hardware, and so the one megamemo lets it train in
    (train/engine.py check_precision): bf16 from 8.0 on, else fp16."""
    return "bf16" if tuple(capability) >= BF16_MIN_CAPABILITY else "fp16"


def half_bound(dtype: str) -> float:
    """Per-step |loss difference| allowed between a `dtype` run and the fp32 run of the same model and data."""
    return BF16_VS_FP32 * UNIT_ROUNDOFF[dtype] / UNIT_ROUNDOFF["bf16"]


@dataclass(frozen=True)
class Devices:
    """Where a scenario's ranks run: kind gpu (NCCL, rank r on CUDA device r) or cpu (gloo), and its half precision."""

    kind: str
    half: str

    def env(self, n: int) -> dict:
        if self.kind == "cpu":
            return {"DS_ACCELERATOR": "cpu", "MEGAMEMO_DEVICE": "cpu"}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n))))
        return {"DS_ACCELERATOR": "cuda", "MEGAMEMO_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": visible}

    def train(self, n, cfg, shards, run_dir: Path, *args, timeout=300) -> Path:
        """n ranks of `megamemo train` on these devices (tests/helpers/runs_cache.py run: RANK/WORLD_SIZE/MASTER_*)."""
        run(n, cfg, shards, run_dir, *args, env_extra=self.env(n), timeout=timeout)
        return run_dir

    def half_args(self) -> list[str]:
        return ["--set", f"precision.dtype={self.half}", "--set", "parallel.zero_stage=1"]


def gpus() -> Devices:
    import torch

    return Devices("gpu", half_precision(torch.cuda.get_device_capability(0)))


def half_layout_tracks_one_device(
    devs: Devices, layout: list[str], one_half: dict, one_fp32: dict, cfg, shards, run_dir: Path
) -> dict:
    """A 2-rank half-precision ZeRO-1 run of `layout` (ONE_PROCESS_EXACT's data and steps) against the one-device
    half run (within twice the half bound) and the fp32 run (within the bound); returns its losses."""
    got = losses(devs.train(2, cfg, shards, run_dir, *ONE_PROCESS_EXACT, *devs.half_args(), *NO_SAVES, *layout))
    bound = half_bound(devs.half)
    assert sorted(got) == sorted(one_half) == sorted(one_fp32) == list(range(1, 7)), (got, one_half, one_fp32)
    for step in one_fp32:
        assert abs(got[step] - one_half[step]) <= 2 * bound, (layout, step, got[step], one_half[step], bound)
        assert abs(got[step] - one_fp32[step]) <= bound, (layout, step, got[step], one_fp32[step], bound)
    assert one_fp32[6] < one_fp32[1] - 0.05  # it trained: moving numbers compared
    return got


KILL_STEPS = 30


def kill9_then_resume_is_bit_exact(
    devs: Devices, layout: list[str], cfg, shards, tmp: Path, steps: int = KILL_STEPS
) -> int:
    """2 ranks of `layout` in half precision under train.deterministic, dropout on, a checkpoint every 2 steps:
    every rank is killed with SIGKILL once step 7 is logged (a node lost, the job killed), the same command
    resumes from the newest committed checkpoint, and the losses of all `steps` steps (30: GPU steps are fast, the
    kill must land mid-run) equal the uninterrupted run's bit for bit. Returns the step it resumed from."""
    args = [
        *layout,
        *devs.half_args(),
        "--set",
        "train.deterministic=true",
        "--max-steps",
        str(steps),
        "--save-every",
        "2",
        "--set",
        "log.tensorboard=false",
    ]
    ref_dir, run_dir = tmp / "ref", tmp / "crash"
    devs.train(2, cfg, shards, ref_dir, *args)
    procs = launch(2, cfg, shards, run_dir, *args, env_extra=devs.env(2))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while not (
        metrics.exists()
        and any(json.loads(line).get("step", 0) >= 7 for line in metrics.read_text().splitlines() if line.endswith("}"))
    ):
        assert time.time() < deadline and all(p.poll() is None for p in procs), logs(run_dir)[-3000:]
        time.sleep(0.02)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    assert wait(procs, 60) == [-signal.SIGKILL] * 2, logs(run_dir)[-3000:]
    assert_no_corrupt_checkpoint(run_dir)
    resume_step = committed_steps(run_dir)[-1]
    assert 2 <= resume_step < steps, resume_step
    devs.train(2, cfg, shards, run_dir, *args)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resume_step:08d}'}" in logs(run_dir)
    ref, got = losses(ref_dir), losses(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    assert got == ref  # bit for bit
    assert_no_corrupt_checkpoint(run_dir)
    return resume_step


def converted_eval_equals_one_device(devs: Devices, one_fp32_dir: Path, cfg, shards, tmp: Path) -> dict:
    """A TP 2 run (ONE_PROCESS_EXACT: fp32, keyed dropout, validation at step 6 at its own lengths, checkpoints at 3 and
    6 with their probes) converted to one device: `convert to-single` passes its probe (the converted model replays
    the NLLs the sharded model recorded), and `eval` of it on one device scores the validation segments as the TP 2
    run logged them (1e-5 relative: the same weights, only TP's split sums differ) and as the one-device run did (1e-4:
    that run's weights, the per-step bound of the fp32 layouts). Returns the eval's JSON."""
    env = dict(os.environ, **devs.env(1))
    run_dir = devs.train(2, cfg, shards, tmp / "tp2", *ONE_PROCESS_EXACT, "--tp", "2")
    single = tmp / "single"
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "convert", "to-single", "--ckpt", str(run_dir), "--out", str(single)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((single / "config.json").read_text())["meta"]
    assert meta["check"]["precision"] == "fp32" and "max_abs_diff" in meta["check"], meta
    (two,), (one,) = eval_records(run_dir), eval_records(one_fp32_dir)
    assert (two["step"], two["tgt_len"], two["mem_len"], two["tokens"]) == (6, 8, 24, 6 * 8 * 4), two
    out = tmp / "eval.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "eval",
            "--ckpt",
            str(single),
            "--data",
            str(shards),
            "--split",
            "valid",
            "--batch-size",
            "4",
            "--max-segments",
            "6",
            "--tgt-len",
            "8",
            "--mem-len",
            "24",
            "--device",
            "cuda" if devs.kind == "gpu" else "cpu",
            "--dtype",
            "fp32",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(out.read_text())
    assert ev["tokens"] == two["tokens"] == one["tokens"], (ev, two, one)
    assert abs(ev["nll"] - two["loss"]) <= 1e-5 * two["loss"], (ev, two)
    assert abs(ev["nll"] - one["loss"]) <= 1e-4, (ev, one)
    return ev


# ---- the scenarios on 2 GPUs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_gpu_exact(tiny_cfg, shards, tmp_path_factory) -> Path:
    """One GPU, fp32, ONE_PROCESS_EXACT (the CPU suite's one-process reference, on the GPU)."""
    return gpus().train(1, tiny_cfg, shards, tmp_path_factory.mktemp("one-exact") / "run", *ONE_PROCESS_EXACT)


@pytest.fixture(scope="module")
def one_gpu_half(tiny_cfg, shards, tmp_path_factory) -> dict:
    devs = gpus()
    run_dir = tmp_path_factory.mktemp("one-half") / "run"
    return losses(devs.train(1, tiny_cfg, shards, run_dir, *ONE_PROCESS_EXACT, *devs.half_args(), *NO_SAVES))


@pytest.mark.parametrize("layout", [["--tp", "2"], []], ids=["tp2", "dp2"])
def test_half_precision_zero1_on_two_gpus_tracks_one(layout, one_gpu_half, one_gpu_exact, tiny_cfg, shards, tmp_path):
    half_layout_tracks_one_device(
        gpus(), layout, one_gpu_half, losses(one_gpu_exact), tiny_cfg, shards, tmp_path / "run"
    )


def test_kill9_of_every_rank_then_resume_across_nccl_is_bit_exact(tiny_cfg, shards, tmp_path):
    kill9_then_resume_is_bit_exact(gpus(), ["--tp", "2"], tiny_cfg, shards, tmp_path)


def test_two_gpu_run_converts_and_evaluates_as_the_one_gpu_run(one_gpu_exact, tiny_cfg, shards, tmp_path):
    converted_eval_equals_one_device(gpus(), one_gpu_exact, tiny_cfg, shards, tmp_path)
