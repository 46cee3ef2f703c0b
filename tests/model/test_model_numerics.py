"""Numbers of the model that need an independent statement: the adaptive input and softmax against the clustered
factorisation written out here (spec §3.4), and bf16 against fp32 within bounds derived from bf16's precision."""

import math

import pytest
import torch
from helpers.bounds import sum_bound, unit_roundoff
from test_model_properties import tiny

from megamemo.model import Memory
from megamemo.model.attention import EPS_INTERP, interpolate

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)


# ---- adaptive input and softmax --------------------------------------------------------------------------------
def clustered_log_probs(sd, h, bounds, div_val, tie_weight, tie_projs, d_model, d_embed):
    """Spec §3.4, naively, in float64, token by token, from the parameters by name. Cluster c (0 = the head's
    shortlist) holds tokens [bounds[c], bounds[c+1]); its width is d_embed / div_val^c (d_embed for div_val 1);
    its vectors are projected from d_model by h @ P_c where a projection exists (div_val > 1, or d_embed !=
    d_model). The head scores the shortlist and one column per tail cluster, in cluster order; a tail token's
    log-probability is its cluster column's head log-probability plus its log-probability within the cluster."""

    def g(k):
        return sd[k].double()

    n_clusters = len(bounds) - 1
    tie = list(tie_projs) + [tie_projs[-1]] * n_clusters

    def table(c):  # [rows of cluster c, width]
        if div_val == 1:
            full = g("word_emb.emb_layers.0.weight") if tie_weight else g("crit.out_weights.0")
            return full[bounds[c] : bounds[c + 1]]
        return g(f"word_emb.emb_layers.{c}.weight") if tie_weight else g(f"crit.out_weights.{c}")

    def proj(c):  # [d_model, width] or None
        if div_val == 1 and d_embed == d_model:
            return None
        if tie[c]:
            return g(f"word_emb.emb_projs.{0 if div_val == 1 else c}")
        return g(f"crit.out_projs.{c}")

    bias = g("crit.out_bias")
    out = torch.empty(h.shape[0], bounds[-1], dtype=torch.float64)
    for r in range(h.shape[0]):
        x = h[r].double()
        feats = [x if proj(c) is None else x @ proj(c) for c in range(n_clusters)]
        head_w = torch.cat([table(0)] + ([g("crit.cluster_weight")] if n_clusters > 1 else []))
        head_b = torch.cat([bias[: bounds[1]]] + ([g("crit.cluster_bias")] if n_clusters > 1 else []))
        head = [float(feats[0] @ head_w[j] + head_b[j]) for j in range(head_w.shape[0])]
        head_lse = math.log(sum(math.exp(v) for v in head))
        for t in range(bounds[1]):
            out[r, t] = head[t] - head_lse
        for c in range(1, n_clusters):
            lo, hi = bounds[c], bounds[c + 1]
            w = table(c)
            tail = [float(feats[c] @ w[t - lo] + bias[t]) for t in range(lo, hi)]
            tail_lse = math.log(sum(math.exp(v) for v in tail))
            for t in range(lo, hi):
                out[r, t] = (head[bounds[1] + c - 1] - head_lse) + (tail[t - lo] - tail_lse)
    return out


def adaptive_embedding(sd, x, bounds, div_val, d_model, d_embed):
    """The input side of §3.4: the token's row of its cluster's table, projected to d_model, times sqrt(d_model)."""
    out = []
    for t in x.reshape(-1).tolist():
        c = max(i for i in range(len(bounds) - 1) if bounds[i] <= t)
        if div_val == 1:
            e = sd["word_emb.emb_layers.0.weight"].double()[t]
            p = sd["word_emb.emb_projs.0"].double() if d_embed != d_model else None
        else:
            e = sd[f"word_emb.emb_layers.{c}.weight"].double()[t - bounds[c]]
            p = sd[f"word_emb.emb_projs.{c}"].double()
        out.append((e if p is None else p @ e) * math.sqrt(d_model))
    return torch.stack(out).view(*x.shape, d_model)


