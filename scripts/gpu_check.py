"""The device check (scripts/gpu_check.sh --out DIR): every open GPU question answered by one command, into
DIR/gpu-report.md and DIR/gpu-report.json. Each section has its own time budget; a section that fails or runs
out of time is recorded as such and the next one runs. Logs of every section are kept in DIR.

Sections: env (GPU, driver, torch / CUDA / NCCL / cuDNN, DeepSpeed's op report) | tests (`pytest -m gpu`, every
result) | model_step (bench/model_step.py) | gpu_step (bench/gpu_step.py, short form) | train (configs/gpu-check-
100m.yaml, 300 steps: tokens/s, HFU/MFU, loss; kill -9 and resume under train.deterministic, bit-equal losses;
convert to single; eval equal to the run's own) | plan (megamemo plan beside the measured step and peak memory) |
multigpu (`pytest -m multigpu`, with 2 or more GPUs).

--device cpu runs the same plumbing at tiny sizes (tests/test_gpu_check.py), so that it cannot rot.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BUDGET_S = {"env": 45, "tests": 180, "model_step": 45, "gpu_step": 90, "train": 150, "plan": 20, "multigpu": 120}
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
        "model.tgt_len=16", "model.mem_len=16", "data.batch_size=4", "eval.batch_size=4", "eval.max_segments=4",
        "optim.warmup_steps=2"]


class Timeout(Exception):
    pass


def sh(cmd, log: Path, budget: float, env=None, check=True) -> str:
    """Run cmd (list) with output to log; its text. Past the budget its process group is killed: Timeout."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        p = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                             env=env or os.environ.copy(), start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, budget))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Timeout(f"{Path(str(cmd[1] if cmd[0] == sys.executable else cmd[0])).name} ran past "
                          f"{budget:.0f}s") from None
    text = log.read_text()
    if check and rc != 0:
        raise RuntimeError(f"exit {rc}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}")
    return text


# ---- sections ------------------------------------------------------------------------------------------------
def env_section(ctx):
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if ctx.cuda:
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    import deepspeed

    info["deepspeed"] = deepspeed.__version__
    report = sh([sys.executable, "-m", "deepspeed.env_report"], ctx.out / "ds_report.log", ctx.left("env"),
                check=False)
    info["ds_ops"] = {m.group(1): m.group(2) + "/" + m.group(3) for m in re.finditer(
        r"^(\w+) \.+ \S*\[(\w+)\]\S* \.+ \S*\[(\w+)\]", re.sub(r"\x1b\[[0-9;]*m", "", report), re.M)}
    return info


def tests_section(ctx):
    xml = ctx.out / "pytest.xml"
    per_test = max(60, int(ctx.left("tests") * 0.8))
    args = ["-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", f"--timeout={per_test}", "-q", "-rA",
            f"--junitxml={xml}"]
    if ctx.cuda:
        args += ["-n", "4"]                 # 16 cores and one GPU: the runs overlap well (the first run: 2 min)
        args += ["-k", ctx.tests_k] if ctx.tests_k else []
    else:
        args += ctx.test_filter
    sh([sys.executable, "-m", "pytest", *args], ctx.out / "pytest.log", ctx.left("tests"), check=False)
    import xml.etree.ElementTree as ET

    results = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        state = "passed"
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                state = {"failure": "failed"}.get(kind, kind)
                msg = (el.get("message") or "").splitlines()
                results.append({"test": case.get("name"), "result": state, "s": float(case.get("time", 0)),
                                "message": msg[0][:300] if msg else ""})
                break
        else:
            results.append({"test": case.get("name"), "result": state, "s": float(case.get("time", 0))})
    return {"results": results, "passed": sum(r["result"] == "passed" for r in results), "total": len(results)}


