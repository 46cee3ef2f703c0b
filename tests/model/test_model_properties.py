"""Properties of the model that the reference files cannot show: the interpolation identity of the paper's
Appendix A, stream independence of memory, ablations and bad input. (The adaptive softmax and bf16 against
fp32: tests/model/test_model_numerics.py.)"""

import pytest
import torch
from helpers.bounds import backward_bound, forward_bound, unit_roundoff
from helpers.tiny import tiny_model

from megamemo.kernels.dropout import CpuDropout
from megamemo.model import Memory, ModelConfig
from megamemo.model.attention import EPS_INTERP, interpolate
from megamemo.model.layers import ReluDropout

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)


def tiny(variant="lamemo", **kw):
    return tiny_model(variant, **{"n_token": 50, "tgt_len": 5, "mem_len": 10, **kw})


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_interpolation_equals_attention_over_union_of_keys(scale):
    """Appendix A: merging a cached partial attention (its normaliser stored as a log) with the look-ahead's
    partial attention gives attention over the union of both key sets - also where exp() would overflow."""
    g = torch.Generator().manual_seed(1)
    B, n, M, dh, k1, k2 = 2, 3, 4, 5, 6, 3
    s_old = torch.randn(B, n, M, k1, generator=g, dtype=torch.float64) * scale
    s_new = torch.randn(B, n, M, k2, generator=g, dtype=torch.float64) * scale
    v_old = torch.randn(B, n, k1, dh, generator=g, dtype=torch.float64)
    v_new = torch.randn(B, n, k2, dh, generator=g, dtype=torch.float64)
    c_old = torch.softmax(s_old, -1) @ v_old
    a = torch.softmax(s_new, -1) @ v_new
    merged, lse = interpolate(c_old, torch.logsumexp(s_old, -1), a, torch.logsumexp(s_new, -1))
    union = torch.softmax(torch.cat([s_old, s_new], -1), -1) @ torch.cat([v_old, v_new], -2)
    assert torch.isfinite(merged).all()
    # interpolate works in fp32 (u = 6e-8) on these fp64 inputs: the log-normalisers rounded to fp32 move the
    # weight's argument by u (|s_old| + |s_new|) <= 2 u max|lse|, alpha (a sigmoid of it, slope <= 1/4) by that / 4
    # plus 4 u for its exp and division plus the spec's eps (1e-6, relative); merged moves by that times
    # |c_old - a| <= 2 max|c_old, a|, plus 2 u of the lerp and the casts. At scale 1: 5.8e-6 (measured 1.5e-6),
    # at 300: 1.4e-4 (measured 4.1e-6).
    u, want_lse = unit_roundoff(torch.float32), torch.logsumexp(torch.cat([s_old, s_new], -1), -1)
    big_lse, big_ctx = float(want_lse.abs().max()), float(torch.cat([c_old, a]).abs().max())
    d_alpha = u * big_lse / 2 + 4 * u + EPS_INTERP
    assert torch.allclose(merged, union, rtol=0, atol=2 * big_ctx * d_alpha + 2 * u * float(union.abs().max()))
    # the merged log-normaliser: s_old's fp32 rounding, u |s_old|, and logaddexp's own: 2 u max|lse|
    # (9.9e-5 at scale 300, measured 2.7e-5; 3.9e-7 at scale 1, measured 7.9e-8)
    assert torch.allclose(lse, want_lse, rtol=0, atol=2 * u * big_lse)


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_streams_are_independent_and_memory_round_trips(variant):
    """A batch of 4 streams equals two batches of 2 with their own memory (what data parallelism relies on),
    and a memory saved through state_dict continues identically."""
    model = tiny(variant)
    data = torch.randint(0, 50, (16, 4))
    mem = mem_a = mem_b = None
    with torch.no_grad():
        for s in range(3):
            x, y = data[5 * s : 5 * s + 5], data[5 * s + 1 : 5 * s + 6]
            nll, mem = model(x, y, mem)
            na, mem_a = model(x[:, :2], y[:, :2], mem_a)
            nb, mem_b = model(x[:, 2:], y[:, 2:], mem_b)
            # batch 4 against batch 2: other GEMM shapes, so other orders of the same sums (not bit-exact: 4.8e-7
            # apart at AVX2). fp32, two orders of a forward pass after s earlier ones through the memory
            # (tests/helpers/bounds.py): (s + 1) forward_bound at max|nll| (measured <= 0.012 of it)
            tol = (s + 1) * forward_bound(model.cfg, float(nll.abs().max()))
            assert torch.allclose(nll, torch.cat([na, nb], 1), rtol=0, atol=tol)
        for k in mem.tensors:  # every memory tensor is [rows, batch, ...]: the halves side by side
            tol = 3 * forward_bound(model.cfg, float(mem[k].abs().max()))
            assert torch.allclose(torch.cat([mem_a[k], mem_b[k]], 1), mem[k], rtol=0, atol=tol)
        assert mem.select_batch(slice(2, 4)).batch_size == 2
        restored = Memory.from_state_dict(mem.state_dict())
        assert restored.equal(mem)
        x, y = data[10:15], data[11:16]
        assert torch.equal(model(x, y, mem)[0], model(x, y, restored)[0])


