"""scripts/gpu_check.sh, the device check, rehearsed on the CPU (--device cpu: tiny sizes) so that its plumbing
cannot rot between the rare sessions that have a GPU: every section runs and reports, a section that runs out of
its budget is recorded as such and the next ones still run, and the report carries the training run's kill -9 /
resume / convert / eval verdicts, the step bench's forms and the planner beside what was measured."""
from __future__ import annotations

import json
import subprocess

import pytest

from runs_cache import REPO

pytestmark = pytest.mark.multiproc


def test_gpu_check_plumbing_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--out", str(out), "--device", "cpu",
                        "--budget", "model_step=0.5", "train=400", "gpu_step=200"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    rep = json.loads((out / "gpu-report.json").read_text())
    s = rep["sections"]
    assert list(s) == ["env", "gpu_step", "train", "plan", "tests", "model_step", "multigpu"], list(s)
    assert s["model_step"]["status"] == "timeout" and r.returncode == 1, (s["model_step"], r.stdout[-2000:])
    for name in ("env", "gpu_step", "train", "plan", "tests", "multigpu"):
        assert s[name]["status"] == "ok", (name, s[name], r.stdout[-3000:])
    assert s["env"]["result"]["deepspeed"] and s["env"]["result"]["ds_ops"], s["env"]
    rows = {row["form"]: row for row in s["gpu_step"]["result"]["rows"]}
    assert set(rows) == {"eager", "compiled"} and rows["eager"]["first_loss"] == rows["compiled"]["first_loss"]
    train = s["train"]["result"]
    assert train["resume_bit_equal"] is True and train["eval_equal"] is True, train
    assert int(train["resume_from"]) > 0 and train["tokens_per_s"] > 0, train
    plan = s["plan"]["result"]
    assert plan["predicted_step_ms"] > 0 and plan["measured_step_ms"] > 0, plan
    assert "needs 2 or more" in s["multigpu"]["result"]["skipped"]
    md = (out / "gpu-report.md").read_text()
    for text in ("| model_step | timeout |", "losses bit-equal: True", "## bench/gpu_step.py", "| compiled |",
                 "beside the training run"):
        assert text in md, (text, md)
