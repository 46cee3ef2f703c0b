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
    p = argparse.ArgumentParser(prog="megamemo generate", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt")
    p.add_argument("--prompt-file", required=True, help="UTF-8 text the generation continues")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate after the prompt")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling: sample among the most likely tokens holding this much probability")
    p.add_argument("--temperature", type=float, default=1.0, help="divides the logits before sampling")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (the same seed, the same text)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (no sampling)")
    flags.add(p, "data", help="shard directory whose vocabulary to use (default: the checkpoint's)")
    flags.add(p, "mem-len", help="memory length (default: mem_len + tgt_len - 1)")
    p.add_argument("--memory", help="start from this stream's memory (memory.safetensors of `megamemo convert "
                                    "to-single --memory COLUMN`, or its directory)")
    p.add_argument("--out", help="write the continuation here instead of stdout")
    p.add_argument("--json", help="write prompt/new token ids and the text here")
    flags.add(p, "device")
    p.add_argument("--attention", choices=("auto", "eager", "flex", "fused"), default="auto",
                   help="attention form: auto (eager: one query a step), eager, flex (FlexAttention), fused (the "
                        "Triton kernels; on the CPU only in Triton's interpreter, TRITON_INTERPRET=1)")
    a = p.parse_args(argv)
    from megamemo.eval.generate import prepare
    from megamemo.runtime.device import torch_device

    job = prepare(a.ckpt, a.prompt_file, max_new_tokens=a.max_new_tokens, top_p=a.top_p,
                  temperature=a.temperature, data=a.data, mem_len=a.mem_len, memory=a.memory,
                  device=torch_device(a.device), attention=a.attention)
    new, text = job.run(a.max_new_tokens, top_p=a.top_p, temperature=a.temperature, seed=a.seed, greedy=a.greedy,
                        mem_len=a.mem_len, log=lambda m: print(m, file=sys.stderr, flush=True))
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt_ids": job.prompt, "new_ids": new, "text": text, "seed": a.seed,
                                            "top_p": a.top_p, "temperature": a.temperature}) + "\n")
    return 0
