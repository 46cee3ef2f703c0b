"""`megamemo eval`: bits per character or perplexity of checkpoints on a split, at any lengths, with TRAMS
(megamemo/eval/evaluate.py says how).

    megamemo eval --ckpt CKPT --data DIR|URL --split valid|test [--json OUT]
                  [--tgt-len N] [--mem-len N] [--clamp-len N] [--same-length | --no-same-length] [--batch-size B]
                  [--max-segments K] [--trams-topk K --trams-recent R [--trams-metric code|paper]]
                  [--mem-ratios 1,2,4,... [--ratio-base N] [--plot FILE.png] [--table FILE.tsv]] [--memory FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megamemo.commands import flags
from megamemo.model.trams import METRICS


def parse_args(argv):
    p = argparse.ArgumentParser(prog="megamemo eval", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt", repeat=True, help="single-device checkpoint dir, or a training run / checkpoint dir "
                                          "(repeatable)")
    flags.add(p, "data", required=True,
              help="shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of one (read "
                   "through the verified cache in $XDG_CACHE_HOME/megamemo/shards, default ~/.cache/...)")
    p.add_argument("--split", default="valid", help="valid | test (or any split of the manifest)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--tgt-len", type=int, help="segment length (default: the checkpoint's tgt_len)")
    flags.add(p, "mem-len", help="memory length (default: the checkpoint's mem_len); the TRAMS pool")
    p.add_argument("--clamp-len", type=int, help="clamp relative distances (default: the checkpoint's)")
    p.add_argument("--same-length", dest="same_length", action="store_true", default=None,
                   help="every query attends over the same number of keys (default: the checkpoint's same_length)")
    p.add_argument("--no-same-length", dest="same_length", action="store_false", default=None,
                   help="queries attend over all keys before them (default: the checkpoint's same_length)")
    p.add_argument("--batch-size", type=int, default=10, help="columns (streams); default 10 as in the XL scripts")
    p.add_argument("--max-segments", type=int, default=0, help="stop after K segments (0: the whole split)")
    p.add_argument("--trams-topk", type=int, help="TRAMS: older memory rows selected per layer/head/stream")
    p.add_argument("--trams-recent", type=int, default=0, help="TRAMS: newest memory rows always attended")
    p.add_argument("--trams-metric", choices=METRICS, default="code",
                   help="code: ||K'||*|sum K'| (reference code); paper: cos<K',1>*||K'||")
    p.add_argument("--mem-ratios", help="extrapolation sweep: comma-separated mem_len / ratio-base ratios")
    p.add_argument("--ratio-base", type=int, help="base of --mem-ratios (default: the checkpoint's mem_len)")
    p.add_argument("--plot", default="mem_sweep.png", help="sweep plot (PNG)")
    p.add_argument("--table", help="sweep table (TSV; default: the plot's name with .tsv)")
    p.add_argument("--memory", help="start every column from this memory (memory.safetensors of `megamemo convert "
                                    "to-single --memory`, or its directory; its streams must be --batch-size)")
    flags.add(p, "device")
    p.add_argument("--attention", choices=("auto", "eager", "flex", "fused"), default="auto",
                   help="attention form: auto (flex on CUDA, eager on the CPU), eager, flex (FlexAttention), fused "
                        "(the Triton kernels; on the CPU only in Triton's interpreter, TRITON_INTERPRET=1)")
    flags.add(p, "dtype", extra_choices=("checkpoint",), default="checkpoint",
              help="run the model in this dtype (default: as stored)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from megamemo.checkpoint.single import SingleCheckpointError
    from megamemo.data import ManifestError, ShardError
    from megamemo.eval.evaluate import Request, evaluate_checkpoints, write_sweep
    from megamemo.runtime.device import torch_device

    a = parse_args(argv)
    try:
        ratios = [float(x) for x in a.mem_ratios.split(",")] if a.mem_ratios else None
        request = Request(data=a.data, split=a.split, batch_size=a.batch_size, max_segments=a.max_segments,
                          tgt_len=a.tgt_len, mem_len=a.mem_len, clamp_len=a.clamp_len, same_length=a.same_length,
                          trams_topk=a.trams_topk, trams_recent=a.trams_recent, trams_metric=a.trams_metric,
                          mem_ratios=ratios, ratio_base=a.ratio_base, memory=a.memory,
                          device=torch_device(a.device), dtype=a.dtype, attention=a.attention)
        results = evaluate_checkpoints(a.ckpt, request, log=lambda line: print(line, flush=True))
    except (ValueError, OSError, ManifestError, ShardError, SingleCheckpointError) as e:
        print(f"megamemo eval: error: {e}", file=sys.stderr)
        return 2
    if ratios is not None:
        write_sweep(results, Path(a.plot), a.table, log=lambda line: print(line, flush=True))
    if a.json:
        doc = results[0] if len(results) == 1 else {"results": results}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
