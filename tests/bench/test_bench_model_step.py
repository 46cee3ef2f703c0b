"""bench/model_step.py runs end to end at a tiny config (the numbers are timings: only their consistency is
checked, HFU and MFU against the flops module's two counts), and a bad --reference-code path is a clear error. The
reference-code comparison itself needs a thu-coai/LaMemo checkout, which the tests do not have (tests/fixtures holds its
outputs, not its code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megamemo.model import ModelConfig
from megamemo.model.flops import model_flops, step_flops

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--layers",
    "2",
    "--d-model",
    "64",
    "--heads",
    "2",
    "--d-head",
    "32",
    "--d-inner",
    "256",
    "--batch",
    "8",
    "--tgt-len",
    "32",
    "--mem-len",
    "32",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--threads",
    "1",
    "--precision",
    "fp32",
    "--device",
    "cpu",
]


def bench(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "model_step.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tiny_run_prints_consistent_rows():
    r = bench(*TINY)
    assert r.returncode == 0, r.stderr
    peak = float(re.search(r"matmul peak ([\d.]+) GFLOP/s", r.stdout).group(1))
    rows = re.findall(
        r"^((?:lamemo|xl|rpe)(?:-keyed)?)\s+fp32\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+"
        r"([\d.]+)%$",
        r.stdout,
        re.M,
    )
    # every variant with stream dropout masks and, beside it, keyed ones (train.dropout_masks)
    assert [row[0] for row in rows] == ["lamemo", "lamemo-keyed", "xl", "xl-keyed", "rpe", "rpe-keyed"], r.stdout
    for name, tok_s, ms, gflop, gflops, hfu, mfu in rows:
        variant = name.removesuffix("-keyed")
        cfg = ModelConfig(
            variant=variant,
            n_token=256,
            n_layer=2,
            d_model=64,
            n_head=2,
            d_head=32,
            d_inner=256,
            tgt_len=32,
            mem_len=32,
        )
        assert float(gflop) == round(step_flops(cfg, 8) / 1e9, 2)  # the flops module's count
        s = float(ms) / 1e3  # printed values, printed rounding
        # from the printed digits, on any CPU's speed: ms/step has 1 decimal, so the step time is within half a
        # unit (r_ms relative, a few % on a fast CPU's ~1 ms steps) and 1/s within r_ms / (1 - r_ms); tokens/s is
        # printed
        # as an integer (half a unit), GFLOP/step with 2 decimals and GFLOP/s with 1, each half a unit
        r_ms = 0.05e-3 / s
        r_inv = r_ms / (1 - r_ms)
        assert abs(int(tok_s) - 8 * 32 / s) <= 0.5 + 8 * 32 / s * r_inv, (tok_s, ms)
        per_s = float(gflop) / s
        assert abs(float(gflops) - per_s) <= 0.05 + per_s * (r_inv + 0.005 / float(gflop)), (gflops, gflop, ms)
        assert float(hfu) == pytest.approx(100 * float(gflops) / peak, rel=0.02, abs=100 * 0.05 / peak + 0.05)
        # MFU: the same step time over the model FLOPs (printed rounding of the time and the HFU: 2%)
        assert float(mfu) == pytest.approx(float(hfu) * model_flops(cfg, 8) / step_flops(cfg, 8), rel=0.02, abs=0.1)
    assert "lamemo/xl: time ratio" in r.stdout
    for variant in ("lamemo", "xl", "rpe"):
        assert re.search(
            rf"^{variant} keyed/stream masks: time ratio [\d.]+ \(median of the rounds' ratios [\d.]+\)$",
            r.stdout,
            re.M,
        ), r.stdout
    assert "reference code: not given" in r.stdout


def test_bad_reference_path_is_a_clear_error(tmp_path):
    r = bench(*TINY, "--reference-code", str(tmp_path))
    assert r.returncode == 1 and f"--reference-code {tmp_path}: no pytorch/mem_transformer.py" in r.stderr
