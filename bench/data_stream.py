"""Data-pipeline throughput, measured side by side in one run:

  1. plain zstd decompression of every chunk of a split's shards (sequential tar read + decompress),
  2. StreamReader over the same split (B columns, tgt_len rows, int64 tensors), without and with prefetch,
  3. what a training step (fwd + bwd + Adam) of a small demo model consumes, fed by the reader.

    python bench/data_stream.py                       # prepares the enwik8 prefix from ../shared/data
    python bench/data_stream.py --data DIR --split train --batch 22 --tgt-len 512
"""
from __future__ import annotations

import argparse
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

REPO = Path(__file__).resolve().parents[1]


def plain_decompress(data_dir: Path, manifest: dict, split: str) -> int:
    dctx = zstandard.ZstdDecompressor()
    itemsize = np.dtype(manifest["dtype"]).itemsize
    n = 0
    for s in manifest["splits"][split]["shards"]:
        with tarfile.open(data_dir / s["name"]) as tf:
            for m in tf:
                if m.name.endswith(".tokens.zst"):
                    n += len(dctx.decompress(tf.extractfile(m).read())) // itemsize
    return n


def reader_epoch(data_dir: Path, split: str, batch: int, tgt_len: int, prefetch: int) -> int:
    from data_pipeline import StreamReader
    with StreamReader(data_dir, split, batch, tgt_len, prefetch=prefetch) as r:
        return sum(x.numel() for x, _ in r)


def best_rates(fns: dict, repeats: int, min_seconds: float = 2.0) -> dict:
    """Best tokens/s of each function, run round-robin (so all see the same machine load) for at least
    `repeats` rounds and `min_seconds`: the machine is shared, the best run is the least disturbed one."""
    best = {k: 0.0 for k in fns}
    rounds, start = 0, time.perf_counter()
    while rounds < repeats or time.perf_counter() - start < min_seconds:
        for k, fn in fns.items():
            t0 = time.perf_counter()
            n = fn()
            best[k] = max(best[k], n / (time.perf_counter() - t0))
        rounds += 1
    return best


def training_rate(data_dir: Path, split: str, batch: int, tgt_len: int, steps: int, n_token: int) -> tuple[float, str]:
    from data_pipeline import StreamReader
    from megamemo.model import MemTransformerLM, ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(variant="lamemo", n_token=n_token, n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128,
                      dropout=0.1, dropatt=0.0, tgt_len=tgt_len, mem_len=tgt_len)
    model = MemTransformerLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4)
    mem, n, t0 = None, 0, None
    with StreamReader(data_dir, split, batch, tgt_len, epochs=None) as r:
        for k, (inp, tgt) in enumerate(r):
            if k == 2:                       # two warm-up steps
                t0, n = time.perf_counter(), 0
            if k == steps + 2:
                break
            nll, mem = model(inp, tgt, mem)
            opt.zero_grad(set_to_none=True)
            nll.mean().backward()
            opt.step()
            n += inp.numel()
    desc = f"lamemo 2 layers d_model 64, B={batch} tgt_len={tgt_len} mem_len={tgt_len}"
    return n / (time.perf_counter() - t0), desc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="prepared shard directory (default: prepare the enwik8 prefix)")
    p.add_argument("--split", default="train")
    p.add_argument("--batch", type=int, default=22, help="columns (enwik8_base: 22)")
    p.add_argument("--tgt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--train-batch", type=int, default=None, help="batch for the training step (default --batch)")
    p.add_argument("--train-tgt-len", type=int, default=128, help="tgt_len = mem_len of the demo model")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the training step")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="megamemo_bench_") as tmp:
        run(a, Path(tmp))


def run(a, tmp: Path) -> None:

    from data_pipeline import build, corpora, load_manifest
    if a.data is None:
        data_dir = tmp
        raw = REPO.parent / "shared/data/enwik8/enwik8_prefix"
        build(corpora.enwik8(raw), data_dir, shard_bytes="1M", log=lambda m: None)
        print(f"prepared {raw} -> {data_dir} (chunks of 65536 tokens, ~1 MiB shards)")
    else:
        data_dir = Path(a.data)
    m = load_manifest(data_dir)
    sp = m["splits"][a.split]
    size = sum(s["bytes"] for s in sp["shards"])
    print(f"split {a.split}: {sp['n_tokens']:,} tokens ({m['dtype']}) in {len(sp['shards'])} shards, "
          f"{size / 2**20:.1f} MiB")

    assert plain_decompress(data_dir, m, a.split) == sp["n_tokens"]
    fns = {"plain": lambda: plain_decompress(data_dir, m, a.split)}
    for pf in (0, 2):
        fns[pf] = lambda pf=pf: reader_epoch(data_dir, a.split, a.batch, a.tgt_len, pf)
    rates = best_rates(fns, a.repeats)
    plain = rates.pop("plain")
    print(f"{'plain zstd decompression':<44} {plain / 1e6:10.1f} M tokens/s")
    for pf, r in rates.items():
        print(f"{f'StreamReader B={a.batch} L={a.tgt_len} prefetch={pf}':<44} {r / 1e6:10.1f} M tokens/s   "
              f"plain/reader = {plain / r:.2f}x")
    if a.train_steps <= 0:
        return
    try:
        tb, tl = a.train_batch or a.batch, a.train_tgt_len
        train, desc = training_rate(data_dir, a.split, tb, tl, a.train_steps, m["vocab"]["size"])
    except ImportError as e:
        print(f"training step: megamemo.model not available ({e})")
    else:
        best = max(rates.values())
        print(f"{'training step (fwd+bwd+Adam)':<44} {train / 1e6:10.4f} M tokens/s   ({desc}, "
              f"{a.threads} thread(s))")
        print(f"reader / training consumption = {best / train:,.0f}x")


if __name__ == "__main__":
    main()
