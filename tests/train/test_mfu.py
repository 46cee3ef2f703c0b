"""Executed FLOP/s, HFU and MFU in the training progress lines (megamemo/train/metrics.py), the two FLOP counts they
divide (megamemo/model/flops.py) against hand-computed values, the datasheet peak table (megamemo/runtime/peak.py),
and the "resume" record of metrics.jsonl."""

from __future__ import annotations

import json
import re

import pytest

from megamemo.config.run import ConfigError
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.flops import flops_per_token, model_flops, model_flops_per_token, step_flops
from megamemo.runtime.peak import device_peak, matmul_dtype, peak_flops, table_row
from megamemo.train import metrics as metrics_mod
from megamemo.train.metrics import Metrics

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.

LINE = re.compile(r"tok/s ([\d,]+) \| ([\d.]+) ([kMGTP])FLOP/s \| HFU (n/a|[\d.]+%) \| MFU (n/a|[\d.]+%)")
SCALE = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def percent(text: str) -> float | None:
    return None if text == "n/a" else float(text[:-1]) / 100


def parse_line(line: str) -> tuple[float, float, float | None, float | None]:
    """(tokens/s, executed FLOP/s, HFU or None, MFU or None) as printed."""
    m = LINE.search(line)
    assert m, f"no throughput fields in {line!r}"
    return (
        float(m.group(1).replace(",", "")),
        float(m.group(2)) * SCALE[m.group(3)],
        percent(m.group(4)),
        percent(m.group(5)),
    )


# ---- the two counts, by hand ---------------------------------------------------------------------------------
# 2 layers, d_model 4, one head of width 2 (H = 2), d_inner 8, a tied vocabulary of 10; segments of L = 3 tokens
# over M = 2 memory rows (klen 5), B = 2 streams: 6 target tokens a micro-batch
SMALL = dict(n_token=10, n_layer=2, d_model=4, n_head=1, d_head=2, d_inner=8, tgt_len=3, mem_len=2)


def small(variant: str) -> ModelConfig:
    return ModelConfig(variant=variant, **SMALL)


def test_parameter_count_by_hand_is_the_built_models():
    """N of the MFU formula, by hand: per layer Q/K/V 3x4x2 = 24, r_net 4x2 = 8, o_net 2x4 = 8, FFN 4x8 + 8 + 8x4 + 4
    = 76, two layer norms 16: 132, x2 layers = 264; the tied table 10x4 = 40 and the output bias 10; the position
    biases u, v (2 each) and LaMemo's v- (2). LaMemo 320, XL 318. The built models hold exactly that many."""
    for variant, n in (("lamemo", 320), ("xl", 318)):
        assert sum(p.numel() for p in MemTransformerLM(small(variant)).parameters()) == n


def test_executed_flops_by_hand():
    """HFU's count, forward per layer (2 m n k a product), LaMemo over klen = 5 rows (memory and current):
    Q/K/V 2x5x4x6x2 = 480, r_net over 5 + 2 distances 2x7x4x2 = 112, the 3 causal products (content, position,
    values) 3x2x3x5x2x2 = 360, the look-ahead's content and values 2x(2x2x2x2x2) = 64 over min(M, L) = 2 keys and
    its position scores over M = 2 distances 2x2x2x2x2 = 32, o_net 2x5x2x4x2 = 160, FFN 2x(2x5x4x8x2) = 1280:
    2488. The top layer skips its 2 memory rows' o_net (64), FFN (512) and look-ahead (96, M <= L): 2 x 2488 - 672
    = 4304. The output layer 2x6x4x10 = 480: forward 4784, step 3x = 14352, per token 14352 / 6 = 2392.
    XL: queries for 3 rows 96, K and V for 5 rows 320, r_net over 5 distances 80, the causal products 360, o_net
    96, FFN 768: 1720 a layer, 2 x 1720 + 480 = 3920, step 11760, per token 1960."""
    assert step_flops(small("lamemo"), 2) == 14352 and flops_per_token(small("lamemo"), 2) == 2392
    assert step_flops(small("xl"), 2) == 11760 and flops_per_token(small("xl"), 2) == 1960


