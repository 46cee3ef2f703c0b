"""bf16 gradients accumulate in fp32 in every shipped config (issue 28, item 2).

The accumulation test runs DeepSpeed itself (one process, bf16 on the CPU, ZeRO 1, grad_accum 8) and reads the
gradient it is about to step with (BF16_Optimizer's fp32 buffer, param._hp_grad) against the exact (fp64) sum of the
eight micro-batches' own bf16 gradients, read by hooks on the parameters as autograd produces them.

The bound, derived. A sum of k terms in floating point with unit roundoff v is off by at most (k - 1) v sum|g_i|
(each of the k - 1 additions rounds a partial sum no larger than sum|g_i|). DeepSpeed then all-reduces the sum in
its communication dtype (bf16 for a bf16 model, runtime/engine.py communication_data_type; even on one rank),
one more rounding of at most u |sum|, u = 2^-8. So fp32 accumulation (v = 2^-24) stays within
(k - 1) 2^-24 S + 2^-8 (|G| + (k - 1) 2^-24 S) per element (S = sum|g_i|, G the exact sum); bf16 accumulation
(v = 2^-8 for every one of the k - 1 additions) does not: where the micro-batches' gradients cancel, partial sums
much larger than |G| are rounded to 8 bits (tested: the same run with grad_accum_dtype=model).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.fixture_data import REPO
from test_train_runs import losses, run

from megamemo.model import MemTransformerLM
from megamemo.train.config import load

ACCUM, MICRO = 8, 2


def _accumulated_gradients(cfg, weights, batches):
    """-> (optimizer class, accumulation dtype, the gradient DeepSpeed's engine holds after ACCUM micro-batches
    before its optimizer step, the fp64 sum of the micro-batches' own bf16 gradients, the fp64 sum of their |.|).
    A micro-batch's own gradient is read by a hook on each parameter, before anything accumulates it."""
    from deepspeed.utils import safe_get_full_grad

    from megamemo.train.engine import Engine

    model = MemTransformerLM(cfg.model)
    model.load_state_dict(weights)
    eng = Engine(cfg, model, MICRO, 1)
    params = dict(eng.module.named_parameters())
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    size = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}

    def record(name):
        def hook(g):
            assert g.dtype == torch.bfloat16
            total[name] += g.double()
            size[name] += g.double().abs()

        return hook

    for n, p in params.items():
        p.register_hook(record(n))
    for x, y in batches:
        loss = eng.forward(x, y)[0].mean()
        eng.backward(loss)
        if not eng.ds.is_gradient_accumulation_boundary():
            eng.micro_step()
    opt = eng.ds.optimizer
    accum = getattr(opt, "grad_acc_dtype", None) or getattr(opt, "gradient_accumulation_dtype", None)
    # BF16_Optimizer: the fp32 buffer it steps with (safe_get_full_grad reads its bf16 staging copy); the ZeRO
    # optimizer: what it reduced at the boundary
    grads = {
        n: (p._hp_grad if getattr(p, "_hp_grad", None) is not None else safe_get_full_grad(p)).double().reshape(p.shape)
        for n, p in params.items()
    }
    return type(opt).__name__, accum, grads, total, size


def _worker(rank, world, out):
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    base = [
        "precision.dtype=bf16",
        "parallel.zero_stage=1",
        f"train.grad_accum={ACCUM}",
        "model.dropout=0.0",
        "optim.clip=0.0",
    ]
    cfg = load(REPO / "configs/tiny-cpu.yaml", base)
    torch.manual_seed(0)
    weights = MemTransformerLM(cfg.model).state_dict()
    gen = torch.Generator().manual_seed(1)
    L, V = cfg.model.tgt_len, cfg.model.n_token
    batches = [
        (torch.randint(0, V, (L, MICRO), generator=gen), torch.randint(0, V, (L, MICRO), generator=gen))
        for _ in range(ACCUM)
    ]
    res = {}
    for setting in ("auto", "model"):
        c = load(REPO / "configs/tiny-cpu.yaml", base + [f"precision.grad_accum_dtype={setting}"])
        res[setting] = _accumulated_gradients(c, weights, batches)
    torch.save(res, out)


