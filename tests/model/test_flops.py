"""The analytic FLOP count (megamemo/model/flops.py) against torch's own count of a real forward+backward.

torch.utils.flop_counter.FlopCounterMode counts the matmuls (mm, addmm, bmm, ...) the real model runs, forward
and backward, on the step after the memory is full (training's steady state). It sees only products, which is
also all the analytic count counts. The two differ by design in two places, both small and both exactly known:

  1. r_net (the position projection) reads the sinusoid table, which needs no gradient: its backward is one
     product (the weight gradient), not the two the analytic 3x-the-forward rule charges. The analytic count is
     higher by n_layer * 2 * P * d_model * H (P = rows of the position table: klen for XL/RPE, klen + M for
     LaMemo's past and future distances).
  2. The position products are taken with one extra row of R (klen + 1 rows for the causal scores, M + 1 for
     the look-ahead: rel_shift reads a skewed diagonal, the extra row only ever meets masked keys). torch counts
     3 * 2 * (L or M) * H * B more per product than the analytic L x klen and M x M.

At these tiny sizes that leaves the analytic count 0.5-1.6% above torch's (r_net's backward does not scale with
the batch, so the gap shrinks as B grows): TOLERANCE below. With both corrections the counts agree exactly,
which checks every term (a term dropped or doubled moves the count by far more than rounding).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import tiny_config
from torch.utils.flop_counter import FlopCounterMode

from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.flops import flops_per_token, forward_flops, step_flops

TOLERANCE = 0.02  # analytic / torch - 1, from the two differences above (0.5-1.6% at these sizes)


def torch_count(cfg: ModelConfig, B: int, segments_before: int = 4) -> tuple[int, torch.Tensor]:
    """Matmul FLOPs torch counts in one training forward+backward with a full memory, and that step's targets."""
    torch.manual_seed(0)
    model = MemTransformerLM(cfg).train()
    mem = None
    gen = torch.Generator().manual_seed(1)
    for _ in range(segments_before):  # fill the memory (M may exceed L)
        x = torch.randint(0, cfg.n_token, (cfg.tgt_len + 1, B), generator=gen)
        with torch.no_grad():
            _, mem = model(x[:-1], x[1:], mem)
    assert cfg.variant == "rpe" or mem.length == cfg.mem_len
    x = torch.randint(0, cfg.n_token, (cfg.tgt_len + 1, B), generator=gen)
    with FlopCounterMode(display=False) as fc:
        nll, _ = model(x[:-1], x[1:], mem)
        nll.mean().backward()
    return fc.get_total_flops(), x[1:]


def known_differences(cfg: ModelConfig, B: int) -> int:
    """torch's count minus the analytic one, from the two differences in the module docstring."""
    L, H, d = cfg.tgt_len, cfg.n_head * cfg.d_head, cfg.d_model
    M = cfg.mem_len if cfg.has_memory else 0
    klen = L + M
    if not cfg.lamemo:
        return cfg.n_layer * (-2 * klen * d * H + 3 * 2 * L * H * B)
    lookahead = cfg.variant != "lamemo_no_lookahead"
    per_layer = -2 * (klen + M) * d * H + 3 * 2 * L * H * B + (3 * 2 * M * H * B if lookahead else 0)
    top_skips_lookahead = lookahead and M <= L  # the top layer's look-ahead is not run at all
    return cfg.n_layer * per_layer - (3 * 2 * M * H * B if top_skips_lookahead else 0)


def tiny(variant: str, L: int, M: int, **kw) -> ModelConfig:
    return tiny_config(
        variant,
        **{
            "n_token": 96,
            "n_layer": 3,
            "d_model": 32,
            "d_head": 16,
            "d_inner": 80,
            "dropout": 0.1,
            "tgt_len": L,
            "mem_len": M,
            **kw,
        },
    )


CASES = [
    ("lamemo", 12, 12, {}),  # M <= L: the top layer skips its memory rows' look-ahead
    ("lamemo", 8, 20, {}),  # M > L: the top layer's look-ahead runs (the new caches keep memory rows)
    ("lamemo_xlrpe", 12, 8, {}),
    ("lamemo_no_lookahead", 12, 12, {}),
    ("xl", 12, 20, {}),
    ("rpe", 12, 12, {}),
    ("lamemo", 12, 12, {"d_embed": 24}),  # projections between d_embed and d_model, both ends
    ("xl", 8, 8, {"d_embed": 48, "div_val": 1, "tie_projs": [True]}),
]


@pytest.mark.parametrize(
    "variant,L,M,kw", CASES, ids=[f"{c[0]}-L{c[1]}-M{c[2]}{'-emb' if c[3] else ''}" for c in CASES]
)
def test_analytic_count_matches_torch_flop_counter(variant, L, M, kw):
    cfg, B = tiny(variant, L, M, **kw), 3
    got, _ = torch_count(cfg, B)
    analytic = step_flops(cfg, B)
    assert analytic / got - 1 == pytest.approx(0.0, abs=TOLERANCE), (analytic, got)
    assert got == analytic + known_differences(cfg, B)  # every term accounted for


def test_adaptive_softmax_counts_the_head_only():
    """With cutoffs the tail clusters' products depend on which targets fall in them: the analytic count leaves
    them out (a lower bound). torch's count minus exactly those products (3 x 2 * n_i * d * |cluster i|) is it."""
    cfg, B = tiny("xl", 12, 12, n_token=200, cutoffs=[50, 120], tie_projs=[False]), 4
    got, tgt = torch_count(cfg, B)
    bounds = [0, 50, 120, 200]
    tails = sum(
        3 * 2 * int(((tgt >= lo) & (tgt < hi)).sum()) * cfg.d_model * (hi - lo)
        for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)
    )
    assert tails > 0
    assert got - tails == step_flops(cfg, B) + known_differences(cfg, B)


def test_per_token_and_defaults():
    cfg = tiny("lamemo", 16, 16)
    assert forward_flops(cfg, 4) == forward_flops(cfg, 4, 16, 16)
    assert step_flops(cfg, 4) == 3 * forward_flops(cfg, 4)
    assert flops_per_token(cfg, 4) == step_flops(cfg, 4) / (16 * 4)
    # RPE ignores any memory length; the ablation without look-ahead costs less than LaMemo
    rpe = tiny("rpe", 16, 16)
    assert forward_flops(rpe, 2, mem_len=64) == forward_flops(rpe, 2, mem_len=0)
    assert forward_flops(tiny("lamemo_no_lookahead", 16, 16), 2) < forward_flops(cfg, 2)


def test_bench_config_figures():
    """The figures bench/model_step.py printed before the count moved here (its GFLOP/step column at its default
    config: 4L, d 256, 4x64, d_inner 1024, vocab 256, B 8, L = M = 128), computed with the bench's own
    forward_flops as of commit d9526c0."""
    kw = dict(n_token=256, n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=128, mem_len=128)
    got = {v: round(step_flops(ModelConfig(variant=v, **kw), 8) / 1e9, 2) for v in ("lamemo", "xl", "rpe")}
    assert got == {"lamemo": 42.68, "xl": 28.19, "rpe": 22.35}