def test_model_flops_by_hand():
    """MFU's count, PaLM's 6 N + attention with klen = M + L = 5 keys and three products (content, position,
    values): per token 6 N + 3 (fwd + bwd) x 3 products x 2 x 5 keys x 2 (H x Q) x 2 layers = 6 N + 360.
    LaMemo: 6 x 320 + 360 = 2280, XL 6 x 318 + 360 = 2268; a micro-batch of 6 tokens: 13680 and 13608. RPE has
    no memory, klen = L = 3: attention 3 x 3 x 2 x 3 x 2 x 2 = 216, N = 318 (as XL): 2124. The same N and lengths give
    the same figure at any B; LaMemo executes more than it is credited (2392 against 2280), XL less (1960: no
    memory recompute, and 6 N charges the tied table 6 x 50 = 300 a token where the output layer does 240)."""
    assert model_flops_per_token(small("lamemo")) == 2280 and model_flops(small("lamemo"), 2) == 13680
    assert model_flops_per_token(small("xl")) == 2268 and model_flops(small("xl"), 2) == 13608
    assert model_flops_per_token(small("rpe")) == 2124
    assert model_flops(small("lamemo"), 5) == 5 * 3 * 2280
    # other lengths: L = 4, M = 6 -> klen 10: 6 x 320 + 18 x 2 x 2 x 10 = 2640 per token, 4 x 2 tokens
    assert model_flops_per_token(small("lamemo"), tgt_len=4, mem_len=6) == 2640
    assert model_flops(small("lamemo"), 2, tgt_len=4, mem_len=6) == 8 * 2640


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run_steps(tmp_path, monkeypatch, capsys, *, peak, world, steps=4, every=2, tokens=3000, dt=0.5):
    clock = Clock()
    monkeypatch.setattr(metrics_mod.time, "perf_counter", clock)
    fpt, mfpt = 2392.0, 2280.0  # the small LaMemo's counts at B = 2 (worked out above)
    m = Metrics(
        tmp_path,
        enabled=True,
        every=every,
        unit="bpc",
        tensorboard=False,
        start_step=0,
        flops_per_token=fpt,
        model_flops_per_token=mfpt,
        peak_flops=peak,
        world_size=world,
    )
    m.start_window()
    for s in range(1, steps + 1):
        clock.t += dt
        m.train_step(
            {"step": s, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0, "tokens": tokens}
        )
    m.close()
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return out, recs


def test_log_line_and_records_carry_hfu_and_mfu(tmp_path, monkeypatch, capsys):
    """Two steps of 3000 tokens in 2 x 0.5 s: 6000 tokens/s; executed 6000 x 2392 = 14.352 MFLOP/s, model 6000 x
    2280 = 13.68 MFLOP/s; over 8 devices of 1 MFLOP/s: HFU 179.4%, MFU 171.0%."""
    lines, recs = run_steps(tmp_path, monkeypatch, capsys, peak=1e6, world=8)
    assert len(lines) == 2  # every 2 steps
    for line in lines:
        assert parse_line(line) == (6000, 14.4e6, 1.794, 1.71)  # printed: 3 digits, 0.1%
    logged = [r for r in recs if "tokens_per_s" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for r in logged:
        assert r["tokens_per_s"] == 6000
        assert r["hfu_flops_per_s"] == pytest.approx(14.352e6, rel=1e-12)
        assert r["mfu_flops_per_s"] == pytest.approx(13.68e6, rel=1e-12)
        assert r["hfu"] == pytest.approx(1.794, rel=1e-12) and r["mfu"] == pytest.approx(1.71, rel=1e-12)
        assert "model_flops_per_s" not in r  # the old key, which held the executed figure
    assert all("mfu" not in r and "hfu" not in r for r in recs if "tokens_per_s" not in r)


def test_unknown_peak_prints_na(tmp_path, monkeypatch, capsys):
    lines, recs = run_steps(tmp_path, monkeypatch, capsys, peak=None, world=2)
    assert parse_line(lines[0]) == (6000, 14.4e6, None, None)
    assert recs[1]["hfu"] is None and recs[1]["mfu"] is None
    assert recs[1]["hfu_flops_per_s"] == pytest.approx(14.352e6) and recs[1]["mfu_flops_per_s"] == pytest.approx(
        13.68e6
    )


# ---- the peak table ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7),
        ("Tesla V100-PCIE-32GB", "fp16", 112.0),
        ("Tesla V100S-PCIE-32GB", "fp16", 130.0),
        ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
        ("Tesla V100-SXM2-32GB", "tf32", None),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # H100 SXM5
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A10", "bf16", None),  # not A100
        ("NVIDIA GeForce RTX 4090", "bf16", None),
    ],
)
def test_peak_by_device_name(name, dtype, tflops):
    got = peak_flops(name, dtype)
    assert (got is None) if tflops is None else got == pytest.approx(tflops * 1e12)


