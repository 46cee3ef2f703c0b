"""The start-up check that lets `model.attention: auto` train with FlexAttention: one decoder layer of the run,
at the run's own shapes and dtype, forward and backward, eager against flex.

The layer is the run's own (its weights, its tensor-parallel form, its device and dtype), put in eval mode (no
dropout) for the check and given random inputs: a segment of L rows after a memory of M rows, the memory caches
(LaMemo's cached context and log-normaliser, XL's hidden states), positions and mask as the model makes them.
Gradients are taken with torch.autograd.grad with respect to the inputs only (the segment, the memory, the
positions and the position biases: every path through the attention), so no parameter gradient is written and
no DeepSpeed gradient hook runs. The two forms agree when the mean absolute difference of the output and of every
input gradient, relative to the eager one's mean magnitude, is within the dtype's tolerance (1e-4 in fp32; 3e-2
in bf16 / fp16, where eager and flex round differently: the first H100 run measured 1.7e-2 to 3.3e-2 between a
bf16 form and fp32 at L = M = 128, maximum).
"""
from __future__ import annotations

import torch

from megamemo.model.layers import LaMemoLayer
from megamemo.model.positions import causal_mask, position_sequence, sinusoid

from .apply import apply_attention

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
    return [y.detach()] + [torch.zeros_like(x) if g is None else g for x, g in zip(grads, got)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp_min(1e-30)).item()


def flex_matches_eager(layer, cfg, B: int, L: int, M: int) -> tuple[bool, str]:
    """(agrees, one line of what was seen) for one decoder layer (of the run's own model, on its device, in its
    dtype) at a micro-batch of B streams, L rows and M memory rows. Any exception of the flex form is a
    disagreement, named. The layer is left in eager form and in its training mode."""
    p = next(layer.parameters())
    device, dtype = p.device, p.dtype
    was_training, tf32 = layer.training, torch.backends.cuda.matmul.allow_tf32
    layer.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        args, grads = _inputs(layer, cfg, B, L, M, device, dtype)
        apply_attention(layer, "eager")
        ref = _run(layer, args, grads)
        apply_attention(layer, "flex")
        try:
            got = _run(layer, args, grads)
        except Exception as e:          # noqa: BLE001 - whatever flex cannot do here is reported, not raised
            return False, f"flex failed at B={B} L={L} M={M} {str(dtype)[6:]}: {type(e).__name__}: " \
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}"
        names = ["output"] + [f"d/d input {k}" for k in range(len(grads))]
        diffs = {name: _rel(a, b) for name, a, b in zip(names, got, ref)}
        worst = max(diffs, key=diffs.get)
        tol = TOLERANCE.get(dtype, 3e-2)
        line = (f"flex vs eager at B={B} L={L} M={M} {str(dtype)[6:]}: worst {worst} mean relative difference "
                f"{diffs[worst]:.2e} (tolerance {tol:.0e})")
        return diffs[worst] <= tol and all(torch.isfinite(t).all() for t in got), line
    finally:
        apply_attention(layer, "eager")
        layer.train(was_training)
        torch.backends.cuda.matmul.allow_tf32 = tf32
