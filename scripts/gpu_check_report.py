"""The device check's report in Markdown (DIR/gpu-report.md), from its JSON (DIR/gpu-report.json): versions at the
top, the sections' status and time against their budgets, then each section's rows (those of a killed section
too: it says so)."""

from __future__ import annotations


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def header(rep: dict) -> list[str]:
    env = rep["sections"].get("env", {}).get("result", {})
    return [
        f"# megamemo GPU check ({rep['started']}, commit {rep['commit']}, {rep.get('seconds', 0):.0f} s)",
        "",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, driver {env.get('driver', '-')}, DeepSpeed "
        f"{env.get('deepspeed')}, Triton {env.get('triton')}, cuDNN {env.get('cudnn')}, NCCL "
        f"{env.get('nccl', '-')}",
        "",
        f"Device: {env.get('gpu', rep['device'])} (compute {env.get('capability', '-')}, "
        f"{env.get('memory_gib', '-')} GiB, {env.get('gpus', 0)} GPU(s))",
    ]


def status_table(s: dict) -> list[str]:
    lines = ["", "| section | status | seconds (budget) |", "|---|---|---|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']:.0f} ({v['budget_s']:.0f}) |" for k, v in s.items()]
    for k, v in s.items():
        if v["status"] not in ("ok", "skipped", "running"):
            lines += ["", f"**{k}**: {v['result'].get('error')} (the rows below are what it had written)"]
    return lines


def attention_kernel(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "## bench/attention_kernel.py: relative attention alone (TFLOP/s of visible pairs)",
        "",
        "| form | B | L | M | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | x sdpa | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ceiling = {(r["B"], r["L"], r["M"]): r.get("fwd_bwd_tflops") for r in rows if r.get("form") == "sdpa"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['form']} | {r['B']} | {r['L']} | {r['M']} | {r['error'][:100]} | | | | | |")
            continue
        c = ceiling.get((r["B"], r["L"], r["M"]))
        ratio = f"{r['fwd_bwd_tflops'] / c:.2f}" if c else "-"
        lines.append(
            f"| {r['form']} | {r['B']} | {r['L']} | {r['M']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
            f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f} | {ratio} | {_num(r.get('peak_gib'))} |"
        )
    return lines


