"""The sections of the device check (scripts/gpu_check.py) but the training run's (gpu_check_train.py), and what
they share: running a command within a budget, and rows written as soon as they are measured (DIR/SECTION.jsonl,
read back by `salvage` when a section is killed, so the report keeps what ran)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.tgt_len=16",
    "model.mem_len=16",
    "data.batch_size=4",
    "eval.batch_size=4",
    "eval.max_segments=4",
    "optim.warmup_steps=2",
]
FULL_STEP_MB8_MIN_S = 45  # on a GPU: micro-batch 8 runs when at least this much of the section is left


class Timeout(Exception):
    pass


def sh(cmd, log: Path, budget: float, env=None, check=True) -> str:
    """Run cmd (list) with output to log; its text. Past the budget its process group is killed: Timeout."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        p = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env or os.environ.copy(),
            start_new_session=True,
        )
        try:
            rc = p.wait(timeout=max(1.0, budget))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Timeout(
                f"{Path(str(cmd[1] if cmd[0] == sys.executable else cmd[0])).name} ran past {budget:.0f}s"
            ) from None
    text = log.read_text()
    if check and rc != 0:
        raise RuntimeError(f"exit {rc}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}")
    return text


def read_rows(path: Path) -> list[dict]:
    """The JSON lines of a rows file (a last line cut by a kill is left out)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


# ---- env: what the report's top line says ------------------------------------------------------------------
def _driver() -> str | None:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def env_section(ctx):
    """Versions (torch, CUDA, cuDNN, NCCL, driver, DeepSpeed, Triton) and the GPU: no import of DeepSpeed here
    (its op report is the ds_ops section, last)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    for pkg in ("deepspeed", "triton"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    if ctx.cuda:
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            driver=_driver(),
        )
    return info


def ds_ops_section(ctx):
    report = sh(
        [sys.executable, "-m", "deepspeed.env_report"], ctx.out / "ds_report.log", ctx.left("ds_ops"), check=False
    )
    return {
        "ds_ops": {
            m.group(1): m.group(2) + "/" + m.group(3)
            for m in re.finditer(
                r"^(\w+) \.+ \S*\[(\w+)\]\S* \.+ \S*\[(\w+)\]", re.sub(r"\x1b\[[0-9;]*m", "", report), re.M
            )
        }
    }


# ---- the benches: rows as they come ----------------------------------------------------------------------------
def attention_kernel_section(ctx):
    """bench/attention_kernel.py, first of the measurements: each form's row is appended as it is measured."""
    rows = ctx.rows_path("attention_kernel")
    cmd = [sys.executable, "bench/attention_kernel.py", "--out", rows]
    cmd += (
        ["--reps", "10"]
        if ctx.cuda
        else ["--device", "cpu", "--tiny", "--reps", "1", "--forms", "sdpa", "eager", "fused"]
    )
    sh(cmd, ctx.out / "attention_kernel.log", ctx.left("attention_kernel"), check=False)
    return salvage_rows(ctx, "attention_kernel")


def full_step_section(ctx):
    """bench/gpu_step.py at lamemo-1.3b's full depth in the forms auto would time, micro-batch 4 with the
    optimizer step and one compiled layer's profile; then micro-batch 8 for the two fastest forms, where time is
    left. On the CPU: the same plumbing at a tiny width, micro-batch 8 for the fastest form only."""
    rows, log = ctx.rows_path("full_step"), ctx.out / "full_step.log"
    base = [sys.executable, "bench/gpu_step.py", "--jsonl", rows]
    if ctx.cuda:
        base += ["--config", "configs/lamemo-1.3b.yaml", "--steps", "3", "--warmup", "2"]
        first = ["--batch", "4", "--forms", *ctx.full_step_forms, "--optimizer", "--profile-layer"]
    else:
        base += ["--device", "cpu", "--tiny", "--backend", "aot_eager", "--steps", "1", "--warmup", "2"]
        first = ["--batch", "4", "--forms", "eager", "compiled", "--optimizer", "--profile-layer"]
    sh(base + first, log, ctx.left("full_step"), check=False)
    fast = fastest(read_rows(rows), batch=4, k=2 if ctx.cuda else 1)
    if fast and (ctx.left("full_step") >= FULL_STEP_MB8_MIN_S or not ctx.cuda):
        sh(base + ["--batch", "8", "--forms", *fast], log, ctx.left("full_step"), check=False)
    return salvage_rows(ctx, "full_step")


