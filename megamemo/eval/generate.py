"""What `megamemo generate` does (megamemo/commands/generate.py): a continuation of a prompt file sampled from any
checkpoint, carrying the recurrent memory token by token (megamemo/model/generation.py: incremental decoding,
nucleus sampling, the memory length).

    megamemo generate --ckpt CKPT --prompt-file F --max-new-tokens N [--top-p 0.95] [--temperature 1.0]
                      [--seed S] [--greedy] [--data SHARD_DIR] [--mem-len M] [--memory FILE] [--out FILE]
                      [--json FILE]

The prompt is encoded with the checkpoint's vocabulary (config.json meta "vocab", recorded by `megamemo convert`)
or the shard directory's (--data, or the meta's data.dir; megamemo/interop/vocabulary.py): bytes/chars vocabularies
read the file's raw bytes, word vocabularies split lines on whitespace and close each finished line with <eos>.
--memory FILE starts from a saved memory instead of an empty one: one stream's, as `megamemo convert to-single
--memory COLUMN` writes it (memory.safetensors, or the converted directory), so the prompt continues that stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megamemo.eval.start_memory import load_start_memory
from megamemo.interop.load import open_model
from megamemo.interop.vocabulary import encode_prompt, vocab_for
from megamemo.model.generation import default_mem_len, generate, nucleus_probs
from megamemo.util.errors import UsageError


@dataclass
class Request:
    """What `megamemo generate` asks: each field is one of its flags (megamemo/commands/generate.py makes them from
    these fields, their comments the flags' help)."""

    prompt_file: str  # UTF-8 text the generation continues
    max_new_tokens: int = 200  # tokens to generate after the prompt
    top_p: float = 0.95  # nucleus sampling: sample among the most likely tokens holding this much
    # probability
    temperature: float = 1.0  # divides the logits before sampling
    seed: int = 0  # seed of the sampling (the same seed, the same text)
    greedy: bool = False  # always the most likely token (no sampling)
    data: str | None = None  # shard directory whose vocabulary to use (default: the checkpoint's)
    mem_len: int | None = None  # memory length (default: mem_len + tgt_len - 1)
    memory: str | None = None  # start from this stream's memory (memory.safetensors of `megamemo convert
    # to-single --memory COLUMN`, or its directory)
    device: str = "cpu"  # torch device: auto (the command resolves it: cuda when torch sees one, else
    # cpu), cpu, cuda, cuda:N
    attention: str = "auto"  # attention form: auto (eager: one query a step), eager, flex (FlexAttention),
    # fused (the Triton kernels; on the CPU only in Triton's interpreter,
    # TRITON_INTERPRET=1)


if TYPE_CHECKING:
    from megamemo.data.tokenizer import SubwordTokenizer
    from megamemo.data.vocab import Vocab


@dataclass
class Continuation:
    """A checked request, ready to run: the model, the vocabulary, the encoded prompt, the starting memory."""

    model: torch.nn.Module
    vocab: Vocab | SubwordTokenizer
    prompt: list[int]
    memory: object = None

    def run(self, r: Request, log=None) -> tuple[list[int], str]:
        """-> (new token ids, their text)."""
        new = (
            generate(
                self.model,
                self.prompt,
                r.max_new_tokens,
                top_p=r.top_p,
                temperature=r.temperature,
                seed=r.seed,
                mem_len=r.mem_len,
                log=log,
                greedy=r.greedy,
                memory=self.memory,
            )
            if r.max_new_tokens
            else []
        )
        return new, self.vocab.decode(new)


def prepare(ckpt, r: Request) -> Continuation:
    """Everything a continuation of `r` needs, checked before anything is sampled: the checkpoint on its device, its
    vocabulary (which must fit the model), the prompt encoded with it, the sampling arguments and the starting
    memory. A bad one raises the one-line error that names it (a MegamemoError, or an OSError)."""
    prompt_file, mem_len = r.prompt_file, r.mem_len
    model, meta = open_model(ckpt, r.device, attention=r.attention, generating=True)
    model.cfg.check_lengths(**{"--mem-len": mem_len})
    vocab = vocab_for(meta, r.data, ckpt)
    if len(vocab) > model.cfg.vocab_size:
        raise UsageError(
            f"vocabulary of {len(vocab)} symbols does not fit the model's "
            f"{model.cfg.vocab_size} (model.n_vocab or n_token)"
        )
    raw = Path(prompt_file).read_bytes()
    prompt = encode_prompt(vocab, raw, prompt_file)
    if not prompt:
        raise UsageError(f"{prompt_file}: empty prompt")
    if r.max_new_tokens < 0:
        raise UsageError("--max-new-tokens must be >= 0")
    nucleus_probs(torch.zeros(2), r.top_p, r.temperature)  # argument checks
    start = None
    if r.memory:
        start = load_start_memory(
            r.memory,
            model,
            1,
            default_mem_len(model) if mem_len is None else mem_len,
            what="generate continues one: convert with --memory COLUMN",
        )
    return Continuation(model, vocab, prompt, start)