@pytest.mark.parametrize(
    "div_val,tie_weight,tie_projs,d_embed",
    [
        (1, True, [False], 8),  # one table of width 8, each cluster its own projection
        (1, True, [True], 8),  # ... every cluster's projection tied to the input's
        (2, True, [False, True, True], 16),  # widths 16/8/4: the tails' projections tied to the input's
        (2, False, [False, False, False], 16),  # untied tables and projections
        (1, False, [False], 16),  # d_embed = d_model: no projections at all
    ],
)
def test_adaptive_softmax_is_the_clustered_factorisation(div_val, tie_weight, tie_projs, d_embed):
    bounds = [0, 10, 30, 50]
    model = tiny(
        "xl",
        cutoffs=bounds[1:-1],
        div_val=div_val,
        tie_weight=tie_weight,
        tie_projs=tie_projs,
        d_embed=d_embed,
        init_std=0.3,
        proj_init_std=0.3,
    )
    with torch.no_grad():  # non-zero biases, so the cluster columns and the output bias all matter
        model.crit.out_bias.normal_(0, 0.5)
        model.crit.cluster_bias.normal_(0, 0.5)
    sd = model.state_dict()
    x = torch.randint(0, 50, (5, 3), generator=torch.Generator().manual_seed(1))
    y = torch.arange(15).view(5, 3) * 3 + 4  # targets in every cluster, cluster edges 10 and 30 included
    y[0, 0], y[1, 1] = 10, 30
    with torch.no_grad():
        logp, _ = model(x, None)
        nll, _ = model(x, y)
        hidden, _ = model.encode(x, Memory({}, batch_size=3))
        emb = model.word_emb(x)
    want = clustered_log_probs(sd, hidden.reshape(15, -1), bounds, div_val, tie_weight, tie_projs, 16, d_embed)
    # fp32 against the fp64 statement from the same hidden state (one computation's rounding: runs=1): the
    # projection (d_model terms), the table's product (d_embed), the head's and a cluster's log-softmax (at most
    # n_token terms together): (16 + d_embed + 50) u at max|log p| (tests/helpers/bounds.py); measured <= 1.8e-6 of
    # 2e-5..5e-5
    tol = sum_bound(16 + d_embed + 50, float(want.abs().max()), runs=1)
    assert torch.allclose(logp.double().reshape(15, 50), want, rtol=0, atol=tol), (
        (logp.reshape(15, 50) - want).abs().max(),
        tol,
    )
    assert torch.allclose(nll.double().reshape(-1), -want[torch.arange(15), y.reshape(-1)], rtol=0, atol=tol)
    # the input side: a projection of d_embed terms and the sqrt(d_model) scale, at max|emb|
    want_emb = adaptive_embedding(sd, x, bounds, div_val, 16, d_embed)
    tol_emb = sum_bound(d_embed + 1, float(want_emb.abs().max()), runs=1)
    assert torch.allclose(emb.double(), want_emb, rtol=0, atol=tol_emb)
    # the probabilities sum to 1: the log-probabilities' own error plus a 50-term logsumexp of values <= 1
    assert torch.allclose(logp.logsumexp(-1), torch.zeros(5, 3), rtol=0, atol=tol + sum_bound(50, 1.0, runs=1))


# ---- bf16 against fp32 -----------------------------------------------------------------------------------------
U = 2.0**-8  # bf16 keeps 8 significant bits: a rounding moves a value by at most U/2 of its magnitude