def fastest(rows: list[dict], batch: int, k: int) -> list[str]:
    """The k forms with the most tokens/s at a micro-batch (the forms that ran)."""
    timed = [
        r
        for r in rows
        if r.get("batch") == batch and r.get("tokens_per_s") and r["form"] not in ("setup", "optimizer", "profile")
    ]
    return [r["form"] for r in sorted(timed, key=lambda r: -r["tokens_per_s"])[:k]]


def model_step_section(ctx):
    cmd = [sys.executable, "bench/model_step.py", "--steps", "4", "--warmup", "2"]
    cmd += (
        ["--device", "cuda", "--gpu-steps", "5"]
        if ctx.cuda
        else [
            "--threads",
            "1",
            "--precision",
            "fp32",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--batch",
            "2",
            "--tgt-len",
            "8",
            "--mem-len",
            "8",
            "--variants",
            "lamemo",
        ]
    )
    text = sh(cmd, ctx.out / "model_step.log", ctx.left("model_step"))
    return {"lines": [ln for ln in text.splitlines() if re.match(r"^(lamemo|xl|rpe|\w+\.yaml)\s", ln)]}


# ---- the test sets -------------------------------------------------------------------------------------------
RESULT = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"


def test_rows(log_text: str) -> list[dict]:
    """Each test's result as pytest -v printed it (also under xdist), the last word on a test winning: what a
    killed run had finished."""
    seen = {}
    for m in re.finditer(rf"(\S+::\S+) {RESULT}|{RESULT} (\S+::\S+)", log_text):
        test, state = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        seen[test.split("::")[-1]] = state.lower()
    return [{"test": t, "result": {"error": "error"}.get(s, s)} for t, s in seen.items()]


def tests_section(ctx):
    xml = ctx.out / "pytest.xml"
    per_test = max(60, int(ctx.left("tests") * 0.8))
    args = [
        "-m",
        "gpu",
        "tests/gpu/test_gpu.py",
        "-p",
        "no:cacheprovider",
        f"--timeout={per_test}",
        "-v",
        "-rfEs",
        f"--junitxml={xml}",
    ]
    if ctx.cuda:
        args += ["-n", "4"]  # 16 cores and one GPU: the runs overlap well (the first run: 2 min)
        args += ["-k", ctx.tests_k] if ctx.tests_k else []
    else:
        args += ctx.test_filter
    sh([sys.executable, "-m", "pytest", *args], ctx.out / "pytest.log", ctx.left("tests"), check=False)
    return _summary(_junit(xml))


def _junit(xml: Path) -> list[dict]:
    import xml.etree.ElementTree as ET

    results = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        row = {"test": case.get("name"), "result": "passed", "s": float(case.get("time", 0))}
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                msg = (el.get("message") or "").splitlines()
                row.update(result={"failure": "failed"}.get(kind, kind), message=msg[0][:300] if msg else "")
                break
        results.append(row)
    return results


def _summary(results: list[dict]) -> dict:
    return {"results": results, "passed": sum(r["result"] == "passed" for r in results), "total": len(results)}


def multigpu_section(ctx):
    if ctx.gpus < 2:
        return {"skipped": f"{ctx.gpus} GPU(s): the multi-GPU set needs 2 or more"}
    sh(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "multigpu",
            "tests/gpu/test_multigpu.py",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
        ],
        ctx.out / "multigpu.log",
        ctx.left("multigpu"),
        check=False,
    )
    return {"summary": ctx.out.joinpath("multigpu.log").read_text().strip().splitlines()[-1]}


# ---- what a killed or failed section keeps -----------------------------------------------------------------
def salvage_rows(ctx, name: str) -> dict:
    return {"rows": read_rows(ctx.rows_path(name))}


def salvage(ctx, name: str) -> dict:
    """The rows a section had written when it was killed or failed."""
    if name == "tests":
        log = ctx.out / "pytest.log"
        return _summary(test_rows(log.read_text())) if log.exists() else {}
    if name == "train":
        from gpu_check_train import merged

        return merged(read_rows(ctx.rows_path("train")))
    rows = read_rows(ctx.rows_path(name))
    return {"rows": rows} if rows else {}
