"""Initialising a parallel shard directly, without building the single-device model first.

Building the whole model on every rank and slicing it (what small runs do, so every layout starts from the same
weights) needs host memory for the full fp32 model per process: 28 GB per rank at 7 B parameters. At such sizes
each rank instead gives its own parameters the reference training scripts' distributions, by single-device name:
Linear and embedding weights, r_w_bias, r_r_bias and the cluster weight ~N(0, init_std); adaptive projections
~N(0, proj_init_std); LayerNorm weights ~N(1, init_std); biases 0; r_r_bias_future xavier-uniform over the full
[n_head, d_head] shape (or N(0, init_std)). Each parameter draws from its own generator, seeded by the run seed and
the parameter's name (and the TP rank where the parameter is split), so replicated parameters are identical on
every TP rank and a shard does not depend on which other parameters its stage holds. The draws are made on the
CPU (a parameter elsewhere is filled from a host copy), so a shard is the same on any device.
"""

from __future__ import annotations

import math
import zlib

import torch

from megamemo.model import MemTransformerLM

from .groups import tp_rank_size
from .tensor import _rule, mark_tensor_parallel, parallelize_tensor


def init_value(p: torch.Tensor, name: str, cfg, gen: torch.Generator) -> None:
    std, pstd = cfg.init_std, cfg.proj_init_std
    with torch.no_grad():
        if name.endswith("layer_norm.weight"):
            p.normal_(1.0, std, generator=gen)
        elif name.endswith(".bias") or name in ("crit.out_bias", "crit.cluster_bias"):
            p.zero_()
        elif name == "r_r_bias_future" and cfg.future_bias_init == "xavier":
            a = math.sqrt(6.0 / (cfg.n_head + cfg.d_head))
            p.uniform_(-a, a, generator=gen)
        elif "emb_projs" in name or "out_projs" in name:
            p.normal_(0.0, pstd, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)


def init_shard(module: torch.nn.Module, cfg, seed: int, single_name=lambda n: n) -> None:
    """Initialise every parameter of `module` (this rank's shard) by its single-device name."""
    tp_rank, _ = tp_rank_size()
    for name, p in module.named_parameters():
        single = single_name(name)
        split = _rule(single) is not None
        key = zlib.crc32(single.encode()) ^ (seed * 1000003) ^ ((tp_rank + 1) * 7919 if split else 0)
        gen = torch.Generator().manual_seed(key & 0x7FFFFFFF)
        if p.device.type == "cpu":
            init_value(p, single, cfg, gen)
        else:  # drawn on the CPU, as everywhere: the same values whatever the device
            host = torch.empty(p.shape, dtype=p.dtype)
            init_value(host, single, cfg, gen)
            with torch.no_grad():
                p.copy_(host)


def shard_model(cfg, seed: int):
    """This rank's tensor-parallel shard of MemTransformerLM(cfg), initialised directly: the single-device model
    is built on the meta device (no memory), made tensor-parallel, and only then given storage."""
    with torch.device("meta"):
        model = MemTransformerLM(cfg)
    model = parallelize_tensor(model, load=False).to_empty(device="cpu")
    mark_tensor_parallel(model)
    init_shard(model, cfg, seed)
    return model
