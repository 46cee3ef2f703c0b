"""Collective calls and bytes per training step (forward + backward) under tensor parallelism, counted on 2
gloo ranks, beside the analytic Megatron minimum: two all-reduces of the layer's activations per layer in the
forward pass (after the row-parallel attention output and FFN output) and two in the backward pass (into the
column-parallel inputs). LaMemo's activations per layer are its memory rows plus the current rows (it recomputes
the memory rows' states in every layer), so its minimum is klen·B·d, not L·B·d.

    python bench/comm.py [--variant lamemo xl] [--layers 4 --d-model 256 --tgt-len 128 --mem-len 128 --batch 8]
"""

from __future__ import annotations

import argparse
import copy
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamemo.runtime.dist import free_port

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "_reduce_scatter_base",
    "_all_gather_base",
]


def count_collectives():
    calls, nbytes = Counter(), Counter()
    originals = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def wrapped(*a, _fn=fn, _name=name, **k):
            t = a[0] if a and isinstance(a[0], torch.Tensor) else k.get("tensor", k.get("output_tensor"))
            calls[_name] += 1
            if isinstance(t, torch.Tensor):
                nbytes[_name] += t.numel() * t.element_size()
            return _fn(*a, **k)

        setattr(dist, name, wrapped)
    return calls, nbytes, originals


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megamemo.model import MemTransformerLM, ModelConfig
    from megamemo.parallel.groups import dropout_seeds, init_model_parallel, install_tp_stream
    from megamemo.parallel.tensor import parallelize_tensor

    init_model_parallel(tp=world)
    install_tp_stream(dropout_seeds(1, 0, rank, 0)[1])  # this rank's TP dropout stream
    rows = []
    for variant in args.variant:
        torch.manual_seed(0)
        cfg = ModelConfig(
            variant=variant,
            n_token=256,
            n_layer=args.layers,
            d_model=args.d_model,
            n_head=args.heads,
            d_head=args.d_model // args.heads,
            d_inner=4 * args.d_model,
            dropout=0.0,
            tgt_len=args.tgt_len,
            mem_len=args.mem_len,
        )
        model = parallelize_tensor(copy.deepcopy(MemTransformerLM(cfg))).train()
        x = torch.randint(0, 256, (args.tgt_len, args.batch))
        _, mem = model(x, x)  # fill the memory: measure a steady-state step
        calls, nbytes, originals = count_collectives()
        nll, _ = model(x, x, mem)
        nll.mean().backward()
        for name, fn in originals.items():
            setattr(dist, name, fn)
        L, B, d, M = args.tgt_len, args.batch, args.d_model, args.mem_len
        rows_per_layer = (L + M) if variant.startswith("lamemo") else L
        min_calls = 4 * cfg.n_layer
        min_bytes = 4 * cfg.n_layer * rows_per_layer * B * d * 4
        rows.append((variant, sum(calls.values()), sum(nbytes.values()), min_calls, min_bytes, dict(calls)))
    if rank == 0:
        print(
            f"TP={world}, {args.layers}L d_model {args.d_model}, tgt_len {args.tgt_len} mem_len {args.mem_len} "
            f"batch {args.batch}, fp32, one forward+backward"
        )
        print(f"{'variant':<9}{'calls':>7}{'MB':>10}{'min calls':>11}{'min MB':>9}{'bytes/min':>11}  by collective")
        for v, c, b, mc, mb, by in rows:
            print(f"{v:<9}{c:>7}{b / 1e6:>10.2f}{mc:>11}{mb / 1e6:>9.2f}{b / mb:>11.3f}  {by}")
        print(
            "(calls beyond the minimum: the vocab-parallel embedding and cross-entropy, and the position "
            "projection's backward; measured by wrapping torch.distributed's collectives)"
        )
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", nargs="+", default=["lamemo", "xl"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tgt-len", type=int, default=128)
    ap.add_argument("--mem-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    mp.start_processes(worker, args=(2, free_port(), args), nprocs=2, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