def model_step_section(ctx):
    cmd = [sys.executable, "bench/model_step.py", "--steps", "4", "--warmup", "2"]
    cmd += ["--device", "cuda", "--gpu-steps", "5"] if ctx.cuda else ["--threads", "1", "--precision", "fp32",
                                                                    "--layers", "1", "--d-model", "32",
                                                                    "--batch", "2", "--tgt-len", "8",
                                                                    "--mem-len", "8", "--variants", "lamemo"]
    text = sh(cmd, ctx.out / "model_step.log", ctx.left("model_step"))
    return {"lines": [ln for ln in text.splitlines() if re.match(r"^(lamemo|xl|rpe|\w+\.yaml)\s", ln)]}


def gpu_step_section(ctx):
    js = ctx.out / "gpu_step.json"
    cmd = [sys.executable, "bench/gpu_step.py", "--json", js]
    cmd += (["--config", "configs/lamemo-1.3b.yaml", "--layers", "2", "--batch", "4", "--steps", "4",
             "--warmup", "3", "--forms", *ctx.gpu_forms] if ctx.cuda else
            ["--device", "cpu", "--tiny", "--forms", "eager", "compiled", "--backend", "aot_eager", "--steps", "1",
             "--warmup", "2"])
    sh(cmd, ctx.out / "gpu_step.log", ctx.left("gpu_step"), check=False)
    return json.loads(js.read_text())