def test_same_length_without_memory_changes_nothing():
    model = tiny("rpe")
    x = torch.randint(0, 50, (5, 2))
    with torch.no_grad():
        plain, _ = model(x, x)
        same, _ = model(x, x, same_length=True)
    assert torch.isfinite(same).all() and torch.equal(plain, same)


def test_no_lookahead_ablation_keeps_cached_context():
    model = tiny("lamemo_no_lookahead")
    x = torch.randint(0, 50, (5, 2))
    with torch.no_grad():
        _, m1 = model(x, x)
        _, m2 = model(x, x, m1)
    assert torch.equal(m2["ctx.0"][:5], m1["ctx.0"]) and torch.equal(m2["lse.1"][:5], m1["lse.1"])
    assert not hasattr(model, "r_r_bias_future")


def test_lookahead_refreshes_memory_and_trains_future_bias():
    model = tiny("lamemo").train()
    x = torch.randint(0, 50, (5, 2))
    _, m1 = model(x, x)
    nll, m2 = model(x, x, m1)
    nll.mean().backward()
    assert not torch.equal(m2["ctx.0"][:5], m1["ctx.0"])
    assert (m2["lse.0"][:5] > m1["lse.0"]).all()  # logaddexp only grows the normaliser
    assert model.r_r_bias_future.grad is not None and model.r_r_bias_future.grad.abs().sum() > 0


@pytest.mark.parametrize("mem_len", [4, 10])  # caches keep no memory row (mem_len <= L) / keep some of them
def test_top_layer_skips_only_work_nothing_reads(monkeypatch, mem_len):
    """The top LaMemo layer drops its memory rows' o_net and feed-forward (their states are thrown away), and
    their look-ahead when the caches keep none of them. Over segments with growing memory, the NLL, the new
    memory and every parameter's gradient equal those of the model forced to compute all of it."""
    from megamemo.model import layers

    def run(force):
        if force:
            forward = layers.LaMemoLayer.forward
            monkeypatch.setattr(
                layers.LaMemoLayer, "forward", lambda self, *a, **k: forward(self, *a, **{**k, "mem_rows_out": True})
            )
        model = tiny("lamemo", n_layer=3, tgt_len=5, mem_len=mem_len).train()
        x = torch.randint(0, 50, (16, 3), generator=torch.Generator().manual_seed(1))
        mem, out = None, []
        for s in range(3):
            nll, mem = model(x[5 * s : 5 * s + 5], x[5 * s + 1 : 5 * s + 6], mem)
            nll.sum().backward()
            out.append((nll.detach(), mem))
        monkeypatch.undo()
        return out, {n: p.grad for n, p in model.named_parameters()}

    (skipped, g_skip), (full, g_full) = run(False), run(True)
    # skipping rows changes the GEMMs' shapes, so the order of their sums: fp32, two orders of the forward pass
    # after s earlier segments through the memory (tests/helpers/bounds.py; measured <= 0.021 of the old 1e-6, and of
    # this)
    cfg = tiny("lamemo", n_layer=3, tgt_len=5, mem_len=mem_len).cfg
    for s, ((n1, m1), (n2, m2)) in enumerate(zip(skipped, full, strict=True)):
        assert torch.allclose(n1, n2, rtol=0, atol=(s + 1) * forward_bound(cfg, float(n2.abs().max())))
        assert m1.length == m2.length
        for k in m2.tensors:
            tol = (s + 1) * forward_bound(cfg, float(m2[k].abs().max()))
            assert torch.allclose(m1[k], m2[k], rtol=0, atol=tol), k
    assert g_skip.keys() == g_full.keys()
    for n in g_full:  # and the backward, over 3 segments of 5 x 3 tokens
        tol = 3 * backward_bound(cfg, float(g_full[n].abs().max()), tokens=15)
        assert g_full[n] is not None and torch.allclose(g_skip[n], g_full[n], rtol=0, atol=tol), n


