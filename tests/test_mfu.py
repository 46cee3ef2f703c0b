"""Model FLOP/s and MFU in the training progress lines (megamemo/train/metrics.py), the datasheet peak table
(megamemo/runtime/peak.py), and the "resume" record of metrics.jsonl."""
from __future__ import annotations

import json
import re

import pytest

from megamemo.config.run import ConfigError
from megamemo.model import ModelConfig
from megamemo.model.flops import flops_per_token
from megamemo.runtime.peak import device_peak, matmul_dtype, peak_flops, table_row
from megamemo.train import metrics as metrics_mod
from megamemo.train.metrics import Metrics

LINE = re.compile(r"tok/s ([\d,]+) \| ([\d.]+) ([kMGTP])FLOP/s \| MFU (n/a|[\d.]+%)")
SCALE = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_line(line: str) -> tuple[float, float, float | None]:
    """(tokens/s, model FLOP/s, MFU or None) as printed."""
    m = LINE.search(line)
    assert m, f"no throughput fields in {line!r}"
    mfu = None if m.group(4) == "n/a" else float(m.group(4)[:-1]) / 100
    return float(m.group(1).replace(",", "")), float(m.group(2)) * SCALE[m.group(3)], mfu


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run_steps(tmp_path, monkeypatch, capsys, *, peak, world, steps=4, every=2, tokens=3000, dt=0.5):
    clock = Clock()
    monkeypatch.setattr(metrics_mod.time, "perf_counter", clock)
    cfg = ModelConfig(variant="lamemo", n_token=256, n_layer=4, d_model=128, n_head=4, d_head=32, d_inner=512,
                      tgt_len=64, mem_len=64)
    fpt = flops_per_token(cfg, 6)
    m = Metrics(tmp_path, enabled=True, every=every, unit="bpc", tensorboard=False, start_step=0,
                flops_per_token=fpt, peak_flops=peak, world_size=world)
    m.start_window()
    for s in range(1, steps + 1):
        clock.t += dt
        m.train_step({"step": s, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0,
                      "tokens": tokens})
    m.close()
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return fpt, out, recs


def test_log_line_flops_and_mfu_are_tokens_per_s_times_flops_per_token(tmp_path, monkeypatch, capsys):
    peak, world = 312e12, 8
    fpt, lines, recs = run_steps(tmp_path, monkeypatch, capsys, peak=peak, world=world)
    assert len(lines) == 2                                    # every 2 steps
    for line in lines:
        tok_s, flops, mfu = parse_line(line)
        assert tok_s == 3000 * 2 / 1.0                        # two steps of 3000 tokens in 2 x 0.5 s
        assert flops == pytest.approx(tok_s * fpt, rel=5e-3)  # printed to 3 significant digits
        assert mfu == pytest.approx(tok_s * fpt / (world * peak), abs=5e-4)   # printed as x.x%
    logged = [r for r in recs if "tokens_per_s" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for r in logged:
        assert r["model_flops_per_s"] == pytest.approx(r["tokens_per_s"] * fpt, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (world * peak), rel=1e-12)
    assert all("mfu" not in r for r in recs if "tokens_per_s" not in r)


def test_unknown_peak_prints_na(tmp_path, monkeypatch, capsys):
    fpt, lines, recs = run_steps(tmp_path, monkeypatch, capsys, peak=None, world=2)
    tok_s, flops, mfu = parse_line(lines[0])
    assert mfu is None and flops == pytest.approx(tok_s * fpt, rel=5e-3)
    assert recs[1]["mfu"] is None and recs[1]["model_flops_per_s"] == pytest.approx(recs[1]["tokens_per_s"] * fpt)


# ---- the peak table ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,dtype,tflops", [
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100S-PCIE-32GB", "fp16", 130.0),
    ("Tesla V100-SXM2-32GB", "bf16", None),               # no bf16 tensor cores
    ("Tesla V100-SXM2-32GB", "tf32", None),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
    ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),               # H100 SXM5
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA A10", "bf16", None),                          # not A100
    ("NVIDIA GeForce RTX 4090", "bf16", None),
])
def test_peak_by_device_name(name, dtype, tflops):
    got = peak_flops(name, dtype)
    assert (got is None) if tflops is None else got == pytest.approx(tflops * 1e12)


def test_table_rows_and_dtypes():
    assert table_row("NVIDIA H100 PCIe") == "H100 PCIe" and table_row("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert table_row("Tesla V100-DGXS-32GB") == "V100 SXM2" and table_row("AMD Instinct MI300X") is None
    assert matmul_dtype("fp32") == "fp32" and matmul_dtype("fp32", "high") == "tf32"
    assert matmul_dtype("bf16", "high") == "bf16"


def test_cpu_peak_and_override():
    p = device_peak("cpu", "fp32", environ={})
    assert p.flops is None and p.source.startswith("n/a")
    p = device_peak("cpu", "fp32", environ={"MEGAMEMO_PEAK_TFLOPS": "0.25"})
    assert p.flops == 0.25e12 and "MEGAMEMO_PEAK_TFLOPS" in p.source
    for bad in ("fast", "0", "-3", "inf"):
        with pytest.raises(ConfigError, match="MEGAMEMO_PEAK_TFLOPS"):
            device_peak("cpu", "fp32", environ={"MEGAMEMO_PEAK_TFLOPS": bad})


# ---- resume records ----------------------------------------------------------------------------------------
def test_resume_record_after_trimmed_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 8)] + [{"kind": "eval", "step": 6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')   # a line cut by a crash
    before = path.read_text()
    Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=5).close()
    assert path.read_text() == before     # a resume that fails before its first step changes nothing
    step6 = {"step": 6, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0, "tokens": 8}
    for _ in range(2):                    # resuming twice from the same checkpoint leaves one marker there
        m = Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=5)
        m.train_step(dict(step6))
        m.close()
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in recs] == [("train", s) for s in range(1, 6)] + [("resume", 5),
                                                                                          ("train", 6)]
    assert isinstance(recs[-2]["time"], float)
    m = Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=0)
    m.train_step(dict(step6, step=1))
    m.close()
    assert [json.loads(ln)["kind"] for ln in path.read_text().splitlines()] == ["train"]   # a fresh start
