"""bench/attention_kernel.py's CPU smoke row (the fused kernels in Triton's interpreter, which tests/conftest.py
turns on): each form's row is written as it is measured, with times and FLOP rates that follow from them, and
the ratio to sdpa is printed. It claims no speed on the CPU; its GPU figures are on the benchmarks page."""

from __future__ import annotations

import json
import sys

from helpers.runs_cache import REPO


def test_the_cpu_smoke_rows_are_written_form_by_form(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import attention_kernel
    finally:
        sys.path.remove(str(REPO / "bench"))
    out = tmp_path / "rows.jsonl"
    assert (
        attention_kernel.main(
            ["--device", "cpu", "--tiny", "--reps", "1", "--forms", "sdpa", "eager", "fused", "--out", str(out)]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["form"] for r in rows] == ["sdpa", "eager", "fused"]
    for r in rows:
        assert "error" not in r and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r  # (times: noise on a shared CPU)
        flops = attention_kernel.flop_count(r["form"], 2, 16, r["B"], r["L"], r["M"], visible=16 * 16 + 16 * 17 // 2)
        # the same float64 formula on the same recorded time: a few u64 of a value well under 1 on a CPU
        assert abs(r["fwd_bwd_tflops"] - flops[1] / r["fwd_bwd_ms"] / 1e9) <= 1e-12, r
    printed = capsys.readouterr().out
    assert "on the CPU: the plumbing only" in printed and "fused     B=2 M=16     fwd+bwd" in printed, printed