def _losses(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec
    return out


def train_section(ctx):
    data = ctx.out / "shards"
    log = ctx.out / "train.log"
    if not (data / "manifest.json").exists():
        sh([sys.executable, "-m", "megamemo", "prepare", "enwik8", "--raw", REPO / "tests/fixtures/text/enwik8_head",
            "--out", data, "--quiet"], log, ctx.left("train"))
    sets = [f"precision.dtype={ctx.half}", "train.deterministic=true", f"data.dir={data}"]
    if not ctx.cuda:
        sets += TINY + ["train.max_steps=12", "checkpoint.save_every=4", "eval.every=12", "log.every=4"]
    steps = 12 if not ctx.cuda else ctx.train_steps
    kill_after = 6 if not ctx.cuda else max(2, steps * 2 // 5)
    if ctx.cuda and steps != 300:
        sets += [f"train.max_steps={steps}", f"checkpoint.save_every={max(1, steps // 6)}", f"eval.every={steps}",
                 f"log.every={max(1, steps // 6)}"]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1",
               DS_ACCELERATOR="cuda" if ctx.cuda else "cpu", MEGAMEMO_DEVICE="gpu" if ctx.cuda else "cpu")

    def train(run_dir, background=False):
        from megamemo.runtime.dist import free_port

        cmd = [sys.executable, "-m", "megamemo", "train", "--config", REPO / "configs/gpu-check-100m.yaml",
               "--run-dir", run_dir] + [a for s in sets for a in ("--set", s)]
        e = dict(env, MASTER_PORT=str(free_port()))
        if not background:
            return sh(cmd, log, ctx.left("train"), env=e)
        f = open(log, "a")
        return subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=e,
                                start_new_session=True)

    ref, crash = ctx.out / "run-ref", ctx.out / "run-crash"
    t0 = time.time()
    text = train(ref)
    res = {"wall_s": round(time.time() - t0, 1), "dtype": ctx.half, "steps": steps}
    recs = _losses(ref)
    warm = [r for s, r in recs.items() if s > min(20, steps // 2)]
    pick = lambda k: sorted(r[k] for r in warm if r.get(k) is not None)   # noqa: E731
    med = lambda v: v[len(v) // 2] if v else None                          # noqa: E731
    res.update(tokens_per_s=med(pick("tokens_per_s")), hfu=med(pick("hfu")) or med(pick("mfu")),
               mfu=med(pick("mfu")) if pick("hfu") else None, first_loss=recs[min(recs)]["loss"],
               final_loss=recs[max(recs)]["loss"])
    m = re.search(r"peak GPU memory ([0-9.]+) GiB", text)
    res["peak_mem_gib"] = float(m.group(1)) if m else None
    m = re.search(r"\| (\w+) attention \| (compiled|eager) layers", text)
    res["attention"], res["layers"] = (m.group(1), m.group(2)) if m else (None, None)
    for line in text.splitlines():
        if line.startswith("[train] attention:"):
            res["attention_check"] = line
    # kill -9 after a committed checkpoint, then resume: bit-equal losses (a save is asynchronous: under load its
    # commit can come after later steps, so the kill waits for both)
    from megamemo.checkpoint.store import list_checkpoints

    p = train(crash, background=True)
    deadline = time.time() + ctx.left("train")
    while time.time() < deadline and p.poll() is None:
        if (crash / "metrics.jsonl").exists() and any(
                json.loads(line).get("step", 0) >= kill_after for line in (crash / "metrics.jsonl").read_text()
                .splitlines() if line.endswith("}")) and any(c for _, _, c in list_checkpoints(crash / "checkpoints")):
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    train(crash)
    a, b = {s: r["loss"] for s, r in _losses(ref).items()}, {s: r["loss"] for s, r in _losses(crash).items()}
    res["resume_bit_equal"] = a == b
    res["resume_from"] = (re.findall(r"resumed from \S+step_0*(\d+)", log.read_text()) or [None])[-1]
    # convert to single, evaluate; equal to the run's own validation at its last step
    single = ctx.out / "single"
    sh([sys.executable, "-m", "megamemo", "convert", "to-single", "--ckpt", crash, "--out", single], log,
       ctx.left("train"), env=env)
    val = [json.loads(line) for line in (crash / "metrics.jsonl").read_text().splitlines()
           if json.loads(line).get("kind") == "eval"][-1]
    ev_json = ctx.out / "eval.json"
    sh([sys.executable, "-m", "megamemo", "eval", "--ckpt", single, "--data", data, "--split", "valid",
        "--batch-size", str(val.get("batch_size", 16 if ctx.cuda else 4)), "--max-segments",
        "4" if not ctx.cuda else "20", "--device", "cuda" if ctx.cuda else "cpu", "--json", ev_json], log,
       ctx.left("train"), env=env)
    ev = json.loads(ev_json.read_text())
    ev = ev[0] if isinstance(ev, list) else ev
    res.update(eval_nll=ev["nll"], run_eval_nll=val["loss"], eval_tokens=ev["tokens"], run_eval_tokens=val["tokens"],
               eval_equal=ev["tokens"] == val["tokens"] and abs(ev["nll"] - val["loss"]) <= 1e-3 * abs(val["loss"]))
    return res


def plan_section(ctx):
    kind = ctx.plan_kind
    if kind is None:
        return {"skipped": "no planner device kind for this GPU"}
    sets = ["precision.dtype=" + ctx.half] + ([] if ctx.cuda else TINY)
    text = sh([sys.executable, "-m", "megamemo", "plan", "--config", REPO / "configs/gpu-check-100m.yaml", "--nodes",
               "1", "--gpus-per-node", "1", "--gpu", kind, "--tp", "1", "--pp", "1"] +
              [a for s in sets for a in ("--set", s)], ctx.out / "plan.log", ctx.left("plan"))
    step = re.search(r"predicted step ([0-9.]+) ms", text)
    mem = re.search(r"total\s+([0-9.]+) GiB", text)
    train = ctx.results.get("train", {})
    measured = None
    if train.get("tokens_per_s"):
        tokens = (16 if ctx.cuda else 4) * (256 if ctx.cuda else 16)
        measured = tokens / train["tokens_per_s"] * 1e3
    return {"kind": kind, "predicted_step_ms": float(step.group(1)) if step else None,
            "measured_step_ms": measured, "predicted_mem_gib": float(mem.group(1)) if mem else None,
            "measured_peak_mem_gib": train.get("peak_mem_gib")}


def multigpu_section(ctx):
    if ctx.gpus < 2:
        return {"skipped": f"{ctx.gpus} GPU(s): the multi-GPU set needs 2 or more"}
    sh([sys.executable, "-m", "pytest", "-m", "multigpu", "tests/test_multigpu.py", "-p", "no:cacheprovider", "-q",
        "-rA"], ctx.out / "multigpu.log", ctx.left("multigpu"), check=False)
    return {"summary": ctx.out.joinpath("multigpu.log").read_text().strip().splitlines()[-1]}


SECTIONS = [("env", env_section), ("gpu_step", gpu_step_section), ("train", train_section), ("plan", plan_section),
            ("tests", tests_section), ("model_step", model_step_section), ("multigpu", multigpu_section)]


# ---- the run and its report --------------------------------------------------------------------------------
class Context:
    def __init__(self, out: Path, device: str, scale: float, only):
        import torch

        self.out, self.scale, self.results = out, scale, {}
        self.cuda = device == "cuda"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        cap = torch.cuda.get_device_capability(0) if self.cuda else (0, 0)
        self.half = ("bf16" if cap[0] >= 8 else "fp16") if self.cuda else "bf16"
        name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.plan_kind = plan_kind(name, torch.cuda.get_device_properties(0).total_memory / 2**30
                                   if self.cuda else 0) if self.cuda else "a100-80g"
        self.test_filter = ["-k", "resumed_adam_step"] if not self.cuda else []
        self.only = only
        self.deadline = {}

    def left(self, section: str) -> float:
        return max(1.0, self.deadline[section] - time.time())


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu-report.md, gpu-report.json and the logs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every section's time budget")
    ap.add_argument("--only", nargs="+", choices=[s for s, _ in SECTIONS], help="run these sections only")
    ap.add_argument("--budget", nargs="+", default=[], metavar="SECTION=SECONDS", help="a section's own budget")
    ap.add_argument("--train-steps", type=int, default=300, help="steps of the training section (on a GPU)")
    ap.add_argument("--tests-k", help="pytest -k expression: a subset of the GPU tests (a short check)")
    ap.add_argument("--gpu-step-forms", nargs="+", default=["eager", "compiled", "flex", "compiled+flex"])
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")
    ctx = Context(out, a.device, a.scale, a.only)
    ctx.train_steps = a.train_steps
    ctx.gpu_forms = a.gpu_step_forms
    ctx.tests_k = a.tests_k
    for item in a.budget:
        k, _, v = item.partition("=")
        if k not in BUDGET_S:
            ap.error(f"--budget {item}: no section {k!r}")
        BUDGET_S[k] = float(v)
    t_all = time.time()
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": a.device,
              "commit": _commit(), "sections": {}}
    for name, fn in SECTIONS:
        if a.only and name not in a.only:
            continue
        ctx.deadline[name] = time.time() + BUDGET_S[name] * a.scale
        t0 = time.time()
        try:
            result, status = fn(ctx), "ok"
        except Timeout as e:
            result, status = {"error": str(e)}, "timeout"
        except Exception as e:          # noqa: BLE001 - a section's failure is recorded, the next one runs
            result, status = {"error": f"{type(e).__name__}: {str(e)[:400]}"}, "failed"
        ctx.results[name] = result
        report["sections"][name] = {"status": status, "seconds": round(time.time() - t0, 1),
                                    "budget_s": BUDGET_S[name] * a.scale, "result": result}
        print(f"[gpu_check] {name}: {status} in {time.time() - t0:.0f}s", flush=True)
        (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    report["seconds"] = round(time.time() - t_all, 1)
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(markdown(report))
    print((out / "gpu-report.md").read_text(), flush=True)
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(rep: dict) -> str:
    s = rep["sections"]
    env = s.get("env", {}).get("result", {})
    lines = [f"# megamemo GPU check ({rep['started']}, commit {rep['commit']}, {rep.get('seconds', 0):.0f} s)", "",
             f"Device: {env.get('gpu', rep['device'])} (compute {env.get('capability', '-')}, "
             f"{env.get('memory_gib', '-')} GiB, driver {env.get('driver', '-')}); torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl', '-')}, DeepSpeed "
             f"{env.get('deepspeed')}", "", "| section | status | seconds (budget) |", "|---|---|---|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']:.0f} ({v['budget_s']:.0f}) |" for k, v in s.items()]
    for k, v in s.items():
        if v["status"] != "ok":
            lines += ["", f"**{k}**: {v['result'].get('error')}"]
    t = s.get("tests", {}).get("result", {})
    if t.get("results"):
        lines += ["", f"## pytest -m gpu: {t['passed']} of {t['total']} passed", ""]
        lines += [f"- {r['result']}: {r['test']} ({r['s']:.0f} s){' - ' + r['message'] if r.get('message') else ''}"
                  for r in t["results"]]
    g = s.get("gpu_step", {}).get("result", {})
    if g.get("rows"):
        lines += ["", f"## bench/gpu_step.py: {g['config']} with {g['layers']} layers, batch {g['batch']}, "
                  f"{g['dtype']}", "", "| form | tokens/s | ms/step | HFU | MFU | peak GiB | first loss |",
                  "|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            if "error" in r:
                lines.append(f"| {r['form']} | failed: {r['error'][:120]} | | | | | |")
            else:
                mem = "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.2f}"
                lines.append(f"| {r['form']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | {_pct(r['hfu'])} "
                             f"| {_pct(r['mfu'])} | {mem} | {r['first_loss']:.5f} |")
    m = s.get("model_step", {}).get("result", {})
    if m.get("lines"):
        lines += ["", "## bench/model_step.py", "", "```"] + m["lines"] + ["```"]
    tr = s.get("train", {}).get("result", {})
    if "tokens_per_s" in tr:
        lines += ["", f"## Training (configs/gpu-check-100m.yaml, {tr['steps']} steps, {tr['dtype']}, deterministic)",
                  "", f"- {tr['tokens_per_s']:,.0f} tokens/s, HFU {_pct(tr.get('hfu'))}, MFU {_pct(tr.get('mfu'))}, "
                  f"peak memory {tr.get('peak_mem_gib')} GiB; {tr.get('attention')} attention, {tr.get('layers')} "
                  f"layers; loss {tr['first_loss']:.4f} -> {tr['final_loss']:.4f}; {tr['wall_s']:.0f} s",
                  f"- {tr.get('attention_check', 'attention: no start-up check line')}"]
        if "resume_bit_equal" in tr:
            lines.append(f"- kill -9, resume from step {tr.get('resume_from')}: losses bit-equal: "
                         f"{tr['resume_bit_equal']}")
        if "eval_equal" in tr:
            lines.append(f"- convert to single + eval: nll {tr['eval_nll']:.5f} over {tr['eval_tokens']:,} tokens, "
                         f"the run's own {tr['run_eval_nll']:.5f} over {tr['run_eval_tokens']:,}: equal "
                         f"{tr['eval_equal']}")
    p = s.get("plan", {}).get("result", {})
    if p.get("predicted_step_ms") is not None:
        meas = p.get("measured_step_ms")
        lines += ["", f"## megamemo plan ({p['kind']}) beside the training run", "",
                  "| | predicted | measured |", "|---|---|---|",
                  f"| step | {p['predicted_step_ms']:.1f} ms | {'-' if meas is None else f'{meas:.1f} ms'} |",
                  f"| peak memory | {p['predicted_mem_gib']} GiB | {p.get('measured_peak_mem_gib') or '-'} GiB |"]
    mg = s.get("multigpu", {}).get("result", {})
    if mg:
        lines += ["", f"## multi-GPU: {mg.get('summary') or mg.get('skipped') or mg.get('error')}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
