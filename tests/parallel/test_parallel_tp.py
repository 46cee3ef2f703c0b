"""Tensor parallelism (megatron-core layers, 2 gloo ranks) against the single-device model: the same per-step
losses over several SGD steps with memory carried, the same memory once reassembled from the heads' shards,
the same weights once merged; and dropout streams that differ across TP ranks but replay exactly."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.bounds import backward_bound, drift_bound, weight_drift
from helpers.distributed import run_distributed
from helpers.kernel_paths import PARALLEL_PATH, on_path

from megamemo.model import ModelConfig

STEPS, L, B = 4, 6, 2


def _train(model, data, tp_model=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.3)  # Adam would turn rounding noise in ~0 grads into lr-size steps
    mem, losses = None, []
    for s in range(STEPS):
        x, y = data[s * L : (s + 1) * L], data[s * L + 1 : (s + 1) * L + 1]
        nll, mem = model(x, y, mem)
        loss = nll.mean()
        loss.backward()
        moved = getattr(model, "moved", {})  # per parameter, the sum of the updates' sizes lr max|g|
        for n, p in model.named_parameters():
            moved[n] = moved.get(n, 0.0) + (0.0 if p.grad is None else 0.3 * float(p.grad.abs().max()))
        model.moved = moved
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, mem


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def merge_tensors(key, parts):
    """The single-device tensor `key` from its TP ranks' shards, each placed where global_box (the layout-free form
    checkpoints hold) puts it; a replicated tensor must be the same on every rank."""
    from megamemo.parallel.tensor import global_box

    tp = len(parts)
    shape = global_box(key, parts[0].shape, 0, tp)[0]
    out = torch.empty(shape, dtype=parts[0].dtype)
    for r, p in enumerate(parts):
        _, box, view = global_box(key, p.shape, r, tp)
        if box == tuple((0, n) for n in shape) and not torch.equal(p, parts[0]):
            raise ValueError(f"{key}: replicated tensor differs between tensor-parallel rank 0 and rank {r}")
        out[tuple(slice(a, b) for a, b in box)] = p.reshape(view)
    return out.reshape(-1, *parts[0].shape[1:]) if len(shape) > len(parts[0].shape) else out


def _tp_worker(rank, world):
    from megamemo.model import MemTransformerLM
    from megamemo.parallel.groups import dropout_seeds, init_model_parallel, install_tp_stream, rng_tracker
    from megamemo.parallel.tensor import parallelize_tensor

    init_model_parallel(tp=world)
    install_tp_stream(dropout_seeds(1234, 0, rank, 0)[1])  # this rank's TP dropout stream
    # the last: a padded vocabulary (40 symbols in 128 rows; rank 1's 64 rows are all padding, masked: the losses
    # are those of the single-device padded model, itself the unpadded one's - tests/train/test_vocab_padding.py)
    for variant, vocab in (("lamemo", {}), ("xl", {}), ("lamemo", dict(n_token=128, n_vocab=40))):
        torch.manual_seed(0)
        cfg = ModelConfig(
            variant=variant,
            **{"n_token": 40, **vocab},
            n_layer=2,
            d_model=16,
            n_head=4,
            d_head=4,
            d_inner=32,
            dropout=0.0,
            tgt_len=L,
            mem_len=2 * L,
            init_std=0.1,
        )
        single = on_path(MemTransformerLM(cfg), PARALLEL_PATH).train()
        model = parallelize_tensor(copy.deepcopy(single)).train()
        on_path(model, PARALLEL_PATH)  # (ForkedDropout kept the path's dropout inside)
        data = torch.randint(0, 40, (STEPS * L + 1, B), generator=torch.Generator().manual_seed(7))
        ref_losses, ref_mem = _train(single, data)
        tp_losses, tp_mem = _train(model, data)
        # the heads' split sums run in other orders, so after SGD steps the weights differ by rounding: the weights'
        # largest relative drift rho (tests/helpers/bounds.py) bounds what follows from them (drift_bound: (n_layer + 1)
        # rho |value| plus two orders of the forward pass), and itself stays at rounding's size: each update off
        # by the backward pass's relative rounding (backward_bound at scale 1), summed over the updates' relative
        # sizes (steps_moved), twice for earlier drift fed back through the gradients (measured: rho 3.7e-7,
        # 6.8e-4 of this; losses, memory and log-probabilities <= 0.006 of their bounds)
        sd = model.state_dict()
        merged_sd = {k: merge_tensors(k, _gather(sd[k])) for k in single.state_dict()}
        rho = weight_drift(single.state_dict(), merged_sd)
        steps_moved = max(m / max(float(single.get_parameter(n).abs().max()), 1e-30) for n, m in single.moved.items())
        rho_bound = 2 * steps_moved * backward_bound(cfg, 1.0, L * B)
        assert rho <= rho_bound, (variant, rho, rho_bound)
        for s, (a, b) in enumerate(zip(ref_losses, tp_losses, strict=True)):
            assert abs(a - b) <= drift_bound(cfg, rho, abs(a)), (variant, s, ref_losses, tp_losses, rho)
        # LaMemo's look-ahead caches (ctx.N, lse.N) are [rows, batch, heads, ...] split by heads across the TP
        # ranks; the layer inputs are replicated
        merged = {
            k: torch.cat(_gather(t), 2) if k.startswith(("ctx.", "lse.")) else t for k, t in tp_mem.tensors.items()
        }
        for k, t in ref_mem.tensors.items():
            tol = drift_bound(cfg, rho, float(t.abs().max()))
            assert torch.allclose(merged[k], t, rtol=0, atol=tol), (variant, k, (merged[k] - t).abs().max(), tol)
        if variant == "lamemo":
            assert tp_mem["ctx.0"].shape[2] == cfg.n_head // world  # caches live with their heads
        # without targets, the log-probabilities over the whole vocabulary (gathered from the ranks' rows; a padded
        # vocabulary's rows at -inf on both), on the CPU as on a GPU
        with torch.no_grad():
            ref_lp, _ = single.eval()(data[:L], None, ref_mem)
            tp_lp, _ = model.eval()(data[:L], None, tp_mem)
        single.train(), model.train()
        assert tp_lp.shape == ref_lp.shape == (L, B, cfg.n_token), (variant, tp_lp.shape)
        finite = ref_lp.isfinite()
        tol = drift_bound(cfg, rho, float(ref_lp[finite].abs().max()))
        assert torch.equal(tp_lp.isfinite(), finite), variant
        assert torch.allclose(tp_lp[finite], ref_lp[finite], rtol=0, atol=tol), (variant, (tp_lp - ref_lp).abs().max())

    # a shard initialised directly (no full model): replicated parameters equal on both ranks, split ones not,
    # with the reference distributions
    from megamemo.parallel.shard_init import shard_model

    big = ModelConfig(
        variant="lamemo",
        n_token=40,
        n_layer=2,
        d_model=64,
        n_head=4,
        d_head=16,
        d_inner=128,
        tgt_len=L,
        mem_len=L,
        init_std=0.02,
    )
    shard = shard_model(big, seed=5)
    sd = shard.state_dict()
    assert all(not p.is_meta for p in shard.parameters()) and shard.layers[0].attn.n_head == 2
    ln = _gather(sd["layers.1.ff.layer_norm.weight"])
    # the init's laws, not rounding: layer-norm weights N(1, 0.02): the mean of 64 within 0.01 (4 of its standard
    # deviations 0.0025); the shard's qkv std within 0.002 of 0.02 (the sample std of 6144 draws: sd 0.00018)
    assert torch.equal(ln[0], ln[1]) and abs(ln[0].mean().item() - 1.0) < 0.01
    qkv = _gather(sd["layers.0.attn.qkv.weight"])
    assert not torch.equal(qkv[0], qkv[1]) and abs(qkv[0].std().item() - 0.02) < 0.002
    assert torch.equal(sd["layers.0.ff.fc1.bias"], torch.zeros_like(sd["layers.0.ff.fc1.bias"]))
    x = torch.randint(0, 40, (L + 1, B), generator=torch.Generator().manual_seed(2))
    nll, _ = shard(x[:-1], x[1:])  # untrained, small init: about ln(40) per token
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
@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_tensor_parallel_equals_single_device():
    """On the kernels path MEGAMEMO_TEST_KERNELS (plain unless set; tests/helpers/kernel_paths.py)."""
    pytest.importorskip("megatron.core")
    run_distributed(_tp_worker, 2)


def test_tensor_parallel_refuses_what_it_cannot_split():
    from megamemo.parallel.tensor import check_supported

    with pytest.raises(ValueError, match="model.n_head=3 is not divisible by tp=2"):
        check_supported(ModelConfig(n_head=3, n_token=40), 2)
    with pytest.raises(ValueError, match="adaptive input/softmax"):
        check_supported(ModelConfig(n_token=40, cutoffs=[10]), 2)


# ---- r_net under TP: a local product, no collective -------------------------------------------------------------
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


class CountCollectives:
    """Counts the torch.distributed collectives called inside the block (megatron's layers and mappings call
    them through the torch.distributed module at call time, so patching its attributes sees every one)."""

    def __enter__(self):
        self.calls, self._saved = [], {n: getattr(dist, n) for n in COLLECTIVES}
        for name, fn in self._saved.items():

            def counted(*a, _name=name, _fn=fn, **k):
                self.calls.append(_name)
                return _fn(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _layer_step(model, layer, cat, M, ctx_old, lse_old, weight, cfg):
    """One layer's forward and backward on fixed inputs -> (collectives in forward, in backward, r_net's grad)."""
    from megamemo.model.positions import causal_mask, position_sequence, sinusoid

    L = cat.size(0) - M
    pos_emb = sinusoid(position_sequence(M + L, M, -1, cfg.future_positions), cfg.d_model)
    mask = causal_mask(L, M, cfg.mem_len, False)
    layer.zero_grad()
    cat = cat.clone().requires_grad_(True)  # the layer's input has a gradient, as in a model
    with CountCollectives() as fwd:
        if cfg.lamemo:
            vf = model.r_r_bias_future if cfg.future_bias else model.r_r_bias
            out = layer(cat, M, ctx_old, lse_old, pos_emb, model.r_w_bias, model.r_r_bias, vf, mask, cfg.mem_len)[0]
        else:
            out = layer(cat[M:], cat[:M], pos_emb, model.r_w_bias, model.r_r_bias, mask)
        loss = (out * weight[-out.size(0) :]).sum()
    with CountCollectives() as bwd:
        loss.backward()
    return fwd.calls, bwd.calls, layer.attn.r_net.weight.grad.clone()


def _rnet_worker(rank, world):
    from megamemo.model import MemTransformerLM
    from megamemo.parallel.groups import init_model_parallel
    from megamemo.parallel.tensor import HeadRows, _mcore_layers, parallelize_tensor

    init_model_parallel(tp=world)
    M, Lq, Bq = 5, 4, 2
    for variant in ("lamemo", "xl"):
        torch.manual_seed(0)
        cfg = ModelConfig(
            variant=variant,
            n_token=40,
            n_layer=1,
            d_model=16,
            n_head=4,
            d_head=4,
            d_inner=32,
            dropout=0.0,
            tgt_len=Lq,
            mem_len=M,
            init_std=0.1,
        )
        single = MemTransformerLM(cfg).train()
        model = parallelize_tensor(copy.deepcopy(single)).train()
        assert isinstance(model.layers[0].attn.r_net, HeadRows)
        g = torch.Generator().manual_seed(3)
        cat = torch.randn(M + Lq, Bq, cfg.d_model, generator=g)
        ctx_old = torch.randn(M, Bq, cfg.n_head, cfg.d_head, generator=g)
        lse_old = torch.randn(M, Bq, cfg.n_head, generator=g)
        weight = torch.randn(M + Lq, Bq, cfg.d_model, generator=g)
        heads = slice(rank * cfg.n_head // world, (rank + 1) * cfg.n_head // world)

        _, _, ref = _layer_step(single, single.layers[0], cat, M, ctx_old, lse_old, weight, cfg)
        fwd, bwd, grad = _layer_step(
            model, model.layers[0], cat, M, ctx_old[:, :, heads], lse_old[:, :, heads], weight, cfg
        )
        # by hand: forward o_net's and fc2's (row parallel) output all-reduces; backward the input-gradient
        # all-reduces of qkv and fc1 (column parallel). r_net: none.
        assert fwd == ["all_reduce"] * 2 and bwd == ["all_reduce"] * 2, (variant, fwd, bwd)
        # one layer's backward with the heads split: other orders of the same sums; the whole model's backward
        # bound over the (M + Lq) x Bq positions covers it (tests/helpers/bounds.py)
        g_tol = backward_bound(cfg, float(ref.abs().max()), tokens=(M + Lq) * Bq)
        assert torch.allclose(merge_tensors("layers.0.attn.r_net.weight", _gather(grad)), ref, rtol=0, atol=g_tol), (
            variant
        )

        # megatron's column layer in its place (what r_net was): the same gradient, one more all-reduce a backward
        Column = _mcore_layers(world, torch.float32)[0]
        a = model.layers[0].attn
        column = Column(cfg.d_model, cfg.n_head * cfg.d_head, False)
        with torch.no_grad():
            column.weight.copy_(a.r_net.weight)
        a.r_net = column
        fwd_old, bwd_old, grad_old = _layer_step(
            model, model.layers[0], cat, M, ctx_old[:, :, heads], lse_old[:, :, heads], weight, cfg
        )
        assert fwd_old == fwd and bwd_old == ["all_reduce"] * 3, (variant, fwd_old, bwd_old)
        assert torch.allclose(grad_old, grad, rtol=0, atol=g_tol), variant


@pytest.mark.multiproc
@pytest.mark.numerics
def test_r_net_is_a_local_product_without_collectives():
    """r_net under TP 2: no collective in one layer's forward and backward (4 all-reduces in all, not megatron's
    column layer's 5), and its gradient is TP 1's rows of the rank's heads."""
    pytest.importorskip("megatron.core")
    run_distributed(_rnet_worker, 2)


def test_r_net_under_tp_refuses_an_input_with_a_gradient():
    from megamemo.parallel.tensor import HeadRows

    r = HeadRows(8, 4, bias=False)
    assert torch.equal(r.weight, torch.zeros(4, 8))  # nothing drawn from the default stream
    r(torch.randn(3, 8))
    with pytest.raises(ValueError, match="no gradient"):
        r(torch.randn(3, 8, requires_grad=True))
