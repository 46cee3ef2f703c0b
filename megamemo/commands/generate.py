"""`megamemo generate`: sample a continuation of a prompt, carrying the recurrent memory token by token
(megamemo/eval/generate.py, megamemo/model/generation.py).

    megamemo generate --ckpt CKPT --prompt-file F --max-new-tokens N [--top-p 0.95] [--temperature 1.0]
                      [--seed S] [--greedy] [--data SHARD_DIR] [--mem-len M] [--memory FILE] [--out FILE]
                      [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.eval.generate import Request, prepare
    from megamemo.kernels.apply import ATTENTIONS
    from megamemo.runtime.device import torch_device

    p = argparse.ArgumentParser(prog="megamemo generate", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt")
    p.add_argument("--out", help="write the continuation here instead of stdout")
    p.add_argument("--json", help="write prompt/new token ids and the text here")
    flags.add_fields(p, Request, shared={"data": {}, "mem_len": {}, "device": {}}, attention={"choices": ATTENTIONS})
    a = p.parse_args(argv)
    request = flags.request(a, Request, device=torch_device(a.device))
    job = prepare(a.ckpt, request)
    new, text = job.run(request, log=lambda m: print(m, file=sys.stderr, flush=True))
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "prompt_ids": job.prompt,
                    "new_ids": new,
                    "text": text,
                    "seed": a.seed,
                    "top_p": a.top_p,
                    "temperature": a.temperature,
                }
            )
            + "\n"
        )
    return 0
