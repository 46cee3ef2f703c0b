"""One training step of a config's model at its real width, in each way megamemo can compute it, side by side in
one process: eager, compiled layers (train.compile), FlexAttention (model.attention: flex), the fused Triton kernels
(model.attention: fused), and each attention in compiled layers. `--forms auto`: the forms `model.attention: auto`
would time on this device (megamemo/train/forms.py candidates).

    python bench/gpu_step.py --config configs/lamemo-1.3b.yaml --batch 4 --forms auto     # full depth, one GPU
    python bench/gpu_step.py --config configs/lamemo-1.3b.yaml --layers 2 --batch 4       # 2 layers of its width
    python bench/gpu_step.py --device cpu --tiny --forms eager compiled --backend aot_eager  # the plumbing (CPU)

A step is forward + backward of one micro-batch of --batch streams over tgt_len tokens with a full memory of
mem_len rows carried from the step before (the steady state of training; the optimizer is not timed: its cost
is per parameter, the same in every form). Weights in the run's half precision (bf16 on CUDA from compute
capability 8.0, else fp16; --dtype) as DeepSpeed holds them. Every form starts from the same weights and data;
its first loss is printed beside eager's (a form that computes something else shows here).

Printed per form: tokens/s, ms/step, HFU (the FLOPs the step executes, megamemo/model/flops.py step_flops, over
the device's datasheet peak: megamemo/runtime/peak.py) and MFU (the PaLM convention, flops.py), peak memory,
and for the uncompiled forms the forward time of each part of the layers (CUDA events around each call:
projections, attention, look-ahead, interpolation, output and FFN blocks; norms and dropout are also inside the
blocks that call them). Compiled forms fuse across those parts: no breakdown. --json writes it all at the end;
--jsonl appends each row as soon as it is measured (a kill keeps what ran). --optimizer adds a row: the one-GPU
optimizer step (bench/step_extras.py); --profile-layer one: the top kernels of one compiled layer (torch.profiler).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")  # this bench compiles (megamemo's command would turn it off)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import step_extras
import torch
from torch import nn

from megamemo.kernels import apply_attention, apply_kernels
from megamemo.kernels.compiler import compile_layers, compile_stats
from megamemo.model import (
    MemTransformerLM,
    ModelConfig,
    flops,
)
from megamemo.runtime.peak import device_peak

FORMS = ("eager", "compiled", "flex", "compiled+flex", "fused", "compiled+fused")
TINY = dict(n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128, tgt_len=32, mem_len=32, n_token=256)


def model_config(path: str, layers: int | None, tiny: bool) -> ModelConfig:
    import yaml

    d = (yaml.safe_load(Path(path).read_text()) or {}).get("model", {})
    d = {k: v for k, v in d.items() if k in ModelConfig.__dataclass_fields__}
    if tiny:
        d.update(TINY)
    if layers:
        d["n_layer"] = layers
    if not isinstance(d.get("n_token", 256), int):
        d["n_token"] = 32000
    return ModelConfig.from_dict(d)


class PartTimer:
    """Forward time of named calls: CUDA events on a GPU (no sync inside the step), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.on = False
        self.spans = defaultdict(list)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(*args, **kwargs)
                b.record()
            else:
                a = time.perf_counter()
                out = fn(*args, **kwargs)
                b = time.perf_counter()
            self.spans[name].append((a, b))
            return out

        return timed

    def ms(self, steps: int) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for name, spans in self.spans.items():
            t = sum(a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in spans)
            out[name] = t / steps
        return out

    def instrument(self, model: nn.Module) -> None:
        from megamemo.model import layers as L

        for m in model.modules():
            if isinstance(m, L.RelAttention):
                m.heads = self.wrap("projections (q, k, v)", m.heads)
                m.rel = self.wrap("projections (r_net)", m.rel)
                m.causal = self.wrap("attention", m.causal)
                m.lookahead = self.wrap("look-ahead", m.lookahead)
                m.output = self.wrap("output (o_net, dropout, residual, norm)", m.output)
            if isinstance(m, L.FeedForward):
                m.forward = self.wrap("feed-forward (with its norm, dropout)", m.forward)
        self._interpolate = L.interpolate
        L.interpolate = self.wrap("interpolation", L.interpolate)

    def uninstall(self) -> None:
        from megamemo.model import layers as L

        self.on = False
        L.interpolate = self._interpolate


