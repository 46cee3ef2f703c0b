"""The multi-GPU scenarios of tests/gpu/test_multigpu.py rehearsed on the CPU (gloo, bf16), so that their logic - the
runs' arguments and the bounds - has run before they first meet GPUs: the same functions, given CPU devices (the
kill -9 / resume and convert / eval scenarios are left to the GPU run: their CPU forms are
tests/train/test_train_runs.py
and tests/interop/test_convert_parallel.py, and two more minutes of the suite were not worth the repetition). What only
GPUs can
show (NCCL, cuBLAS's kernels, fp16 on hardware that has it) stays in the GPU run. Also: which half precision a compute
capability gets, and conftest's 4-GPU marker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.fixture_data import REPO
from test_multigpu import (
    NO_SAVES,
    ONE_PROCESS_EXACT,
    Devices,
    half_bound,
    half_layout_tracks_one_device,
    half_precision,
)
from test_train_runs import losses

CPU = Devices("cpu", "bf16")


@pytest.fixture
def one_cpu_exact(tiny_cfg, shards, reference_runs):
    """The session's one-process fp32 reference (helpers/runs_cache.py ONE_PROCESS_EXACT), shared with other modules."""
    return reference_runs.get(1, tiny_cfg, shards, *ONE_PROCESS_EXACT)


@pytest.fixture(scope="module")
def one_cpu_half(tiny_cfg, shards, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("one-half") / "run"
    return losses(CPU.train(1, tiny_cfg, shards, run_dir, *ONE_PROCESS_EXACT, *CPU.half_args(), *NO_SAVES))


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["--tp", "2"], []], ids=["tp2", "dp2"])
def test_half_precision_zero1_on_two_ranks_tracks_one(layout, one_cpu_half, one_cpu_exact, tiny_cfg, shards, tmp_path):
    got = half_layout_tracks_one_device(
        CPU, layout, one_cpu_half, losses(one_cpu_exact), tiny_cfg, shards, tmp_path / "run"
    )
    assert got != losses(one_cpu_exact)  # bf16 did round: not two fp32 runs compared


@pytest.mark.parametrize(
    "capability, half",
    [((6, 0), "fp16"), ((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 6), "bf16"), ((9, 0), "bf16")],
)
def test_half_precision_follows_compute_capability(capability, half):
    """P100 / V100 / T4 train in fp16, A100 / RTX 30xx / H100 in bf16; fp16's bound is bf16's over 2^3 (11 vs 8
    significant bits)."""
    assert half_precision(capability) == half
    assert half_bound("bf16") == 0.005 and half_bound("fp16") == 0.005 / 8


@pytest.mark.multiproc
def test_the_four_gpu_test_is_skipped_naming_its_count():
    """`pytest -m multigpu` where torch sees fewer than 4 GPUs: TP 2 x PP 2 is skipped saying it needs 4 (conftest's
    DEVICE_MARKERS gpu4), not run on too few nor silently dropped."""
    env = {k: v for k, v in os.environ.items() if k != "MEGAMEMO_FORBID_SKIPS"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-q",
            "-rs",
            "-m",
            "multigpu",
            "tests/gpu/test_multigpu.py",
            "-k",
            "tp2_x_pp2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 skipped" in r.stdout and "needs 4 CUDA device(s), torch sees 0" in r.stdout, r.stdout[-3000:]