def test_table_rows_and_dtypes():
    assert table_row("NVIDIA H100 PCIe") == "H100 PCIe" and table_row("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert table_row("Tesla V100-DGXS-32GB") == "V100 SXM2" and table_row("AMD Instinct MI300X") is None
    assert matmul_dtype("fp32") == "fp32" and matmul_dtype("fp32", "high") == "tf32"
    assert matmul_dtype("bf16", "high") == "bf16"


def test_one_gpu_catalogue_serves_the_peak_and_the_planner():
    """runtime/gpus.py is the one table: the peak a device name gets and the planner's row of the same kind are its
    entry's figures, and an unknown kind is one message wherever it is asked for."""
    from megamemo.plan.devices import DEVICES, device
    from megamemo.runtime.gpus import GPUS, PLANNED, gpu

    assert PLANNED == (
        "v100-16g",
        "v100-32g",
        "a100-40g",
        "a100-80g",
        "h100-nvl",
        "h100-pcie",
        "h100-80g",
        "h200",
        "b200",
        "l40s",
    )
    for kind in PLANNED:
        g, d = GPUS[kind], DEVICES[kind]
        assert d.peak == {k: v * 1e12 for k, v in g.peak_tflops.items()} and d.mem_bw == g.mem_bw
        assert d.link == tuple(x * 1e9 for x in g.link) and g.fabric in d.source and g.memory_gib > 0
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == GPUS["a100-40g"].peak_tflops["bf16"] * 1e12
    for ask in (lambda: device("a100-81g"), lambda: gpu("a100-81g")):
        with pytest.raises(ValueError, match=r"^unknown device kind 'a100-81g' \(nearest: a100-80g\); known: v100-16g"):
            ask()
    with pytest.raises(ValueError, match="unknown device kind 'h200-nvl'"):
        gpu("h200-nvl")  # a peak-only entry: not a kind the planner takes


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
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')  # a line cut by a crash
    before = path.read_text()
    Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=5).close()
    assert path.read_text() == before  # a resume that fails before its first step changes nothing
    step6 = {"step": 6, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0, "tokens": 8}
    for _ in range(2):  # resuming twice from the same checkpoint leaves one marker there
        m = Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=5)
        m.train_step(dict(step6))
        m.close()
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in recs] == [("train", s) for s in range(1, 6)] + [("resume", 5), ("train", 6)]
    assert isinstance(recs[-2]["time"], float)
    m = Metrics(tmp_path, enabled=True, every=10, unit="bpc", tensorboard=False, start_step=0)
    m.train_step(dict(step6, step=1))
    m.close()
    assert [json.loads(ln)["kind"] for ln in path.read_text().splitlines()] == ["train"]  # a fresh start