def bound(exact, size):
    """fp32 accumulation of ACCUM terms, then one rounding to bf16 for the all-reduce (module docstring)."""
    summed = (ACCUM - 1) * 2.0**-24 * size
    return summed + 2.0**-8 * (exact.abs() + summed)


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_bf16_accumulates_in_fp32_and_model_dtype_does_not(tmp_path):
    out = tmp_path / "grads.pt"
    run_distributed(_worker, 1, str(out))
    res = torch.load(out)
    name, accum, got, want, size = res["auto"]
    assert (name, accum) == ("BF16_Optimizer", torch.float32)
    fp32_bound = {n: bound(want[n], size[n]) for n in want}
    for n in want:
        err = (got[n] - want[n]).abs()
        assert (err <= fp32_bound[n]).all(), f"{n}: fp32 accumulation off by {float(err.max()):.3g}"
    assert any(bool(size[n].gt(0).any()) for n in want)
    # the same run accumulating in bf16 breaks the fp32 bound: the test can fail
    name, accum, got, want, size = res["model"]
    assert accum == torch.bfloat16
    fp32_bound = {n: bound(want[n], size[n]) for n in want}
    worst = max(float(((got[n] - want[n]).abs() - fp32_bound[n]).max()) for n in want)
    assert worst > 0, "bf16 accumulation stayed within the fp32 bound"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_half_precision_config_accumulates_in_fp32(config):
    """... wherever it accumulates: bf16 on ZeRO 1 at grad_accum 1 (lamemo-7b) has one micro-batch a step and takes
    the model dtype, so that DeepSpeed runs its ZeRO optimizer (parallel/zero.py); at grad_accum 2 it is fp32."""
    from megamemo.train.engine import ds_config

    cfg = load(REPO / "configs" / config, [], vocab_fallback=32000)  # n_token auto: no data here
    got = ds_config(cfg, 1, 1).get("data_types", {}).get("grad_accum_dtype")
    p = cfg.precision
    one = p.dtype == "bf16" and cfg.parallel.zero_stage == 1 and cfg.train.grad_accum == 1 and cfg.parallel.pp == 1
    assert got == (None if p.dtype == "fp32" or one else "fp32"), (config, p.dtype, got)
    if one:
        more = load(
            REPO / "configs" / config,
            ["train.grad_accum=2", "parallel.overlap_comm=false", "parallel.reduce_bucket_size=null"],
            vocab_fallback=32000,
        )
        assert ds_config(more, 1, 1)["data_types"]["grad_accum_dtype"] == "fp32"


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_bf16_zero1_run_resumes_bit_exact(tiny_cfg, shards, tmp_path):
    """bf16 + ZeRO 1 now runs DeepSpeed's BF16_Optimizer (fp32 accumulation): a run stopped at step 2 and resumed
    repeats the uninterrupted one's steps 3-4 bit for bit (its fp32 masters, Adam state and accumulation buffers
    restored through train/resumable.py)."""
    args = [
        "--set",
        "precision.dtype=bf16",
        "--set",
        "parallel.zero_stage=1",
        "--set",
        "train.grad_accum=2",
        "--set",
        "checkpoint.probe=false",
        "--save-every",
        "2",
    ]
    run(1, tiny_cfg, shards, tmp_path / "whole", *args, "--max-steps", "4")
    run(1, tiny_cfg, shards, tmp_path / "split", *args, "--max-steps", "2")
    run(1, tiny_cfg, shards, tmp_path / "split", *args, "--max-steps", "4")
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert sorted(split) == sorted(whole) == [1, 2, 3, 4]
    assert all(split[s] == whole[s] for s in whole), (split, whole)