def parse_form(form: str) -> tuple[str, bool]:
    """(attention, compiled layers) of a form's name: "compiled" is eager attention in compiled layers."""
    if form == "compiled":
        return "eager", True
    attention = form.removeprefix("compiled+")
    return attention, attention != form


def run_form(form, base, cfg, args, device, dtype, data, peak):
    """(the form's row, its model: for the profile of a compiled layer; the caller lets it go)."""
    model = copy.deepcopy(base).to(device=device, dtype=dtype).train()
    apply_kernels(model, "auto", device)
    timer = None
    attention, compiled = parse_form(form)
    if attention != "eager":
        apply_attention(model, attention)
    if compiled:
        compile_layers(model, args.backend)
    else:
        timer = PartTimer(device)
        timer.instrument(model)
    B, Lt = args.batch, cfg.tgt_len
    mem, losses = None, []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_compile = time.perf_counter()
    steps = args.warmup + args.steps
    for s in range(steps):
        if s == args.warmup:
            sync()
            t_warm = time.perf_counter() - t_compile
            if timer is not None:
                timer.on = True
            t0 = time.perf_counter()
        x = data[s % len(data)]
        nll, mem = model(x[:-1], x[1:], mem)
        loss = nll.float().mean()
        loss.backward()
        losses.append(loss.detach())
        for p in model.parameters():
            p.grad = None
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    if timer is not None:
        timer.uninstall()
    tokens = B * Lt
    hfu_flops = flops.step_flops(cfg, B)
    mfu_flops = flops.model_flops(cfg, B)
    row = {
        "form": form,
        "ms_per_step": dt * 1e3,
        "tokens_per_s": tokens / dt,
        "first_loss": float(losses[0]),
        "warmup_s": t_warm,
        "hfu": hfu_flops / dt / peak.flops if peak.flops else None,
        "mfu": mfu_flops / dt / peak.flops if peak.flops else None,
        "tflops": hfu_flops / dt / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "parts_fwd_ms": timer.ms(args.steps) if timer is not None else None,
    }
    if compiled:
        row["compile"] = compile_stats()
    return row, model


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs/lamemo-1.3b.yaml"))
    ap.add_argument("--layers", type=int, help="n_layer override (default: the config's, full depth)")
    ap.add_argument("--batch", type=int, default=4, help="streams per micro-batch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (memory fills, compiles happen)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    ap.add_argument(
        "--forms",
        nargs="+",
        choices=FORMS + ("auto",),
        default=list(FORMS),
        help="auto: the forms model.attention: auto would time here",
    )
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled forms")
    ap.add_argument("--tiny", action="store_true", help="a tiny width (the CPU check of the plumbing)")
    ap.add_argument("--json", help="write the rows here at the end")
    ap.add_argument("--jsonl", help="append each row here as soon as it is measured")
    ap.add_argument("--optimizer", action="store_true", help="a row for the one-GPU optimizer step")
    ap.add_argument(
        "--profile-layer",
        action="store_true",
        help="a row for the top kernels of one compiled layer (the first compiled form's)",
    )
    return ap.parse_args(argv)


def _emit(a, row: dict, common: dict) -> None:
    if a.jsonl:
        with open(a.jsonl, "a") as fh:
            fh.write(json.dumps({**common, **row}) + "\n")


