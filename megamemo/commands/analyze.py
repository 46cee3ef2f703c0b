"""`megamemo analyze`: what the memory does, as plots and numbers (megamemo/eval/analyze.py: attention weight by
distance, the memorizing coefficient).

    megamemo analyze --ckpt CKPT [--ckpt CKPT ...] --data DIR [--split valid] [--out DIR] [--segments N]
                     [--batch-size B] [--tgt-len N] [--mem-len N]
"""

from __future__ import annotations

import argparse

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo analyze", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt", repeat=True, help="checkpoint (repeatable: LaMemo and XL)")
    flags.add(p, "data", required=True)
    p.add_argument("--split", default="valid", help="the manifest's split to analyse")
    p.add_argument("--out", default="analysis", help="output directory")
    p.add_argument("--segments", type=int, default=50, help="segments to run (the first mem_len/tgt_len warm up)")
    p.add_argument("--batch-size", type=int, default=10, help="columns (streams)")
    p.add_argument("--tgt-len", type=int, help="default: the checkpoint's")
    flags.add(p, "mem-len", help="default: the checkpoint's")
    flags.add(p, "device")
    a = p.parse_args(argv)
    from megamemo.eval.analyze import analyze_checkpoints, write_analysis
    from megamemo.runtime.device import torch_device

    say = lambda line: print(line, flush=True)  # noqa: E731
    results = analyze_checkpoints(
        a.ckpt,
        a.data,
        a.split,
        segments=a.segments,
        batch_size=a.batch_size,
        tgt_len=a.tgt_len,
        mem_len=a.mem_len,
        device=torch_device(a.device),
        log=say,
    )
    write_analysis(results, a.out, a.split, a.batch_size, log=say)
    return 0
