"""Tensor parallelism (megatron-core layers, 2 gloo ranks) against the single-device model: the same per-step
losses over several SGD steps with memory carried, the same memory once reassembled from the heads' shards,
the same weights once merged; and dropout streams that differ across TP ranks but replay exactly."""
import copy

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from kernel_paths import PARALLEL_PATH, on_path
from megamemo.model import ModelConfig

STEPS, L, B = 4, 6, 2


def _train(model, data, tp_model=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.3)  # Adam would turn rounding noise in ~0 grads into lr-size steps
    mem, losses = None, []
    for s in range(STEPS):
        x, y = data[s * L:(s + 1) * L], data[s * L + 1:(s + 1) * L + 1]
        nll, mem = model(x, y, mem)
        loss = nll.mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, mem


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _tp_worker(rank, world):
    from megamemo.model import MemTransformerLM
    from megamemo.parallel.groups import dropout_seeds, init_model_parallel, install_tp_stream, rng_tracker
    from megamemo.parallel.tensor import merge_tensors, parallelize_tensor

    init_model_parallel(tp=world)
    install_tp_stream(dropout_seeds(1234, 0, rank, 0)[1])      # this rank's TP dropout stream
    for variant in ("lamemo", "xl"):
        torch.manual_seed(0)
        cfg = ModelConfig(variant=variant, n_token=40, n_layer=2, d_model=16, n_head=4, d_head=4, d_inner=32,
                          dropout=0.0, tgt_len=L, mem_len=2 * L, init_std=0.1)
        single = on_path(MemTransformerLM(cfg), PARALLEL_PATH).train()
        model = parallelize_tensor(copy.deepcopy(single)).train()
        on_path(model, PARALLEL_PATH)          # (ForkedDropout kept the path's dropout inside)
        data = torch.randint(0, 40, (STEPS * L + 1, B), generator=torch.Generator().manual_seed(7))
        ref_losses, ref_mem = _train(single, data)
        tp_losses, tp_mem = _train(model, data)
        assert max(abs(a - b) for a, b in zip(ref_losses, tp_losses)) < 1e-5, (variant, ref_losses, tp_losses)
        # LaMemo's look-ahead caches (ctx.N, lse.N) are [rows, batch, heads, ...] split by heads across the TP
        # ranks; the layer inputs are replicated
        merged = {k: torch.cat(_gather(t), 2) if k.startswith(("ctx.", "lse.")) else t
                  for k, t in tp_mem.tensors.items()}
        for k, t in ref_mem.tensors.items():
            assert torch.allclose(merged[k], t, atol=1e-5), (variant, k, (merged[k] - t).abs().max(), t.abs().max())
        if variant == "lamemo":
            assert tp_mem["ctx.0"].shape[2] == cfg.n_head // world  # caches live with their heads
        sd = model.state_dict()
        for k, v in single.state_dict().items():
            assert torch.allclose(merge_tensors(k, _gather(sd[k])), v, atol=1e-5), (variant, k)

    # a shard initialised directly (no full model): replicated parameters equal on both ranks, split ones not,
    # with the reference distributions
    from megamemo.parallel.shard_init import shard_model
    big = ModelConfig(variant="lamemo", n_token=40, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128,
                      tgt_len=L, mem_len=L, init_std=0.02)
    shard = shard_model(big, seed=5)
    sd = shard.state_dict()
    assert all(not p.is_meta for p in shard.parameters()) and shard.layers[0].attn.n_head == 2
    ln = _gather(sd["layers.1.ff.layer_norm.weight"])
    assert torch.equal(ln[0], ln[1]) and abs(ln[0].mean().item() - 1.0) < 0.01
    qkv = _gather(sd["layers.0.attn.qkv.weight"])
    assert not torch.equal(qkv[0], qkv[1]) and abs(qkv[0].std().item() - 0.02) < 0.002
    assert torch.equal(sd["layers.0.ff.fc1.bias"], torch.zeros_like(sd["layers.0.ff.fc1.bias"]))
    x = torch.randint(0, 40, (L + 1, B), generator=torch.Generator().manual_seed(2))
    nll, _ = shard(x[:-1], x[1:])          # untrained, small init: about ln(40) per token
    assert torch.isfinite(nll).all() and abs(nll.mean().item() - torch.log(torch.tensor(40.0)).item()) < 0.5, nll

    # dropout inside TP regions, torch's and the CPU kernel's: a different mask per rank, the same on replay,
    # default stream untouched
    from megamemo.kernels.dropout import CpuDropout
    from megamemo.parallel.tensor import ForkedDropout
    for inner in (torch.nn.Dropout(0.5), CpuDropout(0.5)):
        drop = ForkedDropout(inner).train()
        state = rng_tracker().get_states()
        default = torch.get_rng_state()
        m1 = drop(torch.ones(64))
        assert torch.equal(torch.get_rng_state(), default)
        rng_tracker().set_states(state)
        assert torch.equal(drop(torch.ones(64)), m1)
        masks = _gather(m1)
        assert not torch.equal(masks[0], masks[1]), inner


@pytest.mark.multiproc
def test_tensor_parallel_equals_single_device():
    """On the kernels path MEGAMEMO_TEST_KERNELS (plain unless set; tests/kernel_paths.py)."""
    pytest.importorskip("megatron.core")
    run_distributed(_tp_worker, 2)


def test_tensor_parallel_refuses_what_it_cannot_split():
    from megamemo.parallel.tensor import check_supported
    with pytest.raises(ValueError, match="model.n_head=3 is not divisible by tp=2"):
        check_supported(ModelConfig(n_head=3, n_token=40), 2)
    with pytest.raises(ValueError, match="adaptive input/softmax"):
        check_supported(ModelConfig(n_token=40, cutoffs=[10]), 2)
