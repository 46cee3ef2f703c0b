"""How a training run's layers compute: the attention form (model.attention: eager | flex | fused | auto) and
compiled layers (train.compile: auto | on | off), chosen once the model is built on its device.

Explicit choices are taken as given, after a start-up check of the form against eager on one layer of the run
(megamemo/kernels/form_check.py); a form that fails it is a config error naming what was seen.

`auto` on CUDA picks the fastest form that works here. The candidates:
  * eager, always (the reference: it cannot fail);
  * fused (megamemo/kernels/fused.py), where triton can launch its kernels;
  * flex (FlexAttention), on sm80 and newer only (below it Triton has no tensor-core path: ~10x slower than SDPA
    on a V100), and not under train.deterministic (its backward adds the position term's gradients atomically);
  * each of them compiled as well, where train.compile resolves on: the whole layer, or under tensor parallelism
    the attention between the collectives (megamemo/kernels/compiler.py compile_attention_regions);
none with attention dropout (model.dropatt > 0: eager only, said in one line). Each candidate other than eager is
checked against eager on one layer at the run's own shapes and dtype; a candidate that fails to compile, to run or
to agree is skipped with its reason in the start-up line, never a crash (compiled layers + flex failed in inductor
on an H200). Each one that agrees is timed (forward + backward of the layer), and every rank takes the same
choice: a candidate counts only where it passed on every rank, at the slowest rank's time. The start-up line
gives the choice, the timings and the skipped forms.

On the CPU `auto` is eager (flex has no CPU backward; fused runs there only in Triton's interpreter, for tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megamemo.config.run import ConfigError
from megamemo.kernels import apply_attention
from megamemo.kernels.compiler import CompilerUnavailable, decoder_layers, enable_compiler, resolve_compile
from megamemo.kernels.form_check import Form, check_form
from megamemo.kernels.fused import FusedUnavailable, check_device
from megamemo.train.config import RunConfig

TIME_REPS = 5  # forward + backward repetitions a candidate is timed over, after the check's warm-up


def _compile_options(cfg: RunConfig, device, log) -> tuple[bool, ...]:
    """The compiled-ness auto may give the layers: (False,), (True,) or both."""
    if not resolve_compile(cfg.train.compile, device):
        return (False,)
    try:
        enable_compiler()
    except CompilerUnavailable as e:
        if cfg.train.compile == "on":
            raise ConfigError(f"train.compile: on: {e}") from None
        log(f"[train] compile: off ({e})")
        return (False,)
    return (True,) if cfg.train.compile == "on" else (False, True)


def capability(device) -> tuple[int, int]:
    """The CUDA device's compute capability ((0, 0) where there is none)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(dev)


def _attention_candidates(cfg: RunConfig, device) -> tuple[list[str], list[str]]:
    """(attention forms auto may time, "form: why not" for those it may not)."""
    forms, skipped = ["eager"], []
    try:
        check_device(device)
        forms.append("fused")
    except FusedUnavailable as e:
        skipped.append(f"fused: {str(e).removeprefix('model.attention: ')}")
    major = capability(device)[0]
    if cfg.train.deterministic:
        skipped.append("flex: train.deterministic (its backward adds gradients atomically, in no fixed order)")
    elif major < 8:
        skipped.append(f"flex: sm{major}0 (Triton has no tensor-core path below sm80)")
    else:
        try:
            enable_compiler()
            forms.append("flex")
        except CompilerUnavailable as e:
            skipped.append(f"flex: {e}")
    return forms, skipped


def candidates(cfg: RunConfig, device, log) -> tuple[list[Form], list[str]]:
    """(the forms `auto` times on this device, in order, eager first; "form: why not" for the forms left out)."""
    attentions, skipped = _attention_candidates(cfg, device)
    compiled = _compile_options(cfg, device, log)
    return [Form(a, c) for a in attentions for c in compiled], skipped