def test_bad_input_names_the_problem():
    model = tiny("lamemo")
    x = torch.randint(0, 50, (5, 2))
    with pytest.raises(ValueError, match=r"input token ids must be in \[0, 50\)"):
        model(x + 100, x)
    with pytest.raises(ValueError, match="target shape"):
        model(x, x[:3])
    with torch.no_grad():
        _, mem = model(x, x)
    with pytest.raises(ValueError, match="2 streams but the input has batch 3"):
        model(torch.randint(0, 50, (5, 3)), None, mem)
    broken = Memory({**mem.tensors, "ctx.0": mem["ctx.0"][..., :4]})
    with pytest.raises(ValueError, match="'ctx.0' has shape"):
        model(x, x, broken)
    with pytest.raises(ValueError, match="do not match this model"):
        tiny("xl")(x, x, mem)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.n_heads: unknown field"):
        ModelConfig.from_dict({"n_heads": 4})
    with pytest.raises(ValueError, match="model.d_model: expected int"):
        ModelConfig.from_dict({"d_model": "512"})
    with pytest.raises(ValueError, match="model.variant"):
        ModelConfig.from_dict({"variant": "lstm"})


DROPOUTS = {  # the model's plain dropout (torch's) and the CPU kernel's (megamemo/kernels/dropout.py)
    "plain": lambda p, relu=False: (ReluDropout if relu else torch.nn.Dropout)(p),
    "cpu": lambda p, relu=False: CpuDropout(p, relu=relu),
}


