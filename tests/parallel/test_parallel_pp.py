"""Pipeline parallelism (DeepSpeed PipelineModule, 2 stages) against the single-device model: the same per-step
losses with memory carried per micro-batch, the same memory once the stages' banks are put together, and
memory that advances once per step even when a forward is replayed (a skipped step's retry, recomputation)."""

import importlib

import pytest
import torch
import torch.distributed as dist
from helpers.bounds import backward_bound, drift_bound, weight_drift
from helpers.distributed import run_distributed
from helpers.kernel_paths import PARALLEL_PATH, on_path

from megamemo.model import MemTransformerLM, ModelConfig

STEPS, L, B, GAS = 4, 6, 2, 2


def _reference(single, data, lr, moved):
    opt = torch.optim.SGD(single.parameters(), lr=lr)
    mems, losses = [None] * GAS, []
    for s in range(STEPS):
        total = 0.0
        for mb in range(GAS):
            cols = slice(mb * B, (mb + 1) * B)
            x, y = data[s * L : (s + 1) * L, cols], data[s * L + 1 : (s + 1) * L + 1, cols]
            nll, mems[mb] = single(x, y, mems[mb])
            (nll.mean() / GAS).backward()
            total += nll.mean().item() / GAS
        for n, p in single.named_parameters():  # the updates' sizes, summed: lr max|g| per parameter
            moved[n] = moved.get(n, 0.0) + (0.0 if p.grad is None else lr * float(p.grad.abs().max()))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, mems


def _pp_worker(rank, world, variants):
    """Every variant in one launch of the ranks (each start-up imports torch, DeepSpeed and megatron-core)."""
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for variant in variants:
        _check_variant(world, variant)


def _check_variant(world, variant):
    import deepspeed

    from megamemo.parallel.pipeline import build_pipeline, load_single_state, single_to_stage_names

    torch.manual_seed(0)
    cfg = ModelConfig(
        variant=variant,
        n_token=40,
        n_layer=4,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        tgt_len=L,
        mem_len=2 * L,
        init_std=0.1,
    )
    single = on_path(MemTransformerLM(cfg), PARALLEL_PATH).train()
    module, ctx = build_pipeline(cfg, pp=world)
    on_path(module, PARALLEL_PATH)
    load_single_state(cfg, module, single.state_dict())
    lr = 0.3
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=lr),
        config={
            "train_micro_batch_size_per_gpu": B,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    data = torch.randint(0, 40, ((STEPS + 1) * L + 1, GAS * B), generator=torch.Generator().manual_seed(3))

    def segment(s):
        return [
            (
                (data[s * L : (s + 1) * L, mb * B : (mb + 1) * B], torch.tensor([mb, 0, 0])),
                data[s * L + 1 : (s + 1) * L + 1, mb * B : (mb + 1) * B],
            )
            for mb in range(GAS)
        ]

    def gathered():
        banks = [None] * world
        dist.all_gather_object(
            banks, {f"mb{mb}/{name}": t.clone() for mb, d in ctx.bank.current.items() for name, t in d.items()}
        )
        return {k: v for b in banks for k, v in b.items()}

    losses = []
    for s in range(STEPS):
        losses.append(float(engine.train_batch(iter(segment(s)))))
        ctx.bank.commit()
    moved = {}
    ref_losses, ref_mems = _reference(single, data, lr, moved)
    # the stages' gradient sums (accumulated over GAS micro-batches, reduced and applied by DeepSpeed) run in other
    # orders, so after SGD steps the weights differ by rounding: their largest relative drift rho
    # (tests/helpers/bounds.py,
    # from every stage's weights) bounds what follows from them: (n_layer + 1) rho |value| plus two orders of the
    # forward pass (drift_bound); rho itself within the backward's relative rounding (backward_bound at scale 1)
    # times the updates' summed relative sizes (moved), x2 for earlier drift fed back through the gradients
    # (measured: rho 2.8e-7 against 7.9e-4)
    stage_sd = module.state_dict()
    own = {k: stage_sd[n].detach().clone() for k, n in single_to_stage_names(cfg, module).items()}
    parts = [None] * world
    dist.all_gather_object(parts, own)
    merged_sd = {k: v for part in parts for k, v in part.items()}
    rho = weight_drift(single.state_dict(), merged_sd)
    steps_moved = max(m / max(float(single.get_parameter(n).abs().max()), 1e-30) for n, m in moved.items())
    rho_bound = 2 * steps_moved * backward_bound(cfg, 1.0, GAS * B * L)
    assert rho <= rho_bound, (variant, rho, rho_bound)
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= drift_bound(cfg, rho, abs(b)), (variant, rho, losses, ref_losses)

    merged = gathered()
    for mb in range(GAS):
        for name, t in ref_mems[mb].tensors.items():
            tol = drift_bound(cfg, rho, float(t.abs().max()))
            assert torch.allclose(merged[f"mb{mb}/{name}"], t, rtol=0, atol=tol), (variant, mb, name)

    # Replayed forwards. With the learning rate at 0 every forward of the next segment sees the same weights (the
    # single model's), as the retry of a skipped fp16 step or a recomputed forward does; the memory one advance
    # gives is the single model's next memory.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    want = {}
    with torch.no_grad():
        for mb, ((x, _), y) in enumerate(segment(STEPS)):
            want.update({f"mb{mb}/{k}": t for k, t in single(x, y, ref_mems[mb])[1].tensors.items()})
    # a step that is not applied (discard) leaves the memory as it was, even after a later commit
    before = gathered()
    engine.train_batch(iter(segment(STEPS)))
    ctx.bank.discard()
    ctx.bank.commit()
    after = gathered()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items()), variant
    # the same segment's forward run twice before the commit (a replay): the memory advances once
    engine.train_batch(iter(segment(STEPS)))
    engine.train_batch(iter(segment(STEPS)))
    ctx.bank.commit()
    after = gathered()
    assert after.keys() == want.keys()
    for k, t in want.items():
        assert not torch.equal(after[k], before[k]) or after[k].numel() == 0, (variant, k)
        tol = drift_bound(cfg, rho, float(t.abs().max()))  # the same weights' drift, one segment more
        assert torch.allclose(after[k], t, rtol=0, atol=tol), (variant, k, (after[k] - t).abs().max())


@pytest.mark.multiproc
@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_pipeline_parallel_equals_single_device():
    """LaMemo, then Transformer-XL, on the same two ranks, on the kernels path MEGAMEMO_TEST_KERNELS (plain unless
    set; tests/helpers/kernel_paths.py)."""
    run_distributed(_pp_worker, 2, ("lamemo", "xl"))


def test_stage_bounds_put_layers_evenly_and_keep_shared_biases_with_them():
    from megamemo.parallel.pipeline import stage_bounds

    # specs: embed, (relbias, layer) x 5, head, bias -> 13
    assert stage_bounds(5, 2, 13) == [0, 7, 13]  # layers 0-2 | 3-4
    assert stage_bounds(4, 4, 11) == [0, 3, 5, 7, 11]