def full_step(rows: list[dict]) -> list[str]:
    setup = [r for r in rows if r.get("form") == "setup"]
    forms = [r for r in rows if r.get("form") not in ("setup", "optimizer", "profile", "extra")]
    if not setup and not forms:
        return []
    first = setup[0] if setup else forms[0]
    lines = [
        "",
        f"## bench/gpu_step.py: {first.get('layers')} layers ({first.get('params', 0) / 1e6:.0f}M "
        f"parameters), {first.get('dtype')} on {first.get('device')}, forward + backward",
    ]
    skipped = (setup[0].get("skipped") or []) if setup else []
    lines += [""] + [f"- skipped by auto: {x}" for x in skipped] if skipped else []
    lines += [
        "",
        "| form | micro-batch | tokens/s | ms/step | HFU | MFU | peak GiB | first loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in forms:
        if "error" in r:
            lines.append(f"| {r['form']} | {r.get('batch')} | failed: {r['error'][:120]} | | | | | |")
        else:
            lines.append(
                f"| {r['form']} | {r.get('batch')} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                f"{_pct(r['hfu'])} | {_pct(r['mfu'])} | {_num(r.get('peak_mem_gib'))} | "
                f"{r['first_loss']:.5f} |"
            )
    for r in rows:
        if r.get("form") == "optimizer":
            lines += [
                "",
                f"Optimizer step (one GPU): **{r['ms_per_step']:.2f} ms**, {r['what']}, "
                f"{r['params'] / 1e6:.0f}M parameters",
            ]
        elif r.get("form") == "extra":
            lines += ["", f"Optimizer step or profile failed: {r['error']}"]
        elif r.get("form") == "profile":
            lines += [
                "",
                f"Top {r['unit']} of one {r['of']} layer, forward + backward at micro-batch {r['batch']} "
                f"({r['total_ms']:.2f} ms in all):",
                "",
                "| ms | calls | share | name |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {k['ms']:.3f} | {k['calls']} | {_pct(k['share'])} | `{k['name'][:100]}` |" for k in r["kernels"]
            ]
    return lines


def train(tr: dict) -> list[str]:
    lines = []
    if "tokens_per_s" in tr:
        lines += [
            "",
            f"## Training (configs/gpu-check-100m.yaml, {tr['steps']} steps, {tr['dtype']}, deterministic)",
            "",
            f"- {_num(tr['tokens_per_s'], ',.0f')} tokens/s, HFU {_pct(tr.get('hfu'))}, MFU "
            f"{_pct(tr.get('mfu'))}, peak memory {tr.get('peak_mem_gib')} GiB; {tr.get('attention')} "
            f"attention, {tr.get('layers')} layers; loss {tr['first_loss']:.4f} -> {tr['final_loss']:.4f}; "
            f"{tr['wall_s']:.0f} s",
            f"- {tr.get('attention_check') or 'attention: no start-up check line'}",
        ]
    if "resume_bit_equal" in tr:
        lines.append(
            f"- kill -9, resume from step {tr.get('resume_from')} ({tr.get('resume_form')}): losses "
            f"bit-equal: {tr['resume_bit_equal']} ({tr.get('resume_wall_s')} s)"
        )
    if "eval_equal" in tr:
        lines.append(
            f"- convert to single + eval ({tr.get('eval_as')}): nll {tr['eval_nll']:.5f} over "
            f"{tr['eval_tokens']:,} tokens, the run's own {tr['run_eval_nll']:.5f} over "
            f"{tr['run_eval_tokens']:,}: equal {tr['eval_equal']} (relative difference "
            f"{tr.get('eval_rel_diff', float('nan')):.1e})"
        )
    return lines


def plan(p: dict) -> list[str]:
    if p.get("predicted_step_ms") is None:
        return []
    meas = p.get("measured_step_ms")
    meas = "-" if meas is None else f"{meas:.1f} ms"
    return [
        "",
        f"## megamemo plan ({p['kind']}) beside the training run",
        "",
        "| | predicted | measured |",
        "|---|---|---|",
        f"| step | {p['predicted_step_ms']:.1f} ms | {meas} |",
        f"| peak memory | {p['predicted_mem_gib']} GiB | {p.get('measured_peak_mem_gib') or '-'} GiB |",
    ]


def tests(t: dict) -> list[str]:
    if not t.get("results"):
        return []
    lines = ["", f"## pytest -m gpu: {t['passed']} of {t['total']} passed", ""]
    return lines + [
        f"- {r['result']}: {r['test']}{' ({:.0f} s)'.format(r['s']) if 's' in r else ''}"
        f"{' - ' + r['message'] if r.get('message') else ''}"
        for r in t["results"]
    ]


def markdown(rep: dict) -> str:
    s = rep["sections"]
    res = {k: v.get("result", {}) for k, v in s.items()}
    lines = header(rep) + status_table(s)
    lines += attention_kernel(res.get("attention_kernel", {}).get("rows", []))
    lines += full_step(res.get("full_step", {}).get("rows", []))
    lines += train(res.get("train", {})) + plan(res.get("plan", {})) + tests(res.get("tests", {}))
    if res.get("ds_ops", {}).get("ds_ops"):
        ops = res["ds_ops"]["ds_ops"]
        lines += ["", f"## DeepSpeed ops: {len(ops)} listed; " + ", ".join(f"{k} {v}" for k, v in ops.items())]
    if res.get("model_step", {}).get("lines"):
        lines += ["", "## bench/model_step.py", "", "```"] + res["model_step"]["lines"] + ["```"]
    mg = res.get("multigpu", {})
    if mg:
        lines += ["", f"## multi-GPU: {mg.get('summary') or mg.get('skipped') or mg.get('error') or mg.get('note')}"]
    return "\n".join(lines) + "\n"