@pytest.mark.parametrize("path", DROPOUTS)
def test_dropout_mask_has_the_right_law_and_replays(path):
    """Both paths' dropout: kept values scaled by 1/(1-p); the kept fraction 1-p within 5 sigma, for neighbours
    too (independent draws); the backward uses the forward's mask; the same seed replays the same mask; eval
    mode is the identity. The CPU mask (a 32-bit comparison): a p whose first base-256 digit leaves a half-kept
    tie (25.5/256) lands on it, not on 25/256 or 26/256 (13 sigma away)."""
    p, n = 0.3, 400_001
    x = torch.ones(n, requires_grad=True)
    drop = DROPOUTS[path](p).train()
    torch.manual_seed(5)
    y = drop(x)
    keep = y != 0
    # bit-exact: a kept 1.0 times the scale is the scale rounded to fp32 once (equal at both ISAs)
    assert torch.equal(y[keep], torch.tensor(1 / (1 - p)).expand(y[keep].shape))
    tol = 5 * (p * (1 - p) / (n // 2)) ** 0.5
    for half in (keep[0::2], keep[1::2]):
        assert abs(half.float().mean().item() - (1 - p)) < tol
    both = (keep[0:-1:2] & keep[1::2]).float().mean().item()
    assert abs(both - (1 - p) ** 2) < tol
    y.backward(torch.full((n,), 2.0))
    assert torch.equal(x.grad, 2 * y.detach())
    torch.manual_seed(5)
    assert torch.equal(drop(x), y)
    assert not torch.equal(drop(x), y)
    assert drop.eval()(x) is x
    if path == "cpu":
        p, n = 25.5 / 256, 4_000_000
        dropped = (DROPOUTS[path](p).train()(torch.ones(n)) == 0).float().mean().item()
        assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5, dropped


@pytest.mark.parametrize("n", [3001, 40_003])  # direct tie search, and the search eight bytes at a time
def test_dropout_mask_is_a_32_bit_comparison_drawn_digit_by_digit(monkeypatch, n):
    """keep_mask keeps an element when its uniform 32-bit number U >= T = round(p * 2^32), drawing U's base-256
    digits level by level, only for the elements that tied with T so far. Fed digits crowded with ties (each is
    T's digit at that level, or one above or below it), its mask equals the lexicographic comparison of every
    element's digits with T's, rebuilt here element by element from the same draws."""
    from megamemo.kernels import dropout as D

    T = round(0.1 * 2**32)
    t = [(T >> s) & 255 for s in (24, 16, 8, 0)]
    gen = torch.Generator().manual_seed(n)
    draws = []  # one call per level, in order

    def crowded_bytes(k, device=None):
        draws.append((t[len(draws)] + torch.randint(-1, 2, (k,), generator=gen)).to(torch.uint8))
        return draws[-1].clone()

    monkeypatch.setattr(D, "random_bytes", crowded_bytes)
    keep = D.keep_mask((n,), 0.1)
    assert len(draws) == 4 and len(draws[3]) > 20  # every level was reached, by many elements

    digits = [[] for _ in range(n)]
    tied = list(range(n))
    for level, vals in enumerate(draws):
        assert len(vals) == len(tied)
        for i, v in zip(tied, vals.tolist(), strict=True):
            digits[i].append(v)
        tied = [i for i in tied if digits[i][-1] == t[level]]
    expected = torch.tensor([d >= t[: len(d)] for d in digits])
    assert torch.equal(keep, expected)
    assert 0 < keep.sum() < n


def test_interpolation_guard_has_nan_to_nums_values_and_gradient():
    """The interpolation's overflow guard (attention._NanToNum) gives torch.nan_to_num's values and gradient, bit
    for bit, at finite, NaN and infinite entries (signed zeros included)."""
    from megamemo.model.attention import _NanToNum

    x = torch.randn(6, 5, 4)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    x[1, 2, 1] = 0.0
    g = torch.randn_like(x)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = _NanToNum.apply(a), torch.nan_to_num(b)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(a.grad, b.grad) and torch.equal(a.grad.signbit(), b.grad.signbit())
    assert (a.grad[0, 0, :3] == 0).all() and torch.equal(a.grad[1:], g[1:])


@pytest.mark.parametrize("path", DROPOUTS)
def test_relu_dropout_is_relu_then_dropout(path):
    """The feed-forward's inner dropout (ReluDropout, or CpuDropout(relu=True) that folds the ReLU into the mask's
    pass): the same values and gradient as ReLU followed by the same path's dropout with the same draw."""
    x = torch.randn(3001, 7, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(9)
    y = DROPOUTS[path](0.2, relu=True).train()(x)
    torch.manual_seed(9)
    y_ref = DROPOUTS[path](0.2).train()(torch.relu(x_ref))
    assert torch.equal(y, y_ref) and (y != 0).any() and (y == 0).any()
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(DROPOUTS[path](0.2, relu=True).eval()(x), torch.relu(x))


_FAULTS = """
import resource, sys, torch
from megamemo.kernels import apply_kernels
from megamemo.runtime.allocator import tune_cpu_allocator
from megamemo.model import MemTransformerLM, ModelConfig
applied = tune_cpu_allocator() if sys.argv[1] == "1" else False
torch.manual_seed(0)
cfg = ModelConfig(variant="lamemo", n_token=256, n_layer=2, d_model=256, n_head=4, d_head=64, d_inner=1024,
                  dropout=0.1, tgt_len=64, mem_len=64)
model = MemTransformerLM(cfg).train()
apply_kernels(model, "auto", "cpu")  # as `megamemo train` on a CPU
opt = torch.optim.Adam(model.parameters())
mem, faults = None, []
for step in range(int(sys.argv[2])):
    x = torch.randint(0, 256, (65, 4))
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    nll, mem = model(x[:-1], x[1:], mem)
    nll.mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(applied, *faults)
"""
WARM_UP, STEADY = 4, 8


@pytest.mark.multiproc  # starts 3 training processes, one after another (`-m 'not multiproc'`: the fast subset)
def test_tuned_allocator_leaves_no_page_faults_in_steady_state():
    """megamemo.runtime.allocator keeps freed blocks: past the first steps a LaMemo training step (the speed benchmark's
    widths, at half its segment and batch: 64 tokens, 64 of memory, 4 streams) touches no fresh page in most steps,
    where glibc without it faults thousands of pages a step (here: a median of 24k a step against 1).

    Measured over 8 steps after 4 of warm-up (the heap reaches its peak in the first few). The control is glibc
    at its starting settings held fixed (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ = 128 KiB, which also
    stops the threshold from adapting): every large block is a fresh mmap, so it faults every step. glibc's own
    adaptive default lies between the two and is not a stable control: on this machine it faulted 35k-75k pages
    in some runs and 18 in another (the threshold had grown past the step's block sizes). The tuned run's median
    step touches under 50 fresh pages, and its total is under a quarter of the control's."""
    import os
    import platform
    import statistics
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"not glibc ({platform.libc_ver()}): mallopt unavailable")

    def faults(mode, **env):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS, mode, str(WARM_UP + STEADY)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        )
        applied, *counts = out.stdout.split()
        return applied == "True", [int(c) for c in counts][WARM_UP:]

    applied, tuned = faults("1")
    _, default = faults("0", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied and len(tuned) == len(default) == STEADY
    assert statistics.median(tuned) < 50, (tuned, default)
    assert 4 * sum(tuned) < sum(default), (tuned, default)
    off = subprocess.run(
        [sys.executable, "-c", "from megamemo.runtime.allocator import tune_cpu_allocator as t; print(t())"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MEGAMEMO_TUNE_MALLOC": "0"},
    )
    assert off.stdout.strip() == "False"
