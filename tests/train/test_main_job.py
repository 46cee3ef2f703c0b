"""scripts/main.sh end to end at toy size: the tiny config for 24 steps (past its warmup) on the repository's
enwik8 fixture, through stop / resume / convert / eval / unigram baseline / sample / plot, and the summary it
prints at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.env import cpu_env
from helpers.fixture_data import ENWIK8

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

REPO = Path(__file__).resolve().parents[2]


def test_main_job_small(tmp_path):
    env = cpu_env(
        MEGAMEMO_VENV=sys.prefix,
        MEGAMEMO_MAIN_DIR=tmp_path / "main",
        MEGAMEMO_MAIN_CONFIG="configs/tiny-cpu.yaml",
        MEGAMEMO_MAIN_STEPS=24,
        MEGAMEMO_MAIN_SAMPLE=8,
    )
    p = subprocess.run(
        ["bash", "scripts/main.sh", str(ENWIK8)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "main"
    log = p.stdout + p.stderr
    assert "[checkpoint] resumed from" in log and "trained 24 steps" in log
    ev, uni = json.loads((out / "eval.json").read_text()), json.loads((out / "unigram.json").read_text())
    h = ENWIK8.stat().st_size * 5 // 100
    assert uni["tokens"] == h and h - ev["batch_size"] <= ev["tokens"] < h  # n - 1 targets over the columns
    assert f"test split, {ev['tokens']:,} of its {h:,} tokens scored" in log
    assert f"model {ev['bpc']:.4f} bpc | unigram baseline {uni['bits']:.4f} bpc" in log
    prompt = (out / "prompt.txt").read_bytes()
    assert len(prompt) == 200 and prompt in ENWIK8.read_bytes()[-h:]
    assert (out / "sample.txt").exists() and "sampled continuation (top-p 0.9, seed 1)" in log
    assert (out / "curves.png").stat().st_size > 0 and f"[main] plot: {out / 'curves.png'}" in log