def _all_ranks(values: list[float], device) -> list[float]:
    """Each value's maximum over the ranks (inf: failed somewhere); the values themselves with one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    on = device if torch.device(device).type == "cuda" and torch.cuda.is_available() else "cpu"  # NCCL: CUDA
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sizes(cfg: RunConfig, micro: int) -> tuple[int, int, int]:
    m = cfg.model
    return micro, m.tgt_len, (m.mem_len if m.has_memory else 0)


def pick(forms: list[Form], seconds: list[float]) -> Form:
    """The fastest form with a finite time (eager when nothing else is); ties keep the earlier form."""
    best = min(range(len(forms)), key=lambda k: (seconds[k], k))
    return forms[best] if seconds[best] != float("inf") else Form("eager", False)


def _time_forms(cfg: RunConfig, model, device, micro: int, forms: list[Form]) -> tuple[list[float], list[str]]:
    """(each form's seconds of one layer's forward + backward on this rank, inf where it failed; the failures'
    lines)."""
    layers = decoder_layers(model)
    if not layers:  # a stage without decoder layers: nothing to say here
        return [0.0] * len(forms), []
    seconds, failed = [], []
    for form in forms:
        ok, line, t = check_form(
            layers[0],
            cfg.model,
            *_sizes(cfg, micro),
            form,
            backend=cfg.train.compile_backend,
            time_reps=TIME_REPS,
            regions=cfg.parallel.tp > 1,
        )
        seconds.append(t if ok and t is not None else float("inf"))
        if not ok:
            failed.append(line)
    return seconds, failed


def _timing_line(forms, seconds, skipped, failed) -> str:
    timed = sorted((s, str(f)) for f, s in zip(forms, seconds, strict=True) if s != float("inf"))
    parts = [", ".join(f"{name} {s * 1e3:.2f} ms" for s, name in timed)]
    parts += [f"skipped {x}" for x in skipped + failed]
    return "; ".join(p for p in parts if p)


def choose_auto(cfg: RunConfig, model, device, micro: int, log) -> Form:
    """model.attention: auto on CUDA: the fastest candidate that passed on every rank, put into the model (its
    attention; the caller compiles the layers when the form says so)."""
    forms, skipped = candidates(cfg, device, log)
    seconds, failed = _time_forms(cfg, model, device, micro, forms)
    seconds = _all_ranks(seconds, device)
    failed += [
        f"{f}: failed on another rank"
        for f, s in zip(forms, seconds, strict=True)
        if s == float("inf") and not any(line.startswith(str(f) + " ") for line in failed)
    ]
    chosen = pick(forms, seconds)
    B, L, M = _sizes(cfg, micro)
    log(
        f"[train] attention: {chosen.attention}, {'compiled' if chosen.compiled else 'eager'} layers (one layer's "
        f"forward + backward at B={B} L={L} M={M}: {_timing_line(forms, seconds, skipped, failed)})"
    )
    apply_attention(model, chosen.attention)
    return chosen


def _checked_explicit(cfg: RunConfig, model, device, micro: int, form: str) -> None:
    """An explicit flex or fused, checked against eager on one layer: a ConfigError naming what was seen."""
    if form == "fused":
        try:
            check_device(device)
        except FusedUnavailable as e:
            raise ConfigError(str(e)) from None
    if form == "flex":
        try:
            enable_compiler()
        except CompilerUnavailable as e:
            raise ConfigError(f"model.attention: flex: {e}") from None
    layers = decoder_layers(model)
    ok, line = True, "no decoder layer on this rank"
    if layers:
        ok, line, _ = check_form(layers[0], cfg.model, *_sizes(cfg, micro), Form(form))
    if _all_ranks([0.0 if ok else 1.0], device)[0] > 0:
        if ok:  # rank 0 says the error, and its own check may have passed
            raise ConfigError(
                f"model.attention: {form} does not match eager on another rank (this rank's check: {line})"
            )
        raise ConfigError(f"model.attention: {form} does not match eager here: {line}")


def choose_form(cfg: RunConfig, model, device, micro: int, log) -> Form:
    """Resolve model.attention and train.compile for this run; the attention is put into the model, the layers
    are compiled by the caller when the returned form says so."""
    choice, m = cfg.model.attention, cfg.model
    cuda = torch.device(device).type == "cuda"
    if choice == "auto" and not cuda:
        apply_attention(model, "eager")
        return Form("eager", _compile_options(cfg, device, log)[-1])
    if choice == "auto" and m.dropatt > 0:
        log(
            f"[train] attention: eager (model.dropatt={m.dropatt}: the fused and flex kernels cannot drop "
            f"attention weights)"
        )
        apply_attention(model, "eager")
        return Form("eager", _compile_options(cfg, device, log)[-1])
    if choice == "auto":
        return choose_auto(cfg, model, device, micro, log)
    if choice != "eager":
        _checked_explicit(cfg, model, device, micro, choice)
        log(f"[train] attention: {choice} (checked against eager on one layer)")
    apply_attention(model, choice)
    return Form(choice, _compile_options(cfg, device, log)[-1])