def test_bf16_interpolation_is_the_fp32_one_rounded_once():
    """The interpolation computes in fp32 (log-normalisers kept fp32, exponentials max-shifted) and rounds the
    merged context to bf16 once at the end: it is the fp32 result within one bf16 rounding (U/2 relative; U
    allowed) - also for log-normalisers of 1e4, where exp() overflows and bf16 could not even tell s and s + 1
    apart (its spacing there is 64)."""
    g = torch.Generator().manual_seed(2)
    c = torch.randn(3, 2, 4, 8, generator=g).bfloat16()
    a = torch.randn(3, 2, 4, 8, generator=g).bfloat16()
    for base in (0.0, 1e4):
        s_old = base + torch.randn(3, 2, 4, generator=g)
        s_new = s_old + torch.tensor([-1.0, 0.0, 1.0, 2.5])  # alpha from 0.73 to 0.08
        m16, l16 = interpolate(c, s_old, a, s_new)
        m32, l32 = interpolate(c.float(), s_old, a.float(), s_new)
        alpha = (1 / (1 + torch.exp(s_new.double() - s_old.double()))).unsqueeze(-1)
        exact = alpha * c.double() + (1 - alpha) * a.double()
        assert m16.dtype == torch.bfloat16 and l16.dtype == torch.float32
        # fp32 on bf16 inputs: s_old - max and s_new - max are exact (Sterbenz: within a factor 2), so alpha is off by
        # its exp, division and eps (4 u + 1e-6, relative); the merged value by that times |c - a| <= 2 max|c, a|,
        # plus 2 u of the lerp: 7.6e-6 here (measured 1.5e-6)
        u = unit_roundoff(torch.float32)
        big = float(torch.cat([c, a]).abs().max())
        tol = 2 * big * (4 * u + EPS_INTERP) + 2 * u * float(exact.abs().max())
        assert torch.allclose(m32.double(), exact, rtol=0, atol=tol)
        assert ((m16.double() - m32.double()).abs() <= U * m32.double().abs() + 1e-30).all(), base
        assert torch.equal(l16, l32)


def test_bf16_model_matches_fp32_within_bf16_precision():
    """A bf16 LaMemo run over 8 segments (memory full from the 3rd) against the fp32 model with the same weights
    (rounded to bf16 first, so only the arithmetic differs). Bound, derived: the NLL is logsumexp(logits) -
    logit_target, so a relative error d on the logits moves it by at most 2 d max|logit|. The logits get one
    bf16 rounding (U/2) on top of the error of the hidden state that reaches them, which is the last layer's
    few roundings (fc2, residual add, layer norm: U/2 each; post-LN rescales what earlier layers left, and the
    log-softmax runs in fp32): d <= 2U, and we allow twice that, d = 4U, so |dNLL| <= 8 U max|logit| per token.
    The memory's context rows (bf16) hold attention averages of unit-scale values: within 8 U of their scale.
    The log-normalisers stay fp32, and their only error is that of bf16 scores: within 8 U of the largest."""
    model = tiny("lamemo")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    low = tiny("lamemo")
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    data = torch.randint(0, 50, (41, 3), generator=torch.Generator().manual_seed(1))
    m32 = m16 = None
    worst = []
    with torch.no_grad():
        for s in range(8):
            x, y = data[5 * s : 5 * s + 5], data[5 * s + 1 : 5 * s + 6]
            hidden, _ = model.encode(x, m32 if m32 is not None else Memory({}, batch_size=3))
            max_logit = (hidden @ model.word_emb.emb_layers[0].weight.T + model.crit.out_bias).abs().max().item()
            n32, m32 = model(x, y, m32)
            n16, m16 = low(x, y, m16)
            bound = 8 * U * max_logit
            err = (n16.float() - n32).abs().max().item()
            assert n16.dtype == torch.float32 and err <= bound, (s, err, bound)
            worst.append(err / bound)
            for li in range(2):
                assert m16[f"lse.{li}"].dtype == torch.float32 and m16[f"ctx.{li}"].dtype == torch.bfloat16
                ctx32, ctx16 = m32[f"ctx.{li}"], m16[f"ctx.{li}"].float()
                assert ((ctx16 - ctx32).abs() <= 8 * U * ctx32.abs().max()).all(), (s, li)
                lse32, lse16 = m32[f"lse.{li}"], m16[f"lse.{li}"]
                assert ((lse16 - lse32).abs() <= 8 * U * lse32.abs().max()).all(), (s, li)
            # the emb FIFO is embedding rows times a scale: one bf16 rounding of the fp32 value (U/2; U allowed)
            assert torch.allclose(m16["emb"].float(), m32["emb"], rtol=U, atol=0)
    assert max(worst) > 0  # bf16 did round something: the comparison is not of two fp32 runs
