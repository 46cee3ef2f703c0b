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

import torch

from megamemo.model.generation import default_mem_len, generate, nucleus_probs
from megamemo.util.errors import UsageError


@dataclass
class Continuation:
    """A checked request, ready to run: the model, the vocabulary, the encoded prompt, the starting memory."""
    model: torch.nn.Module
    vocab: object
    prompt: list[int]
    memory: object = None

    def run(self, max_new_tokens: int, *, top_p: float, temperature: float, seed: int, greedy: bool,
            mem_len: int | None, log=None) -> tuple[list[int], str]:
        """-> (new token ids, their text)."""
        new = generate(self.model, self.prompt, max_new_tokens, top_p=top_p, temperature=temperature, seed=seed,
                       mem_len=mem_len, log=log, greedy=greedy, memory=self.memory) if max_new_tokens else []
        return new, self.vocab.decode(new)


def prepare(ckpt, prompt_file, *, max_new_tokens: int, top_p: float, temperature: float, data=None,
            mem_len: int | None = None, memory=None, device="cpu", attention: str = "auto") -> Continuation:
    """Everything a continuation needs, checked before anything is sampled: the checkpoint on its device, its
    vocabulary (which must fit the model), the prompt encoded with it, the sampling arguments and the starting
    memory. A bad one raises the one-line error that names it (ValueError, OSError, ...)."""
    from megamemo.interop.load import open_model
    from megamemo.interop.vocabulary import encode_prompt, vocab_for

    model, meta = open_model(ckpt, device, attention=attention, generating=True)
    model.cfg.check_lengths(**{"--mem-len": mem_len})
    vocab = vocab_for(meta, data, ckpt)
    if len(vocab) > model.cfg.vocab_size:
        raise UsageError(f"vocabulary of {len(vocab)} symbols does not fit the model's "
                         f"{model.cfg.vocab_size} (model.n_vocab or n_token)")
    raw = Path(prompt_file).read_bytes()
    prompt = encode_prompt(vocab, raw, prompt_file)
    if not prompt:
        raise UsageError(f"{prompt_file}: empty prompt")
    if max_new_tokens < 0:
        raise UsageError("--max-new-tokens must be >= 0")
    nucleus_probs(torch.zeros(2), top_p, temperature)       # argument checks
    start = None
    if memory:
        from megamemo.eval.start_memory import load_start_memory
        start = load_start_memory(memory, model, 1, default_mem_len(model) if mem_len is None else mem_len,
                                  what="generate continues one: convert with --memory COLUMN")
    return Continuation(model, vocab, prompt, start)
