"""The model against the reference implementations' own outputs (tests/fixtures/reference): per-token NLL,
memories, and gradients of one training step, from the same weights."""

import subprocess
import sys

import pytest
import torch
from helpers.bounds import backward_bound, forward_bound, unit_roundoff
from helpers.fixture_data import reference_file
from helpers.kernel_paths import PATHS, on_path

from megamemo.interop.reference import convert_state_dict, import_reference
from megamemo.interop.score import load_reference_file

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)

FILES = ["lamemo_at3_tgt8_mem8", "txl_tgt8_mem8"]
# Tolerances: the reference ran in fp32 too, with its own kernels (another order of the same sums), on another CPU.
# Two orders of the forward pass's reductions at the compared value's size, once per segment the memory carried
# (tests/helpers/bounds.py); gradients: the backward's reductions and the sum over a segment's 8 x 2 tokens. They
# replace a
# flat 1e-5; the closest comparison is a weight after SGD, at 0.066 of its bound at both ISAs.
TOKENS = 16


def fwd_tol(model, ref, segments=1):
    return segments * forward_bound(model.cfg, float(ref.abs().max()) if ref.numel() else 0.0)


def grad_tol(model, ref, segments=1):
    return segments * backward_bound(model.cfg, float(ref.abs().max()) if ref.numel() else 0.0, TOKENS)


@pytest.fixture(params=FILES)
def golden(request):
    return load_reference_file(str(reference_file(request.param)))


@pytest.fixture(params=PATHS)
def path(request):
    """plain PyTorch or the CPU kernels (megamemo/kernels/): the reference's figures hold on both."""
    return request.param


def ref_memory_tensors(g, mems):
    """Reference memory list -> megamemo names (XL's cached final output is never read, so not kept)."""
    n_layer = g["config"]["n_layer"]
    if g["config"]["attn_type"] == 0:
        return {f"hid.{li}": mems[li] for li in range(n_layer)}
    out = {"emb": mems[0]}
    for li in range(n_layer):
        out[f"ctx.{li}"], out[f"lse.{li}"] = mems[1 + 2 * li], mems[2 + 2 * li]
    return out


def close(a, b, what, tol):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs diff {err:.3g} > {tol:.3g}"


def test_eval_nll_and_memory_over_segments(golden, path):
    model = on_path(import_reference(golden["config"], golden["state_dict"]), path).eval()
    mem = None
    with torch.no_grad():
        for k, (x, y) in enumerate(zip(golden["inputs"], golden["targets"], strict=True)):
            nll, mem = model(x, y, mem)
            close(nll, golden["nll"][k], f"segment {k} NLL", fwd_tol(model, golden["nll"][k], k + 1))
            ref = ref_memory_tensors(golden, golden["mems"][k])
            assert sorted(mem.tensors) == sorted(ref)
            for name, t in ref.items():
                close(mem[name], t, f"segment {k} memory {name}", fwd_tol(model, t, k + 1))
                if name.startswith("lse"):
                    assert mem[name].dtype == torch.float32


def megamemo_grads(golden, grads):
    """Reference {param name: grad} -> megamemo names, via the same importer as the weights."""
    g = {k: (v if v is not None else torch.zeros_like(golden["state_dict"][k])) for k, v in grads.items()}
    g["crit.out_layers.0.weight"] = g["word_emb.emb_layers.0.weight"]  # tied: listed once, summed over both uses
    for k, v in golden["state_dict"].items():  # buffers the importer expects and drops
        g.setdefault(k, v) if k.endswith("inv_freq") or k.endswith("logits_constant") else None
    return convert_state_dict(g, import_reference(golden["config"], golden["state_dict"]).cfg)


def check_grads(model, golden, ref_grads, what, segments=1):
    ref = megamemo_grads(golden, ref_grads)
    for name, p in model.named_parameters():
        if ref_grads.get(name, 0) is None:
            assert p.grad is None or p.grad.abs().max() == 0, f"{what}: {name} should get no gradient"
            continue
        close(p.grad, ref[name], f"{what}: grad of {name}", grad_tol(model, ref[name], segments))


def test_training_step_gradients(golden, path):
    t = golden["train"]
    model = on_path(import_reference(golden["config"], golden["state_dict"]), path).train()
    nll, mem = model(golden["inputs"][0], golden["targets"][0])
    close(nll, t["loss_seg0"], "train-mode segment 0 NLL", fwd_tol(model, t["loss_seg0"]))
    nll.mean().backward()
    check_grads(model, golden, t["grads_seg0"], "segment 0")
    if golden["config"]["attn_type"] != 0:
        assert model.r_r_bias_future.grad is None  # no memory -> no look-ahead at the first segment

    grads = {n: q.grad for n, q in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=t["sgd_lr"]).step()
    after = import_reference(golden["config"], t["state_dict_after_sgd"])
    for name, p in after.state_dict().items():
        # w - lr g: lr times the gradient's tolerance, plus the update's own 2 roundings of |w|
        g = grads.get(name)
        tol = (0.0 if g is None else t["sgd_lr"] * grad_tol(model, g)) + 2 * unit_roundoff() * float(p.abs().max())
        close(model.state_dict()[name], p, f"after SGD: {name}", tol)
    with torch.no_grad():
        want = t["nll_seg0_after_sgd_eval"]  # the weights' few-u difference adds one more forward's worth
        close(
            model.eval()(golden["inputs"][0], golden["targets"][0])[0],
            want,
            "segment 0 NLL after SGD",
            fwd_tol(model, want, 2),
        )

    model = on_path(import_reference(golden["config"], golden["state_dict"]), path).train()
    _, mem = model(golden["inputs"][0], golden["targets"][0])
    model.zero_grad()
    nll, _ = model(golden["inputs"][1], golden["targets"][1], mem)
    close(nll, t["train_nll_seg1"], "train-mode segment 1 NLL with memory", fwd_tol(model, t["train_nll_seg1"], 2))
    nll.mean().backward()
    check_grads(model, golden, t["grads_seg1_with_mem"], "segment 1 with memory", segments=2)


def test_reference_score_cli(tmp_path):
    src = reference_file("lamemo_at3_tgt8_mem8")
    out = tmp_path / "scores.pt"
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "reference-score", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = torch.load(out, weights_only=True)["nll"]
    src_file = torch.load(src, weights_only=True)
    ref = src_file["nll"]
    assert len(got) == len(ref) == 4
    model = import_reference(src_file["config"], src_file["state_dict"])
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        close(a, b, "reference-score NLL", fwd_tol(model, b, k + 1))


def test_reference_file_with_unknown_key_is_refused(tmp_path):
    g = torch.load(reference_file("txl_tgt8_mem8"), weights_only=True)
    g["surprise"] = torch.zeros(1)
    bad = tmp_path / "bad.pt"
    torch.save(g, bad)
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "reference-score", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "surprise" in r.stderr
    assert not (tmp_path / "o").exists()
