"""The device check (scripts/gpu_check.sh --out DIR): every open GPU question answered by one command, into
DIR/gpu-report.md and DIR/gpu-report.json. Each section has its own time budget; a section that fails or runs
out of time is recorded as such, with the rows it had written, and the next one runs. Logs of every section are
kept in DIR. On one GPU the budgets sum to at most 540 s (`--plan` prints them without running anything).

Sections, in order (scripts/gpu_check_sections.py, gpu_check_train.py):
  env               torch, CUDA, cuDNN, NCCL, driver, DeepSpeed and Triton versions; the GPU
  attention_kernel  bench/attention_kernel.py: relative attention alone, eager / compiled / flex / fused vs SDPA
  full_step         bench/gpu_step.py at lamemo-1.3b's full depth (24 layers) in the forms `auto` would time:
                    HFU, MFU, peak memory at micro-batch 4, the optimizer step, the top kernels of one compiled
                    layer; then micro-batch 8 for the two fastest forms if time is left
  train             configs/gpu-check-100m.yaml, 60 steps; kill -9, resume (bit-equal losses), convert, eval at
                    the validation's dtype and attention form (equal to the run's own)
  plan              megamemo plan beside the measured step and peak memory
  tests             pytest -m gpu (each result as it finishes)
  ds_ops            DeepSpeed's op report
  model_step        bench/model_step.py (budget 0 on a GPU: --budget model_step=S runs it)
  multigpu          pytest -m multigpu, with 2 or more GPUs

A section that finishes early leaves its unspent time to the next ones; a budget given with --budget is the
section's own (no carried time). Every section writes its rows as soon as it has them (DIR/SECTION.jsonl, the
training phases, each test's line of the pytest log), and the report is rewritten after every section, so a kill
keeps what ran. --device cpu runs the same plumbing at tiny sizes (tests/gpu/test_gpu_check.py), so it cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import gpu_check_sections as S  # noqa: E402
from gpu_check_report import markdown  # noqa: E402
from gpu_check_train import plan_section, train_section  # noqa: E402

GPU_BUDGET_S = {
    "env": 10,
    "attention_kernel": 60,
    "full_step": 140,
    "train": 190,
    "plan": 10,
    "tests": 110,
    "ds_ops": 10,
    "model_step": 0,
    "multigpu": 120,
}
CPU_BUDGET_S = {
    "env": 60,
    "attention_kernel": 120,
    "full_step": 240,
    "train": 400,
    "plan": 60,
    "tests": 180,
    "ds_ops": 60,
    "model_step": 45,
    "multigpu": 10,
}
ONE_GPU_LIMIT_S = 540
SECTIONS = [
    ("env", S.env_section),
    ("attention_kernel", S.attention_kernel_section),
    ("full_step", S.full_step_section),
    ("train", train_section),
    ("plan", plan_section),
    ("tests", S.tests_section),
    ("ds_ops", S.ds_ops_section),
    ("model_step", S.model_step_section),
    ("multigpu", S.multigpu_section),
]
NEEDS_GPUS = {"multigpu": 2}  # a section that cannot run with fewer GPUs takes no time


def plan(device: str, gpus: int, budget: dict, scale: float = 1.0, only=None) -> list[tuple[str, float, str]]:
    """(section, seconds it may take, note) in running order; seconds 0 where it does not run."""
    rows = []
    for name, _ in SECTIONS:
        s, note = budget[name] * scale, ""
        if only and name not in only:
            s, note = 0.0, "not in --only"
        elif device == "cuda" and gpus < NEEDS_GPUS.get(name, 0):
            s, note = 0.0, f"skipped: needs {NEEDS_GPUS[name]} GPUs"
        elif budget[name] == 0:
            note = f"off: --budget {name}=S runs it"
        rows.append((name, s, note))
    return rows


def print_plan(rows, device: str, gpus: int) -> int:
    total = sum(s for _, s, _ in rows)
    print(f"gpu_check plan ({device}, {gpus} GPU(s)): section budgets in running order")
    for name, s, note in rows:
        print(f"  {name:<17} {s:6.0f} s  {note}")
    limit = f" (limit {ONE_GPU_LIMIT_S} s on one GPU)" if device == "cuda" and gpus == 1 else ""
    print(f"  {'total':<17} {total:6.0f} s{limit}")
    return 0 if not limit or total <= ONE_GPU_LIMIT_S else 1


class Context:
    def __init__(self, out: Path, device: str, only):
        import torch

        self.out, self.results, self.only = out, {}, only
        self.cuda = device == "cuda"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        cap = torch.cuda.get_device_capability(0) if self.cuda else (0, 0)
        self.half = ("bf16" if cap[0] >= 8 else "fp16") if self.cuda else "bf16"
        name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.plan_kind = (
            plan_kind(name, torch.cuda.get_device_properties(0).total_memory / 2**30 if self.cuda else 0)
            if self.cuda
            else "a100-80g"
        )
        self.test_filter = ["-k", "resumed_adam_step"] if not self.cuda else []
        self.deadline = {}

    def left(self, section: str) -> float:
        return max(1.0, self.deadline[section] - time.time())

    def rows_path(self, section: str) -> Path:
        return self.out / f"{section}.jsonl"

    def row(self, section: str, row: dict) -> dict:
        """Append a section's row to its rows file now (a kill keeps it); the row."""
        with self.rows_path(section).open("a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
        return row


def plan_kind(name: str, mem_gib: float) -> str | None:
    """`megamemo plan --gpu` kind of a CUDA device name (the H200 is planned as an H100: same compute)."""
    n = name.upper()
    if "H100" in n or "H200" in n:
        return "h100-80g"
    if "A100" in n:
        return "a100-80g" if mem_gib > 50 else "a100-40g"
    if "V100" in n:
        return "v100-32g" if mem_gib > 20 else "v100-16g"
    return None


def run_section(ctx: Context, name: str, fn, seconds: float) -> dict:
    """Run one section within `seconds`: its entry of the report (status, seconds, budget, result). A section
    killed or failed keeps the rows it had written (gpu_check_sections.salvage)."""
    ctx.deadline[name] = time.time() + seconds
    t0 = time.time()
    try:
        result, status = fn(ctx), "ok"
    except S.Timeout as e:
        result, status = {**S.salvage(ctx, name), "error": str(e)}, "timeout"
    except Exception as e:  # a section's failure is recorded, the next one runs
        result, status = {**S.salvage(ctx, name), "error": f"{type(e).__name__}: {str(e)[:400]}"}, "failed"
    ctx.results[name] = result
    return {"status": status, "seconds": round(time.time() - t0, 1), "budget_s": round(seconds, 1), "result": result}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for gpu-report.md, gpu-report.json and the logs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--plan", action="store_true", help="print the section budgets and exit (runs nothing)")
    ap.add_argument("--gpus", type=int, help="GPUs the plan is for (default: those here, at least 1)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every section's time budget")
    ap.add_argument("--only", nargs="+", choices=[s for s, _ in SECTIONS], help="run these sections only")
    ap.add_argument("--budget", nargs="+", default=[], metavar="SECTION=SECONDS", help="a section's own budget")
    ap.add_argument("--train-steps", type=int, default=60, help="steps of the training section (on a GPU)")
    ap.add_argument("--tests-k", help="pytest -k expression: a subset of the GPU tests (a short check)")
    ap.add_argument(
        "--full-step-forms",
        nargs="+",
        default=["auto"],
        help="bench/gpu_step.py forms at full depth (default auto: the forms auto would time)",
    )
    a = ap.parse_args(argv)
    a.budgets = dict(GPU_BUDGET_S if a.device == "cuda" else CPU_BUDGET_S)
    a.hard = set()
    for item in a.budget:
        k, _, v = item.partition("=")
        if k not in a.budgets:
            ap.error(f"--budget {item}: no section {k!r}")
        a.budgets[k] = float(v)
        a.hard.add(k)
    if not a.plan and not a.out:
        ap.error("--out is required (or --plan)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.plan:
        gpus = a.gpus or (1 if a.device == "cuda" else 0)
        return print_plan(plan(a.device, gpus, a.budgets, a.scale, a.only), a.device, gpus)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")
    ctx = Context(out, a.device, a.only)
    ctx.train_steps, ctx.tests_k, ctx.full_step_forms = a.train_steps, a.tests_k, a.full_step_forms
    t_all = time.time()
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": a.device,
        "commit": _commit(),
        "sections": {},
    }
    carried = 0.0
    for name, seconds, note in plan(a.device, max(ctx.gpus, 1) if ctx.cuda else 0, a.budgets, a.scale, a.only):
        fn = dict(SECTIONS)[name]
        if note.startswith("not in --only"):
            continue
        if seconds == 0:
            report["sections"][name] = {"status": "skipped", "seconds": 0, "budget_s": 0, "result": {"note": note}}
            continue
        own = seconds + (0.0 if name in a.hard else carried)
        report["sections"][name] = {"status": "running", "seconds": 0, "budget_s": round(own, 1), "result": {}}
        write_report(out, report)
        entry = run_section(ctx, name, fn, own)
        carried = max(0.0, own - entry["seconds"]) if name not in a.hard else carried
        report["sections"][name] = entry
        print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']:.0f}s", flush=True)
        write_report(out, report)
    report["seconds"] = round(time.time() - t_all, 1)
    write_report(out, report)
    print((out / "gpu-report.md").read_text(), flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in report["sections"].values()) else 1


def write_report(out: Path, report: dict) -> None:
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(markdown(report))


def _commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    sys.exit(main())
