"""`megamemo plan` counts against the built model, and its ZeRO / layout arithmetic."""
import dataclasses

from megamemo.config import load
from megamemo.model import MemTransformerLM
from megamemo.plan import GiB, plan


def test_parameter_bytes_match_the_built_model(tmp_path):
    cfg = load("configs/tiny-cpu.yaml", ["precision.dtype=fp32", "parallel.zero_stage=0"])
    for variant in ("lamemo", "xl"):
        cfg.model = dataclasses.replace(cfg.model, variant=variant)
        n = sum(p.numel() for p in MemTransformerLM(cfg.model).parameters())
        p = plan(cfg, world=1, gpu_gib=32)
        assert p.params == 4 * n and p.grads == 4 * n and p.optimizer == 8 * n


def test_zero_stages_divide_what_they_shard():
    base = load("configs/tiny-cpu.yaml", ["precision.dtype=bf16", "parallel.zero_stage=0"])
    p0 = plan(base, world=4, gpu_gib=32)
    base.parallel.zero_stage = 1
    p1 = plan(base, world=4, gpu_gib=32)
    base.parallel.zero_stage = 2
    p2 = plan(base, world=4, gpu_gib=32)
    assert p1.optimizer == p0.optimizer / 4 and p1.grads == p0.grads
    assert p2.grads == p0.grads / 4 and p2.params == p0.params
    assert p0.capacity == 32 * GiB
