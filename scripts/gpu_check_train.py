"""The device check's training run (configs/gpu-check-100m.yaml, 60 steps on a GPU) and the planner beside it.

Phases, each a row of DIR/train.jsonl as soon as it is done (a kill keeps what ran):
  ref     the run to its last step (model.attention: auto): tokens/s, HFU/MFU, loss, peak memory, the form;
  resume  the same run in the form the first one chose, kill -9 after a committed checkpoint, resumed: losses
          bit-equal to the first run's;
  eval    convert to single, `megamemo eval` at the validation's dtype and attention form: equal to the run's
          own validation at its last step (EVAL_RTOL).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_sections import REPO, TINY, sh

EVAL_RTOL = 1e-4  # eval against the run's validation, same dtype and form: only the order of sums differs
CPU_STEPS, CPU_KILL_AFTER = 12, 6


def merged(rows: list[dict]) -> dict:
    """The phases' rows as one result (later phases add their fields)."""
    out = {}
    for row in rows:
        out.update({k: v for k, v in row.items() if k != "phase"})
    return out


def _losses(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec
    return out


def run_form(text: str) -> tuple[str | None, str | None]:
    """(attention, "compiled" | "eager" layers) from a training run's start-up line."""
    m = re.search(r"\| (\w+) attention \| (compiled|eager) layers", text)
    return (m.group(1), m.group(2)) if m else (None, None)


def eval_args(
    single: Path,
    data: Path,
    val: dict,
    attention: str,
    dtype: str,
    batch_size: int,
    max_segments: int,
    device: str,
    out: Path,
) -> list[str]:
    """`megamemo eval` of the converted checkpoint as the run's own validation computed it: its lengths, its
    columns and segments, its dtype (the engine's weights: precision.dtype) and its attention form (validation
    runs a compiled run's layers eagerly: the attention form is the whole of it)."""
    same = "--same-length" if val.get("same_length") else "--no-same-length"
    args = ["eval", "--ckpt", single, "--data", data, "--split", val.get("split", "valid")]
    args += ["--batch-size", batch_size, "--max-segments", max_segments]
    args += ["--tgt-len", val["tgt_len"], "--mem-len", val["mem_len"], same]
    args += ["--dtype", dtype, "--attention", attention, "--device", device, "--json", out]
    if val.get("clamp_len") is not None:
        args += ["--clamp-len", val["clamp_len"]]
    return [str(a) for a in args]


def eval_equal(ev: dict, val: dict, rtol: float = EVAL_RTOL) -> bool:
    return ev["tokens"] == val["tokens"] and abs(ev["nll"] - val["loss"]) <= rtol * abs(val["loss"])


class TrainRun:
    def __init__(self, ctx):
        self.ctx, self.out = ctx, ctx.out
        self.data, self.log = ctx.out / "shards", ctx.out / "train.log"
        self.steps = ctx.train_steps if ctx.cuda else CPU_STEPS
        self.kill_after = max(2, self.steps // 2) if ctx.cuda else CPU_KILL_AFTER
        self.sets = [f"precision.dtype={ctx.half}", "train.deterministic=true", f"data.dir={self.data}"]
        if not ctx.cuda:
            self.sets += TINY + ["train.max_steps=12", "checkpoint.save_every=4", "eval.every=12", "log.every=4"]
        elif self.steps != 60:
            self.sets += [
                f"train.max_steps={self.steps}",
                f"checkpoint.save_every={max(1, self.steps // 3)}",
                f"eval.every={self.steps}",
                f"log.every={max(1, self.steps // 6)}",
            ]
        self.env = dict(
            os.environ,
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            PYTHONUNBUFFERED="1",
            DS_ACCELERATOR="cuda" if ctx.cuda else "cpu",
            MEGAMEMO_DEVICE="gpu" if ctx.cuda else "cpu",
        )

    def left(self) -> float:
        return self.ctx.left("train")

    def train(self, run_dir: Path, extra=(), background=False):
        from megamemo.runtime.dist import free_port

        cmd = [
            sys.executable,
            "-m",
            "megamemo",
            "train",
            "--config",
            REPO / "configs/gpu-check-100m.yaml",
            "--run-dir",
            run_dir,
        ] + [a for s in [*self.sets, *extra] for a in ("--set", s)]
        e = dict(self.env, MASTER_PORT=str(free_port()))
        if not background:
            return sh(cmd, self.log, self.left(), env=e)
        f = open(self.log, "a")
        return subprocess.Popen(
            [str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=e, start_new_session=True
        )

    def ref(self) -> dict:
        if not (self.data / "manifest.json").exists():
            sh(
                [
                    sys.executable,
                    "-m",
                    "megamemo",
                    "prepare",
                    "enwik8",
                    "--raw",
                    REPO / "tests/fixtures/text/enwik8_head",
                    "--out",
                    self.data,
                    "--quiet",
                ],
                self.log,
                self.left(),
            )
        t0 = time.time()
        text = self.train(self.out / "run-ref")
        recs = _losses(self.out / "run-ref")
        warm = [r for s, r in recs.items() if s > min(20, self.steps // 2)]
        pick = lambda k: sorted(r[k] for r in warm if r.get(k) is not None)  # noqa: E731
        med = lambda v: v[len(v) // 2] if v else None  # noqa: E731
        attention, layers = run_form(text)
        m = re.search(r"peak GPU memory ([0-9.]+) GiB", text)
        check = [line for line in text.splitlines() if line.startswith("[train] attention:")]
        return {
            "phase": "ref",
            "wall_s": round(time.time() - t0, 1),
            "dtype": self.ctx.half,
            "steps": self.steps,
            "tokens_per_s": med(pick("tokens_per_s")),
            "hfu": med(pick("hfu")) or med(pick("mfu")),
            "mfu": med(pick("mfu")) if pick("hfu") else None,
            "first_loss": recs[min(recs)]["loss"],
            "final_loss": recs[max(recs)]["loss"],
            "peak_mem_gib": float(m.group(1)) if m else None,
            "attention": attention,
            "layers": layers,
            "attention_check": check[-1] if check else None,
        }

    def resume(self, attention: str, layers: str) -> dict:
        """kill -9 after step kill_after and a committed checkpoint (a save is asynchronous: under load its
        commit can come after later steps, so the kill waits for both), then resume to the end."""
        from megamemo.checkpoint.store import list_checkpoints

        crash, t0 = self.out / "run-crash", time.time()
        form = [f"model.attention={attention}", f"train.compile={'on' if layers == 'compiled' else 'off'}"]
        p = self.train(crash, form, background=True)
        deadline = time.time() + self.left()
        while time.time() < deadline and p.poll() is None:
            if (
                (crash / "metrics.jsonl").exists()
                and any(
                    json.loads(line).get("step", 0) >= self.kill_after
                    for line in (crash / "metrics.jsonl").read_text().splitlines()
                    if line.endswith("}")
                )
                and any(c for _, _, c in list_checkpoints(crash / "checkpoints"))
            ):
                break
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        self.train(crash, form)
        a = {s: r["loss"] for s, r in _losses(self.out / "run-ref").items()}
        b = {s: r["loss"] for s, r in _losses(crash).items()}
        return {
            "phase": "resume",
            "resume_bit_equal": a == b,
            "resume_form": ", ".join(form),
            "resume_from": (re.findall(r"resumed from \S+step_0*(\d+)", self.log.read_text()) or [None])[-1],
            "resume_wall_s": round(time.time() - t0, 1),
        }

    def convert_eval(self, attention: str) -> dict:
        crash, single, ev_json, t0 = self.out / "run-crash", self.out / "single", self.out / "eval.json", time.time()
        sh(
            [sys.executable, "-m", "megamemo", "convert", "to-single", "--ckpt", crash, "--out", single],
            self.log,
            self.left(),
            env=self.env,
        )
        val = [
            json.loads(line)
            for line in (crash / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == "eval"
        ][-1]
        batch, segments = (16, 20) if self.ctx.cuda else (4, 4)  # the config's eval section / TINY's
        args = eval_args(
            single,
            self.data,
            val,
            attention,
            self.ctx.half,
            batch,
            segments,
            "cuda" if self.ctx.cuda else "cpu",
            ev_json,
        )
        sh([sys.executable, "-m", "megamemo", *args], self.log, self.left(), env=self.env)
        ev = json.loads(ev_json.read_text())
        ev = ev[0] if isinstance(ev, list) else ev
        return {
            "phase": "eval",
            "eval_nll": ev["nll"],
            "run_eval_nll": val["loss"],
            "eval_tokens": ev["tokens"],
            "run_eval_tokens": val["tokens"],
            "eval_equal": eval_equal(ev, val),
            "eval_rel_diff": abs(ev["nll"] - val["loss"]) / abs(val["loss"]),
            "eval_as": f"{self.ctx.half}, {attention} attention",
            "eval_wall_s": round(time.time() - t0, 1),
        }


def train_section(ctx):
    run = TrainRun(ctx)
    ref = ctx.row("train", run.ref())
    ctx.row("train", run.resume(ref["attention"] or "eager", ref["layers"] or "eager"))
    ctx.row("train", run.convert_eval(ref["attention"] or "eager"))
    from gpu_check_sections import read_rows

    return merged(read_rows(ctx.rows_path("train")))


def plan_section(ctx):
    kind = ctx.plan_kind
    if kind is None:
        return {"skipped": "no planner device kind for this GPU"}
    sets = ["precision.dtype=" + ctx.half] + ([] if ctx.cuda else TINY)
    text = sh(
        [
            sys.executable,
            "-m",
            "megamemo",
            "plan",
            "--config",
            REPO / "configs/gpu-check-100m.yaml",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--gpu",
            kind,
            "--tp",
            "1",
            "--pp",
            "1",
        ]
        + [a for s in sets for a in ("--set", s)],
        ctx.out / "plan.log",
        ctx.left("plan"),
    )
    step = re.search(r"predicted step ([0-9.]+) ms", text)
    mem = re.search(r"total\s+([0-9.]+) GiB", text)
    train = ctx.results.get("train", {})
    measured = None
    if train.get("tokens_per_s"):
        tokens = (16 if ctx.cuda else 4) * (256 if ctx.cuda else 16)
        measured = tokens / train["tokens_per_s"] * 1e3
    return {
        "kind": kind,
        "predicted_step_ms": float(step.group(1)) if step else None,
        "measured_step_ms": measured,
        "predicted_mem_gib": float(mem.group(1)) if mem else None,
        "measured_peak_mem_gib": train.get("peak_mem_gib"),
    }