def _setup(a):
    device = torch.device(a.device)
    if a.dtype == "auto":
        a.dtype = (
            ("bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16")
            if device.type == "cuda"
            else "fp32"
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    cfg = model_config(a.config, a.layers, a.tiny)
    cfg.dropout, cfg.attention = 0.0, "eager"  # every form computes the same function: losses comparable
    skipped = []
    if a.forms == ["auto"]:
        a.forms, skipped = step_extras.auto_forms(a.config, device, log=lambda line: print(line, flush=True))
    if device.type == "cpu" and any("flex" in f for f in a.forms):
        sys.exit("gpu_step: FlexAttention has no backward on the CPU: --forms eager compiled there")
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: a 1.3b init on the CPU takes long
        base = MemTransformerLM(cfg)
    return device, dtype, cfg, base, skipped


def main(argv=None) -> int:
    a = parse_args(argv)
    device, dtype, cfg, base, skipped = _setup(a)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.n_token, (cfg.tgt_len + 1, a.batch), generator=g).to(device) for _ in range(4)]
    peak = device_peak(device, a.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    n_param = sum(p.numel() for p in base.parameters())
    print(
        f"gpu_step: {cfg.variant} {cfg.n_layer}L d_model {cfg.d_model} {cfg.n_head}x{cfg.d_head} d_inner "
        f"{cfg.d_inner} vocab {cfg.n_token} ({n_param / 1e6:.1f}M params) | batch {a.batch} x tgt_len "
        f"{cfg.tgt_len}, mem_len {cfg.mem_len} | {a.dtype} on {name} | torch {torch.__version__} | peak "
        f"{peak.source} | forms {' '.join(a.forms)}{''.join(f' | skipped {x}' for x in skipped)}",
        flush=True,
    )
    common = {"device": name, "dtype": a.dtype, "layers": cfg.n_layer, "batch": a.batch, "params": n_param}
    _emit(a, {"form": "setup", "forms": a.forms, "skipped": skipped}, common)
    rows, profiled = [], not a.profile_layer
    for form in a.forms:
        model = None
        try:
            row, model = run_form(form, base, cfg, a, device, dtype, data, peak)
        except Exception as e:  # one form failing never hides the others
            row = {"form": form, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        rows.append(row)
        _emit(a, row, common)  # before the next form runs: a kill keeps it
        print(format_row(row, rows[0]), flush=True)
        if not profiled and model is not None and parse_form(form)[1]:
            rows.append(
                _extra(a, common, lambda model=model, form=form: step_extras.profile_row(model, cfg, a.batch, form))
            )
            profiled = True
        model = None  # freed before empty_cache (the lambda above shares the name)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if a.optimizer:
        rows.append(_extra(a, common, lambda: step_extras.optimizer_row(base, device, dtype)))
    if a.json:
        Path(a.json).write_text(
            json.dumps({**common, "config": a.config, "model": cfg.to_dict(), "rows": rows}, indent=1) + "\n"
        )
    return 0 if all("error" not in r for r in rows) else 1


def _extra(a, common: dict, fn) -> dict:
    """A row beside the forms' (the optimizer's, the profile's), written and printed; its failure is its row."""
    try:
        row = fn()
    except Exception as e:  # recorded, never hides the forms' rows
        row = {"form": "extra", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    _emit(a, row, common)
    print(format_row(row, row), flush=True)
    return row


def _pct(x):
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def format_row(r: dict, first: dict) -> str:
    if "error" in r:
        return f"  {r['form']:<14} FAILED {r['error']}"
    if r["form"] == "optimizer":
        return f"  optimizer      {r['ms_per_step']:8.2f} ms a step: {r['what']}, {r['params'] / 1e6:.1f}M params"
    if r["form"] == "profile":
        return f"  profile of one {r['of']} layer ({r['total_ms']:.2f} ms of {r['unit']}):\n" + "\n".join(
            f"      {k['ms']:8.3f} ms {k['calls']:5d}x  {k['name'][:90]}" for k in r["kernels"]
        )
    same = (
        ""
        if r is first or "first_loss" not in first
        else f" | first loss {r['first_loss']:.5f} (eager {first['first_loss']:.5f})"
    )
    mem = f" | peak {r['peak_mem_gib']:.2f} GiB" if r["peak_mem_gib"] is not None else ""
    line = (
        f"  {r['form']:<14} {r['tokens_per_s']:>10,.0f} tokens/s {r['ms_per_step']:8.2f} ms/step "
        f"{r['tflops']:7.1f} TFLOP/s | HFU {_pct(r['hfu'])} | MFU {_pct(r['mfu'])}{mem} | warm-up "
        f"{r['warmup_s']:.1f}s{same}"
    )
    if r.get("compile"):
        line += f" | {r['compile']['graphs']} graphs"
    if r["parts_fwd_ms"]:
        line += "\n" + "\n".join(f"      {k:<42} {v:8.2f} ms (forward)" for k, v in r["parts_fwd_ms"].items())
    return line


if __name__ == "__main__":
    sys.exit(main())
