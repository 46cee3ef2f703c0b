"""megamemo/kernels/: the switch between the model's plain PyTorch path and the CPU kernels. (Each path's dropout
law: tests/model/test_model_properties.py; the golden and spec tests run on both paths:
tests/model/test_model_reference.py,
tests/model/test_model_spec.py.)"""

import os

import pytest
import torch
from helpers.bounds import backward_bound, sum_bound
from helpers.tiny import tiny_model
from torch import nn

from megamemo.config.run import ConfigError
from megamemo.kernels import apply_kernels, kernels_in_use, resolve_kernels
from megamemo.kernels.dropout import CpuDropout
from megamemo.kernels.masking import add_mask_bias
from megamemo.model.attention import mask_scores
from megamemo.model.layers import ReluDropout
from megamemo.train.config import from_dict


def tiny(variant="lamemo", dropout=0.0):
    return tiny_model(variant, dropout=dropout, dropatt=dropout, tgt_len=6, mem_len=6).train()


def test_auto_is_cpu_kernels_on_a_cpu_and_plain_pytorch_elsewhere():
    assert resolve_kernels("auto", "cpu") == "cpu" and resolve_kernels("auto", torch.device("cpu")) == "cpu"
    assert resolve_kernels("auto", "cuda") == "plain" and resolve_kernels("auto", torch.device("cuda", 1)) == "plain"
    assert resolve_kernels("plain", "cpu") == "plain" and resolve_kernels("plain", "cuda") == "plain"
    assert resolve_kernels("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match=r"^train.kernels: cpu kernels run on the CPU, this model runs on cuda"):
        resolve_kernels("cpu", "cuda:0")
    with pytest.raises(ValueError, match=r"^train.kernels: must be one of auto, plain, cpu \(got 'fast'\)"):
        resolve_kernels("fast", "cpu")


def test_the_switch_is_a_validated_config_field():
    assert from_dict({}).train.kernels == "auto"
    assert from_dict({"train": {"kernels": "plain"}}).train.kernels == "plain"
    with pytest.raises(ConfigError, match=r"^train.kernels: must be auto, plain or cpu \(got 'gpu'\)"):
        from_dict({"train": {"kernels": "gpu"}})
    with pytest.raises(ConfigError, match=r"^train.kernels: expected str"):
        from_dict({"train": {"kernels": 1}})


def test_the_model_is_built_plain_and_the_swap_goes_both_ways():
    """A new model holds torch's modules only; the CPU form swaps every dropout (the feed-forward's ReLU+dropout
    into CpuDropout(relu=True)) and every attention's masking, keeps p, train/eval mode and the state_dict, and
    swaps back."""
    model = tiny(dropout=0.2).train()
    model.layers[1].eval()
    keys = list(model.state_dict())
    drops = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert set(drops.values()) == {nn.Dropout, ReluDropout} and kernels_in_use(model) == "plain"
    assert all(m.masking is mask_scores for m in model.modules() if hasattr(m, "masking"))

    assert apply_kernels(model, "auto", "cpu") == "cpu" and kernels_in_use(model) == "cpu"
    cpu = {n: m for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert cpu.keys() == drops.keys() and all(type(m) is CpuDropout for m in cpu.values())
    assert all(m.relu == (drops[n] is ReluDropout) and m.p == 0.2 for n, m in cpu.items())
    assert all(m.training == (not n.startswith("layers.1.")) for n, m in cpu.items())
    assert all(m.masking is add_mask_bias for m in model.modules() if hasattr(m, "masking"))
    assert list(model.state_dict()) == keys

    assert apply_kernels(model, "plain", "cpu") == "plain"
    assert {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Dropout)} == drops
    assert kernels_in_use(model) == "plain" and not model.layers[1].ff.drop_inner.training


def test_wrapped_dropouts_are_swapped_inside_their_wrapper():
    """The tensor-parallel form wraps split dropouts (parallel/tensor.py ForkedDropout: module.inner); whatever
    wraps a dropout keeps its place and gets the path's dropout inside."""

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    model = tiny(dropout=0.1)
    model.layers[0].ff.drop_inner = Wrapper(model.layers[0].ff.drop_inner)
    apply_kernels(model, "cpu", "cpu")
    inner = model.layers[0].ff.drop_inner.inner
    assert type(inner) is CpuDropout and inner.relu
    apply_kernels(model, "plain", "cpu")
    assert type(model.layers[0].ff.drop_inner.inner) is ReluDropout


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_the_paths_agree_without_dropout(variant):
    """Without dropout the two paths compute the same NLL, memory and gradients over two segments. LaMemo's bit
    for bit (the mask's 0/-inf bias adds 0, or gives -inf where masked_fill writes -inf); XL's plain path runs
    scaled_dot_product_attention (another order of the same sums), within 1e-5 relative to the largest value."""
    model = tiny(variant).train()
    data = torch.randint(0, 40, (13, 3), generator=torch.Generator().manual_seed(1))
    out = {}
    for path in ("plain", "cpu"):
        apply_kernels(model, path, "cpu")
        model.zero_grad()
        mem, got = None, []
        for s in range(2):
            nll, mem = model(data[6 * s : 6 * s + 6], data[6 * s + 1 : 6 * s + 7], mem)
            nll.mean().backward()
            got += [nll.detach()] + [mem[k] for k in sorted(mem.tensors)]
        out[path] = got + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(out["plain"]) == len(out["cpu"]) > 2 * (1 + 2 * 2)
    for a, b in zip(out["plain"], out["cpu"], strict=True):
        if variant == "lamemo":
            assert torch.equal(a, b)
        else:  # fp32, two orders of the backward pass over 2 segments of 6 x 3 tokens (tests/helpers/bounds.py): the
            # loosest of the listed tensors' bounds (forward values, memory, gradients), at each one's size
            tol = 2 * backward_bound(model.cfg, float(b.abs().max()), tokens=18)
            assert (a - b).abs().max() <= tol, ((a - b).abs().max(), tol)


def test_cpu_dropout_leaves_the_cpu_to_torch():
    """A CpuDropout on a tensor off the CPU is F.dropout itself (here: a meta tensor keeps its shape, no CPU mask
    is drawn), so a model that moved device after the swap still runs."""
    x = torch.empty(4, 8, device="meta")
    state = torch.get_rng_state()
    assert CpuDropout(0.5).train()(x).shape == (4, 8)
    assert torch.equal(torch.get_rng_state(), state)


# ---- FlexAttention (kernels/flex.py) and the compiler switch (kernels/compiler.py) ------------------------------
@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("same_length", [False, True])
def test_flex_attention_forward_equals_the_eager_form_on_the_cpu(same_length):
    """Both of LaMemo's attentions through FlexAttention's CPU reference form (forward only: torch 2.13 has no CPU
    backward) against the eager functions that state the maths: the causal one over memory + segment (with
    same_length's window too) and the look-ahead one of the memory rows, context and log-normaliser."""
    from megamemo.kernels.flex import flex_causal_attention, flex_lookahead_attention
    from megamemo.model.attention import causal_attention, lookahead_attention
    from megamemo.model.positions import causal_mask, lookahead_mask

    g = torch.Generator().manual_seed(3)
    n, B, L, M, dh = 2, 3, 6, 5, 8
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, k, v, r = rnd(n, B, L, dh), rnd(n, B, M + L, dh), rnd(n, B, M + L, dh), rnd(n, M + L + 1, dh)
    u, vb = rnd(n, dh), rnd(n, dh)
    mask = causal_mask(L, M, 4 if same_length else M, same_length)
    want = causal_attention(q, k, v, r, u, vb, mask, 0.3, lse="value")
    got = flex_causal_attention(q, k, v, r, u, vb, mask, 0.3, lse="value")
    # fp32, two orders of a score's 2 dh terms (content and position), the normaliser's and the weighted values'
    # M + L terms each, at each output's size (context or log-normaliser); measured 9.5e-7 at both ISAs
    terms = 2 * dh + 2 * (M + L)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=sum_bound(terms, float(b.abs().max())))
    nk = 4  # look-ahead: the M memory rows over the next nk rows
    qm, kf, vf_, rf = rnd(n, B, M, dh), rnd(n, B, nk, dh), rnd(n, B, nk, dh), rnd(n, M + 1, dh)
    lmask = lookahead_mask(M, nk)
    want = lookahead_attention(qm, kf, vf_, rf, u, vb, lmask, 0.3, lse="value")
    got = flex_lookahead_attention(qm, kf, vf_, rf, u, vb, lmask, 0.3, lse="value")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=sum_bound(2 * dh + 2 * nk, float(b.abs().max())))


def test_the_compiler_switch_lifts_megamemos_own_dynamo_off_only(monkeypatch):
    """megamemo's command turns TorchDynamo off unless the user chose (cli.py); a run that compiles lifts megamemo's
    own setting, never the user's (one line naming it); train.compile auto compiles on CUDA only."""
    from megamemo.kernels.compiler import CompilerUnavailable, enable_compiler, resolve_compile

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setenv("MEGAMEMO_SET_TORCHDYNAMO_DISABLE", "1")
    enable_compiler()
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # the user's own
    with pytest.raises(CompilerUnavailable, match="TORCHDYNAMO_DISABLE=1 is set in the environment"):
        enable_compiler()
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    assert (
        resolve_compile("auto", "cuda"),
        resolve_compile("auto", "cpu"),
        resolve_compile("on", "cpu"),
        resolve_compile("off", "cuda"),
    ) == (True, False, True, False)
    with pytest.raises(ValueError, match="train.compile: must be one of auto, on, off"):
        resolve_compile("yes", "cpu")
