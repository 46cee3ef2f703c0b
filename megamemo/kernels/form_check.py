"""The start-up check of a training run's attention forms (megamemo/train/forms.py): one decoder layer of the run,
at the run's own shapes and dtype, forward and backward, eager against another form (flex, fused, any of them in a
compiled layer), and the timing of one layer's forward + backward in each form that agrees.

The layer is the run's own (its weights, its tensor-parallel form, its device and dtype), put in eval mode (no
dropout) for the check and given random inputs: a segment of L rows after a memory of M rows, the memory caches
(LaMemo's cached context and log-normaliser, XL's hidden states), positions and mask as the model makes them.
Gradients are taken with torch.autograd.grad with respect to the inputs only (the segment, the memory, the
positions and the position biases: every path through the attention), so no parameter gradient is written and
no DeepSpeed gradient hook runs. The two forms agree when the mean absolute difference of the output and of every
input gradient, relative to the eager one's mean magnitude, is within the dtype's tolerance (1e-4 in fp32; 3e-2
in bf16 / fp16, where eager and flex round differently: the first H100 run measured 1.7e-2 to 3.3e-2 between a
bf16 form and fp32 at L = M = 128, maximum). Whatever a form raises (a compile error, a kernel that cannot launch)
is a disagreement, named in one line: a form that cannot run is skipped, never a crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megamemo.model.layers import LaMemoLayer
from megamemo.model.positions import causal_mask, position_sequence, sinusoid

from .apply import apply_attention
from .compiler import compile_attention_regions, enable_compiler

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def _inputs(layer, cfg, B: int, L: int, M: int, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    attn = layer.attn
    n, dh, d = attn.n_head, attn.d_head, cfg.d_model
    klen = M + L
    pos = position_sequence(klen, M, cfg.clamp_len, cfg.future_positions, device)
    pos_emb = sinusoid(pos, d, dtype).requires_grad_()
    mask = causal_mask(L, M, cfg.mem_len, cfg.same_length, device)
    u, vb, vf = rnd(n, dh, scale=0.1), rnd(n, dh, scale=0.1), rnd(n, dh, scale=0.1)
    args: tuple
    if isinstance(layer, LaMemoLayer):
        cat, ctx_old = rnd(klen, B, d), rnd(M, B, n, dh)
        lse_old = rnd(M, B, n).detach().float().add_(2.0).requires_grad_()
        args = (cat, M, ctx_old, lse_old, pos_emb, u, vb, vf, mask, cfg.mem_len)
        grads = [cat, ctx_old, lse_old, pos_emb, u, vb, vf]
    else:
        h, mem = rnd(L, B, d), rnd(M, B, d)
        args = (h, mem, pos_emb, u, vb, mask)
        grads = [h, mem, pos_emb, u, vb]
    return args, grads


def _run(layer, args, grads):
    out = layer(*args)
    y = out[0] if isinstance(out, tuple) else out
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    got = torch.autograd.grad((y * w).sum(), grads, allow_unused=True)
    return [y.detach()] + [torch.zeros_like(x) if g is None else g for x, g in zip(grads, got, strict=True)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class Form:
    """How the layers compute: an attention form (eager | flex | fused) and whether the layer is compiled."""

    attention: str
    compiled: bool = False

    def __str__(self) -> str:
        return self.attention + (" compiled" if self.compiled else "")


def _runner(layer, form: Form, backend: str, regions: bool):
    """The layer in `form`: compiled whole, or (regions: under tensor parallelism) its attention functions only."""
    apply_attention(layer, form.attention)
    if not form.compiled:
        return layer
    if regions:
        compile_attention_regions(layer, backend)
        return layer
    enable_compiler()
    return torch.compile(layer, backend=backend, dynamic=False)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_form(
    layer, cfg, B: int, L: int, M: int, form: Form, backend: str = "inductor", time_reps: int = 0, regions: bool = False
) -> tuple[bool, str, float | None]:
    """(agrees, one line of what was seen, seconds of one forward + backward in `form` when it agrees and
    time_reps > 0, else None) for one decoder layer (of the run's own model, on its device, in its dtype) at a
    micro-batch of B streams, L rows and M memory rows. Any exception of the form is a disagreement, named. A
    compiled form compiles the whole layer, or with `regions` (tensor parallelism) its attention functions. The
    layer is left in eager form, uncompiled and in its training mode."""
    p = next(layer.parameters())
    device, dtype = p.device, p.dtype
    was_training, tf32 = layer.training, torch.backends.cuda.matmul.allow_tf32
    layer.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    where = f"B={B} L={L} M={M} {str(dtype)[6:]}"
    try:
        args, grads = _inputs(layer, cfg, B, L, M, device, dtype)
        apply_attention(layer, "eager")
        ref = _run(layer, args, grads)
        try:
            runner = _runner(layer, form, backend, regions)
            got = _run(runner, args, grads)
        except Exception as e:  # whatever a form cannot do here is reported, not raised
            return False, f"{form} failed at {where}: {_first_line(e)}", None
        names = ["output"] + [f"d/d input {k}" for k in range(len(grads))]
        diffs = {name: _rel(a, b) for name, a, b in zip(names, got, ref, strict=True)}
        worst = max(diffs, key=lambda k: diffs[k])
        tol = TOLERANCE.get(dtype, 3e-2)
        line = (
            f"{form} vs eager at {where}: worst {worst} mean relative difference {diffs[worst]:.2e} "
            f"(tolerance {tol:.0e})"
        )
        ok = diffs[worst] <= tol and all(torch.isfinite(t).all() for t in got)
        seconds = None
        if ok and time_reps > 0:
            torch.backends.cuda.matmul.allow_tf32 = tf32  # timed as the run computes
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(time_reps):
                _run(runner, args, grads)
            _sync(device)
            seconds = (time.perf_counter() - t0) / time_reps
        return ok, line, seconds
    finally:
        apply_attention(layer, "eager")
        layer.train(was_training)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def flex_matches_eager(layer, cfg, B: int, L: int, M: int) -> tuple[bool, str]:
    """check_form for FlexAttention in an uncompiled layer: (agrees, one line)."""
    ok, line, _ = check_form(layer, cfg, B, L, M, Form("flex"))
    return ok, line
