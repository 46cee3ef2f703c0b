"""scripts/gpu_check.sh, the device check, rehearsed on the CPU (--device cpu: tiny sizes) so that its plumbing
cannot rot between the rare sessions that have a GPU: every section runs and reports in order (the attention bench
first after the versions), a section that runs out of its budget is recorded as such with the rows it had written
and the next ones still run, the full-depth step's forms come with the optimizer step and one compiled layer's
top kernels, and the training run's kill -9 / resume / convert / eval verdicts are taken with the eval at the
validation's dtype and attention form. Beside it: the GPU plan fits 9 minutes, and the pieces each of these
promises rests on, tested alone so that breaking one fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers.runs_cache import REPO

sys.path[:0] = [str(REPO / "scripts")]
import gpu_check  # noqa: E402
import gpu_check_sections as S  # noqa: E402
import gpu_check_train as T  # noqa: E402

ORDER = ["env", "attention_kernel", "full_step", "train", "plan", "tests", "ds_ops", "model_step", "multigpu"]


@pytest.mark.multiproc
def test_gpu_check_plumbing_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(
        [
            "bash",
            str(REPO / "scripts/gpu_check.sh"),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--budget",
            "model_step=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    rep = json.loads((out / "gpu-report.json").read_text())
    s = rep["sections"]
    assert list(s) == ORDER, list(s)
    assert s["model_step"]["status"] == "timeout" and r.returncode == 1, (s["model_step"], r.stdout[-2000:])
    for name in set(ORDER) - {"model_step"}:
        assert s[name]["status"] == "ok", (name, s[name], r.stdout[-3000:])
    env = s["env"]["result"]
    assert env["torch"] and env["deepspeed"] and s["ds_ops"]["result"]["ds_ops"], (env, s["ds_ops"])
    assert [x["form"] for x in s["attention_kernel"]["result"]["rows"]] == ["sdpa", "eager", "fused"]
    rows = s["full_step"]["result"]["rows"]
    steps = {(x["form"], x["batch"]): x for x in rows if "tokens_per_s" in x}
    assert {("eager", 4), ("compiled", 4)} <= set(steps) and len(steps) == 3, sorted(steps)  # then 8: the fastest
    assert steps["eager", 4]["first_loss"] == steps["compiled", 4]["first_loss"]
    opt = [x for x in rows if x["form"] == "optimizer"]
    prof = [x for x in rows if x["form"] == "profile"]
    assert opt and opt[0]["ms_per_step"] > 0 and opt[0]["params"] == rows[0]["params"], rows
    assert prof and prof[0]["of"] == "compiled" and len(prof[0]["kernels"]) >= 5, prof
    train = s["train"]["result"]
    assert train["resume_bit_equal"] is True and train["eval_equal"] is True, train
    # the same dtype and form as the validation: equal to rounding (fp32 against the bf16 validation: 1.9e-5 here)
    assert train["eval_as"] == "bf16, eager attention" and train["eval_rel_diff"] <= 1e-6, train
    assert int(train["resume_from"]) > 0 and train["tokens_per_s"] > 0, train
    plan = s["plan"]["result"]
    assert plan["predicted_step_ms"] > 0 and plan["measured_step_ms"] > 0, plan
    assert "needs 2 or more" in s["multigpu"]["result"]["skipped"]
    md = (out / "gpu-report.md").read_text()
    assert md.splitlines()[2].startswith(f"torch {env['torch']}, CUDA None, driver"), md[:400]
    mb8 = next(form for form, batch in steps if batch == 8)
    for text in (
        "| model_step | timeout |",
        "losses bit-equal: True",
        "## bench/attention_kernel.py",
        f"| {mb8} | 8 |",
        "Optimizer step (one GPU)",
        "Top CPU operators of one compiled layer",
        "beside the training run",
        "convert to single + eval (bf16, eager attention)",
    ):
        assert text in md, (text, md)


def test_the_plan_of_one_gpu_fits_nine_minutes_and_runs_nothing(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_check.py"), "--plan"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    budgets = dict(re.findall(r"^  (\w+)\s+(\d+) s", r.stdout, re.M))
    assert list(budgets)[:3] == ["env", "attention_kernel", "full_step"] and "total" in budgets, r.stdout
    total = int(budgets.pop("total"))
    assert total == sum(map(int, budgets.values())) <= 540, r.stdout
    for name in ("env", "attention_kernel", "full_step", "train", "plan", "tests"):
        assert int(budgets[name]) > 0, (name, r.stdout)
    assert int(budgets["multigpu"]) == 0 and list(tmp_path.iterdir()) == [], r.stdout
    # a plan over the limit says so by its exit code; two GPUs add the multi-GPU set
    over = dict(gpu_check.GPU_BUDGET_S, train=600)
    assert gpu_check.print_plan(gpu_check.plan("cuda", 1, over), "cuda", 1) == 1
    assert sum(s for _, s, _ in gpu_check.plan("cuda", 2, gpu_check.GPU_BUDGET_S)) == total + 120


def _ctx(tmp_path):
    ctx = gpu_check.Context(tmp_path, "cpu", None)
    ctx.train_steps, ctx.tests_k, ctx.full_step_forms = 12, None, ["eager"]
    return ctx


def test_a_section_killed_past_its_budget_keeps_the_rows_it_had_written(tmp_path):
    ctx = _ctx(tmp_path)
    row = {"form": "eager", "batch": 4, "tokens_per_s": 1.0}

    def bench(ctx):  # a bench that writes one row, then hangs
        code = (
            f"import json; open({str(ctx.rows_path('full_step'))!r}, 'a').write(json.dumps({row!r}) + '\\n'); "
            "import time; time.sleep(60)"
        )
        S.sh([sys.executable, "-c", code], tmp_path / "bench.log", ctx.left("full_step"))
        return {"rows": []}

    entry = gpu_check.run_section(ctx, "full_step", bench, 3)
    assert entry["status"] == "timeout" and entry["result"]["rows"] == [row], entry
    assert entry["seconds"] < 30 and "ran past" in entry["result"]["error"], entry

    def train(ctx):  # the training run's first phase done, then a failure
        ctx.row("train", {"phase": "ref", "tokens_per_s": 5.0, "attention": "eager"})
        raise RuntimeError("exit 1: the resume failed")

    entry = gpu_check.run_section(ctx, "train", train, 10)
    assert entry["status"] == "failed" and entry["result"]["tokens_per_s"] == 5.0, entry
    assert "phase" not in entry["result"] and "resume failed" in entry["result"]["error"], entry

    def tests(ctx):  # pytest killed after two results
        (ctx.out / "pytest.log").write_text(
            "tests/gpu/test_gpu.py::test_a PASSED   [ 10%]\n[gw1] [ 20%] FAILED tests/gpu/test_gpu.py::test_b[bf16]\n"
            "[gw0] [ 30%] SKIPPED tests/gpu/test_gpu.py::test_c\nSKIPPED [1] tests/gpu/test_gpu.py:12: no GPU\n"
        )
        raise S.Timeout("pytest ran past 3s")

    entry = gpu_check.run_section(ctx, "tests", tests, 10)
    assert entry["status"] == "timeout" and entry["result"]["passed"] == 1, entry
    assert [(x["test"], x["result"]) for x in entry["result"]["results"]] == [
        ("test_a", "passed"),
        ("test_b[bf16]", "failed"),
        ("test_c", "skipped"),
    ], entry


def test_the_bench_writes_each_row_before_the_next_form_runs(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_step
    finally:
        sys.path.remove(str(REPO / "bench"))
    rows = tmp_path / "rows.jsonl"
    seen = []
    real = gpu_step.run_form

    def run_form(form, *args):
        seen.append([json.loads(line)["form"] for line in rows.read_text().splitlines()] if rows.exists() else [])
        if form == "fused":
            raise RuntimeError("a form that fails")
        return real(form, *args)

    monkeypatch.setattr(gpu_step, "run_form", run_form)
    assert (
        gpu_step.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--forms",
                "eager",
                "fused",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--jsonl",
                str(rows),
            ]
        )
        == 1
    )
    assert seen == [["setup"], ["setup", "eager"]], seen
    assert [json.loads(line)["form"] for line in rows.read_text().splitlines()] == ["setup", "eager", "fused"]


def test_eval_is_compared_at_the_validations_dtype_and_attention_form(tmp_path):
    line = (
        "[train] lamemo 1.00M params | ... | bf16 | ... | fused attention | compiled layers | run dir r | fresh start"
    )
    assert T.run_form(line) == ("fused", "compiled")
    val = {
        "kind": "eval",
        "split": "valid",
        "loss": 2.5,
        "tokens": 512,
        "tgt_len": 16,
        "mem_len": 16,
        "clamp_len": None,
        "same_length": False,
    }
    args = T.eval_args(tmp_path / "single", tmp_path / "data", val, "fused", "bf16", 4, 4, "cpu", tmp_path / "e.json")
    pairs = dict(zip(args, args[1:], strict=False))
    assert pairs["--dtype"] == "bf16" and pairs["--attention"] == "fused", args
    assert pairs["--tgt-len"] == "16" and pairs["--mem-len"] == "16" and "--no-same-length" in args, args
    assert pairs["--batch-size"] == "4" and pairs["--max-segments"] == "4" and "--clamp-len" not in args, args
    # the parser of `megamemo eval` takes them as they are
    from megamemo.commands.eval import parse_args

    assert args[0] == "eval"
    a = parse_args(args[1:])
    assert (a.dtype, a.attention, a.same_length) == ("bf16", "fused", False)
    # equal: the same tokens, the nll within 1e-4 relative (fp32 against bf16 rounding is far more)
    assert T.eval_equal({"nll": 2.5 * (1 + 5e-5), "tokens": 512}, val)
    assert not T.eval_equal({"nll": 2.5 * (1 + 1e-3), "tokens": 512}, val)
    assert not T.eval_equal({"nll": 2.5, "tokens": 511}, val)


def test_the_full_depth_step_times_the_forms_auto_would_choose_between(monkeypatch):
    """On an sm90 GPU (faked: the chooser's device questions answered as there), `--forms auto` is every attention
    form auto times, each in eager and compiled layers: the fused kernels included."""
    import torch

    import megamemo.train.forms as forms

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import step_extras
    finally:
        sys.path.remove(str(REPO / "bench"))
    monkeypatch.setattr(forms, "capability", lambda device: (9, 0))
    monkeypatch.setattr(forms, "check_device", lambda device: None)
    got, skipped = step_extras.auto_forms(str(REPO / "configs/lamemo-1.3b.yaml"), torch.device("cuda"))
    assert got == ["eager", "compiled", "fused", "compiled+fused", "flex", "compiled+flex"] and not skipped, got
    monkeypatch.setattr(forms, "capability", lambda device: (7, 0))  # a V100: never flex
    got, skipped = step_extras.auto_forms(str(REPO / "configs/lamemo-1.3b.yaml"), torch.device("cuda"))
    assert got == ["eager", "compiled", "fused", "compiled+fused"] and "flex: sm70" in skipped[0], (got, skipped)


def test_every_gpu_claim_of_the_readme_names_its_device_and_code():
    """README's GPU column and headline figures say where each result came from (device, commit), keep the flex
    slowdown and the compiled + flex failure until a run replaces them, mark the full-depth figure an estimate, and
    call the fused kernels' speed unmeasured while no GPU has run them."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| feature | CPU | GPU |") : text.index("## Install")]
    for row in [r for r in table.splitlines()[2:] if r.startswith("| ")]:
        gpu = row.rstrip(" |").rsplit(" | ", 1)[-1]
        if gpu.startswith(("not run", "(host side)", "**not run")):
            continue
        assert re.search(r"H[12]00", gpu) and re.search(r"\b[0-9a-f]{7}\b", gpu), row
    speed = next(line for line in text.splitlines() if line.startswith("| lamemo-1.3b's width on an H200"))
    assert "2 layers" in speed and re.search(r"\b[0-9a-f]{7}\b", speed) and "34.1% HFU" in speed, speed
    assert "−22%" in speed and "compiled + flex failed" in speed and "an estimate, not measured" in speed, speed
    assert "unmeasured" in text[text.index("| the fused attention kernels on a GPU") :], text
    bench = (REPO / "docs/benchmarks.md").read_text()
    assert "**their speed is unmeasured until a GPU\nmeasures it**" in bench and "an estimate (not measured)" in bench
