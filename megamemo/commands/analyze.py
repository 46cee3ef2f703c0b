"""`megamemo analyze`: what the memory does, as plots and numbers (megamemo/eval/analyze.py: attention weight by
distance, the memorizing coefficient).

    megamemo analyze --ckpt CKPT [--ckpt CKPT ...] --data DIR [--split valid] [--out DIR] [--segments N]
                     [--batch-size B] [--tgt-len N] [--mem-len N]
"""

from __future__ import annotations

import argparse

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.eval.analyze import Request, analyze_checkpoints, write_analysis
    from megamemo.runtime.device import torch_device

    p = argparse.ArgumentParser(prog="megamemo analyze", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt", repeat=True, help="checkpoint (repeatable: LaMemo and XL)")
    p.add_argument("--out", default="analysis", help="output directory")
    flags.add_fields(p, Request, shared={"data": {}, "mem_len": {}, "device": {}})
    a = p.parse_args(argv)
    request = flags.request(a, Request, device=torch_device(a.device))
    say = lambda line: print(line, flush=True)  # noqa: E731
    results = analyze_checkpoints(a.ckpt, request, log=say)
    write_analysis(results, a.out, request.split, request.batch_size, log=say)
    return 0
