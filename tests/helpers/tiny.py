"""Tiny models for the tests of the model's properties: a few thousand parameters, built in a fraction of a
second. One size (TINY) that a test changes by naming what it needs otherwise."""

from __future__ import annotations

import torch

from megamemo.model import MemTransformerLM, ModelConfig

TINY = dict(n_token=40, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0, tgt_len=4, mem_len=8)


def tiny_config(variant: str = "lamemo", **overrides) -> ModelConfig:
    """TINY for this variant, with the overrides (any ModelConfig field)."""
    return ModelConfig(**{**TINY, "variant": variant, **overrides})


def tiny_model(variant: str = "lamemo", seed: int = 0, **overrides) -> MemTransformerLM:
    """tiny_config's model, its weights drawn after torch.manual_seed(seed), in eval mode (`.train()` for the tests
    of dropout)."""
    torch.manual_seed(seed)
    return MemTransformerLM(tiny_config(variant, **overrides)).eval()
