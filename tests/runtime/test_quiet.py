"""Quiet logs (megamemo/runtime/quiet.py, installed by the `megamemo` entry point): third-party start-up warnings never
reach the terminal, Python's -W / PYTHONWARNINGS still win, and only rank 0 prints unless MEGAMEMO_LOG_ALL_RANKS=1.
The training runs use --tp 2: that imports megatron-core, whose Transformer Engine / Apex fallback warnings
every process printed before."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_train_runs import TINY as TRAIN_TINY

from megamemo.model.flops import flops_per_token, model_flops_per_token
from megamemo.runtime import quiet
from megamemo.runtime.dist import free_port
from megamemo.train.config import load

REPO = Path(__file__).resolve().parents[2]
NOISE = re.compile(r"Transformer Engine|Apex|CUDA_DEVICE_MAX_CONNECTIONS|Warning")
TE_APEX = "Transformer Engine and Apex are not installed"

TINY = TRAIN_TINY.replace("max_steps: 8", "max_steps: 2").replace(
    "save_every: 3, keep_last: 10", "save_every: 100, keep_last: 1"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from helpers.fixture_data import ENWIK8

    from megamemo.data.cli import prepare_main

    root = tmp_path_factory.mktemp("quiet")
    assert prepare_main(["enwik8", "--raw", str(ENWIK8), "--out", str(root / "shards"), "--quiet"]) == 0
    (root / "tiny.yaml").write_text(TINY)
    return root


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", quiet.ALL_RANKS_ENV)}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def train_tp2(root: Path, name: str, **env_extra) -> list[tuple[str, str]]:
    """Two ranks of `python -m megamemo train --tp 2`; [(stdout, stderr)] per rank."""
    port = free_port()
    procs = []
    for r in range(2):
        env = clean_env(
            RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env_extra
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megamemo",
                    "train",
                    "--config",
                    str(root / "tiny.yaml"),
                    "--data",
                    str(root / "shards"),
                    "--run-dir",
                    str(root / name),
                    "--tp",
                    "2",
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_training_terminal_is_quiet_and_progress_carries_hfu_and_mfu(setup):
    outs = train_tp2(setup, "quiet", MEGAMEMO_PEAK_TFLOPS="0.002")
    for rank, (_, err) in enumerate(outs):
        assert not NOISE.search(err), f"rank {rank} stderr:\n{err}"
    assert outs[1][0] == "", "rank 1 printed to stdout"  # only rank 0 reports progress
    out0 = outs[0][0]
    # the numbers of each progress line are its own tokens/s x the flops module's FLOPs per token: executed (HFU)
    # and the PaLM convention's (MFU)
    cfg = load(str(setup / "tiny.yaml"), [])
    fpt = flops_per_token(cfg.model, 4)  # dp 1: one micro-batch of 4 streams
    mfpt = model_flops_per_token(cfg.model)
    assert re.search(
        rf"\| {fpt / 1e3:.3g} kFLOP/token executed \(HFU\), {mfpt / 1e3:.3g} kFLOP/token model "
        rf"\(MFU\), peak 0.002 TFLOP/s",
        out0,
    ), out0
    assert "| cpu kernels |" in out0, out0  # train.kernels=auto on a CPU: megamemo/kernels/
    # the unit follows the speed (format_flops): k, M or G FLOP/s, whichever this CPU reaches
    lines = re.findall(r"tok/s ([\d,]+) \| ([\d.]+) ([kMG])FLOP/s \| HFU ([\d.]+)% \| MFU ([\d.]+)%", out0)
    assert len(lines) == 2, out0
    for tok_s, flops, unit, hfu, mfu in lines:
        tok_s = float(tok_s.replace(",", ""))
        # FLOP/s printed with 3 significant digits (half a unit: 0.5%) from the unrounded tok/s, printed as an
        # integer (half a unit: 0.5 / tok_s relative, more than 0.5% below 100 tok/s on a slow CPU)
        scale = {"k": 1e3, "M": 1e6, "G": 1e9}[unit]
        assert float(flops) * scale == pytest.approx(tok_s * fpt, rel=0.005 + 0.5 / tok_s + 1e-9)
        for printed, per_token in ((hfu, fpt), (mfu, mfpt)):
            assert float(printed) / 100 == pytest.approx(
                tok_s * per_token / (2 * 0.002e12), abs=0.0005 + 0.005 * float(printed) / 100
            )


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_pythonwarnings_brings_the_warnings_back(setup):
    outs = train_tp2(setup, "loud", PYTHONWARNINGS="default")
    for rank, (_, err) in enumerate(outs):
        assert TE_APEX in err, f"rank {rank} stderr:\n{err}"


# ---- the filters themselves ------------------------------------------------------------------------------------
def emit(message: str, module: str = "megatron.core.optimizer", category=UserWarning) -> None:
    warnings.warn_explicit(message, category, "x.py", 1, module=module)


def test_filters_match_only_the_known_messages(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet.install({"DS_ACCELERATOR": "cpu"}) == {"warning_filters": True, "rank_quiet": False}
        emit(TE_APEX + ". Falling back to Torch optimizers.")
        emit(
            "When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
        )
        emit("something else megatron says")
        emit(TE_APEX, module="mycode")  # the same words from elsewhere are not megatron's
    assert [str(w.message) for w in seen] == ["something else megatron says", TE_APEX]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install({"DS_ACCELERATOR": "cuda"})  # on GPUs the CUDA advice is real advice
        emit(
            "When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
        )
    assert len(seen) == 1


def test_user_choice_wins(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    assert quiet.user_set_warnings({"PYTHONWARNINGS": "default"})
    assert not quiet.user_set_warnings({})
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    assert quiet.user_set_warnings({})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet.install({"RANK": "3"})["warning_filters"] is False
        emit(TE_APEX)
    assert len(seen) == 1


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "1", "WORLD_SIZE": "2"},
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"},
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"},
    ],
)
def test_launcher_rank(env):
    assert quiet.launcher_rank(env) == int(next(iter(env.values())))
    assert quiet.launcher_rank({}) == 0


SNIPPET = """
import warnings
from megamemo.runtime import quiet
quiet.install()
import deepspeed                      # sets its logger's level at import, after install()
from deepspeed.utils import logger
logger.warning("a DeepSpeed warning")
logger.error("a DeepSpeed error")
warnings.warn("a warning from megamemo code")
print("done")
"""


@pytest.mark.parametrize("rank,all_ranks,shown", [("0", "", True), ("1", "", False), ("1", "1", True)])
def test_other_ranks_print_errors_only(rank, all_ranks, shown):
    env = clean_env(RANK=rank, WORLD_SIZE="2", **({quiet.ALL_RANKS_ENV: all_ranks} if all_ranks else {}))
    r = subprocess.run([sys.executable, "-c", SNIPPET], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    both = r.stdout + r.stderr
    assert r.returncode == 0 and "done" in r.stdout, both
    assert "a DeepSpeed error" in both  # errors always
    assert ("a DeepSpeed warning" in both) == shown, both
    assert ("a warning from megamemo code" in both) == shown, both
