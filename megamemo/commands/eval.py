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
from pathlib import Path

from megamemo.commands import flags
from megamemo.kernels.apply import ATTENTIONS
from megamemo.model.trams import METRICS


def parse_args(argv):
    """The flags: --ckpt, the sweep's outputs and --json, then one per field of the library's Request (its type,
    default and help come from the field: megamemo/eval/evaluate.py)."""
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.eval.evaluate import Request

    p = argparse.ArgumentParser(prog="megamemo eval", description=__doc__.split("\n\n")[0])
    flags.add(
        p, "ckpt", repeat=True, help="single-device checkpoint dir, or a training run / checkpoint dir (repeatable)"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", default="mem_sweep.png", help="sweep plot (PNG)")
    p.add_argument("--table", help="sweep table (TSV; default: the plot's name with .tsv)")
    flags.add_fields(
        p,
        Request,
        shared={"data": {}, "mem_len": {}, "device": {}, "dtype": {"extra_choices": ("checkpoint",)}},
        trams_metric={"choices": METRICS},
        attention={"choices": ATTENTIONS},
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.eval.evaluate import Request, evaluate_checkpoints, write_sweep
    from megamemo.runtime.device import torch_device

    a = parse_args(argv)
    request = flags.request(a, Request, device=torch_device(a.device))
    results = evaluate_checkpoints(a.ckpt, request, log=lambda line: print(line, flush=True))
    if request.mem_ratios is not None:
        write_sweep(results, Path(a.plot), a.table, log=lambda line: print(line, flush=True))
    if a.json:
        doc = results[0] if len(results) == 1 else {"results": results}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
