"""`megamemo analyze`: the recorded attention is the model's attention (checked by hand for one XL layer), alpha
is the weight of the cached context (checked through the model's own log-normaliser caches), and the command
writes the plots and numbers."""

import json
import math

import pytest
import torch
from helpers.bounds import sum_bound, unit_roundoff
from helpers.eval_fixtures import one_thread, tiny_checkpoint  # noqa: F401 (autouse fixture)
from helpers.shards import enwik8_slice_shards

from megamemo import cli
from megamemo.commands import analyze as analyze_cmd
from megamemo.eval import analyze
from megamemo.model.attention import EPS_INTERP
from megamemo.model.positions import sinusoid


def segments(n, B=3, L=6, seed=0):
    data = torch.randint(0, 256, (n * L + 1, B), generator=torch.Generator().manual_seed(seed))
    return [(data[s * L : (s + 1) * L], data[s * L + 1 : (s + 1) * L + 1]) for s in range(n)]


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_attention_by_distance_is_the_models_attention(tmp_path):
    """One XL layer: scores written out from the spec's formula, softmax, averaged per distance by hand."""
    _, model = tiny_checkpoint(tmp_path / "ck", "xl", n_layer=1, tgt_len=6, mem_len=12)
    batches = segments(6)
    got = analyze.analyze(model, batches, tgt_len=6, mem_len=12, segments=6)
    L, M = 6, 12
    sums, cnts = torch.zeros(M + L, dtype=torch.float64), torch.zeros(M + L, dtype=torch.float64)
    mem, big = None, 0.0
    layer = model.layers[0]
    n, dh = 2, 16
    with torch.no_grad():
        for inp, tgt in batches:
            h0 = model.word_emb(inp)
            if mem is not None and mem.length == M:
                cat = torch.cat([mem["hid.0"], h0])  # [K, B, d]
                K = cat.size(0)
                w = layer.attn.qkv.weight
                q = (h0 @ w[: n * dh].T).view(L, -1, n, dh)
                k = (cat @ w[n * dh : 2 * n * dh].T).view(K, -1, n, dh)
                for i in range(L):
                    for j in range(M + i + 1):
                        d = M + i - j
                        r = (sinusoid(torch.tensor([float(d)]), model.cfg.d_model) @ layer.attn.r_net.weight.T).view(
                            n, dh
                        )
                        s = ((q[i] + model.r_w_bias) * k[j]).sum(-1) + ((q[i] + model.r_r_bias) * r).sum(-1)
                        if j == 0:
                            row = torch.empty(M + i + 1, *s.shape)
                        row[j] = s / math.sqrt(dh)
                    big = max(big, float(row.abs().max()))
                    p = torch.softmax(row, 0)  # [keys, B, n]
                    for j in range(M + i + 1):
                        sums[M + i - j] += p[j].sum()
                        cnts[M + i - j] += p[j].numel()
            _, mem = model(inp, tgt, mem)
    want = (sums / cnts).tolist()
    assert got["segments_recorded"] == 4
    # fp32 both, other orders: a score (at most `big`) from the projections' d_model terms and two dh-term dots is off
    # by sum_bound of those; a softmax weight by twice that relative, plus its normaliser's M + L terms; a mean of
    # positive weights keeps the relative bound (tests/helpers/bounds.py)
    rel = 2 * sum_bound(model.cfg.d_model + 2 * dh, big) + sum_bound(M + L, 1.0)
    assert got["attention_by_distance"]["layer_0"] == pytest.approx(want, rel=rel, abs=0)
    # every query's weights sum to one, so (mean weight x pairs) over distances = queries
    assert float(
        (torch.tensor(got["attention_by_distance"]["layer_0"], dtype=torch.float64) * cnts).sum()
    ) == pytest.approx(float(cnts[0]), rel=rel, abs=0)


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_alpha_is_the_weight_of_the_cached_context(tmp_path):
    """alpha = s_old / (s_old + s_new) with s = exp(log-normaliser); the merged cache holds log(s_old + s_new), so
    for memory rows that stay in the cache alpha = exp(S_old - S_merged) (up to the reference's epsilon)."""
    _, model = tiny_checkpoint(tmp_path / "ck", "lamemo", tgt_len=6, mem_len=12)
    batches = segments(5)
    got = analyze.analyze(model, batches, tgt_len=6, mem_len=12, segments=5)
    acc = torch.zeros(2, 6, dtype=torch.float64)
    mem, k, big = None, 0, 0.0
    with torch.no_grad():
        for inp, tgt in batches:
            _, new = model(inp, tgt, mem)
            big = max(big, max(float(new[f"lse.{li}"].abs().max()) for li in range(2)))
            if mem is not None and mem.length == 12:
                for li in range(2):  # rows 6..11 of the old memory are rows 0..5 of the new one
                    a = torch.exp(mem[f"lse.{li}"][6:].double() - new[f"lse.{li}"][:6].double())  # [6, B, n]
                    acc[li] += a.mean((1, 2))
                k += 1
            mem = new
    # the spec's eps (1e-6 relative), the merged log-normaliser's fp32 rounding (u |S|, twice: both exponents) and
    # alpha's exp and division (4 u)
    u = unit_roundoff()
    for li in range(2):
        rel = EPS_INTERP + 2 * u * big + 4 * u
        assert got["alpha"][f"layer_{li}"][6:] == pytest.approx((acc[li] / k).tolist(), rel=rel, abs=0)
        assert all(0.0 <= x <= 1.0 for x in got["alpha"][f"layer_{li}"])


def test_cli_writes_plots_and_json(tmp_path):
    data = enwik8_slice_shards(tmp_path / "shards")
    a, _ = tiny_checkpoint(tmp_path / "lamemo", "lamemo")
    b, _ = tiny_checkpoint(tmp_path / "xl", "xl")
    out = tmp_path / "an"
    assert (
        analyze_cmd.main(
            [
                "--ckpt",
                str(a),
                "--ckpt",
                str(b),
                "--data",
                str(data),
                "--segments",
                "6",
                "--batch-size",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    for f in ("attention_by_distance.png", "alpha.png"):
        assert (out / f).read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((out / "analysis.json").read_text())
    lam, xl = doc["models"]
    assert lam["variant"] == "lamemo" and "alpha" in lam and len(lam["alpha"]["layer_1"]) == 12
    assert xl["variant"] == "xl" and "alpha" not in xl
    assert len(xl["attention_by_distance"]["mean"]) == 24 and 0.0 < xl["memory_mass"]["layer_0"] < 1.0
    # the flags reach the analysis: 6 segments asked, the first mem_len / tgt_len = 12 / 12 of them warm up
    assert lam["segments_recorded"] == xl["segments_recorded"] == 6 - 1 and doc["batch_size"] == 4
    rpe, _ = tiny_checkpoint(tmp_path / "rpe", "rpe")
    assert (
        cli.run_command("analyze", analyze_cmd.main, ["--ckpt", str(rpe), "--data", str(data), "--out", str(out)]) == 2
    )
