"""`megamemo generate`: sample a continuation of a prompt, carrying the recurrent memory token by token.

    megamemo generate --ckpt CKPT --prompt-file F --max-new-tokens N [--top-p 0.95] [--temperature 1.0]
                      [--seed S] [--greedy] [--data SHARD_DIR] [--mem-len M] [--memory FILE] [--out FILE]
                      [--json FILE]

The prompt is encoded with the checkpoint's vocabulary (config.json meta "vocab", recorded by `megamemo convert`)
or the shard directory's (--data, or the meta's data.dir): bytes/chars vocabularies read the file's raw bytes,
word vocabularies split lines on whitespace and close each finished line with <eos>.

Decoding is incremental: the prompt goes through the model in segments of tgt_len with memory carried, then every
sampled token is one more one-token segment whose memory carries everything before it - nothing is re-encoded.
The memory length defaults to mem_len + tgt_len - 1 (the reference's reset_length for one-token segments), so a
token sees as many past tokens as the last token of a training segment did. Transformer-XL's result is then the
same as re-encoding the whole context; LaMemo's memory is refreshed by look-ahead at every step (its segments are
one token long), which is its recurrence at that segment length. A model without memory (rpe) has nothing to
carry: each step re-encodes the last tgt_len tokens.
--memory FILE starts from a saved memory instead of an empty one: one stream's, as `megamemo convert to-single
--memory COLUMN` writes it (memory.safetensors, or the converted directory), so the prompt continues that stream.

Sampling: softmax(log-probs / temperature) restricted to the smallest set of most likely tokens whose
probability reaches top_p (nucleus sampling), renormalised, drawn with a CPU generator seeded by --seed, so a
seed gives the same text on any device.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


# ---- sampling --------------------------------------------------------------------------------------------------
def nucleus_probs(logprobs: torch.Tensor, top_p: float = 1.0, temperature: float = 1.0) -> torch.Tensor:
    """[V] log-probs -> [V] fp32 sampling probabilities: temperature, then the top-p nucleus, renormalised."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    probs = torch.softmax(logprobs.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p           # mass of the more likely tokens
    keep_sorted = before < top_p                     # the token that crosses top_p is kept; the first always is
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=gen))


def default_mem_len(model) -> int:
    """mem_len + tgt_len - 1: a one-token segment's query sees as many past tokens as a training segment's last."""
    return model.cfg.mem_len + model.cfg.tgt_len - 1


# ---- incremental decoding --------------------------------------------------------------------------------------
class Decoder:
    """Feeds tokens to the model with memory carried and returns the next token's log-probabilities."""

    def __init__(self, model, mem_len: int | None = None, memory=None):
        self.model = model.eval()
        self.mem_len = default_mem_len(model) if mem_len is None else mem_len
        self.device = next(model.parameters()).device
        self.mem = memory                     # None: empty; else one stream's memory (megamemo/eval/start_memory.py)
        self.history: list[int] = []          # only kept for models without memory

    @torch.no_grad()
    def _run(self, ids: list[int]) -> torch.Tensor:
        inp = torch.tensor(ids, dtype=torch.long, device=self.device)[:, None]
        mem = self.mem if self.mem is not None else self.model.empty_memory(1)
        hidden, self.mem = self.model.encode(inp, mem, mem_len=self.mem_len)
        return self.model.crit.log_probs(hidden[-1], self.model.word_emb)[0]

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens (the prompt: in segments of tgt_len) -> log-probs [V] of the token after them."""
        if not ids:
            raise ValueError("nothing to feed: the prompt is empty")
        c = self.model.cfg
        if not c.has_memory:
            self.history = (self.history + list(ids))[-c.tgt_len:]
            self.mem = None
            return self._run(self.history)
        out = None
        for i in range(0, len(ids), c.tgt_len):
            out = self._run(list(ids[i:i + c.tgt_len]))
        return out


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, top_p: float = 0.95, temperature: float = 1.0,
             seed: int = 0, mem_len: int | None = None, return_logprobs: bool = False, log=None,
             greedy: bool = False, memory=None):
    """-> new token ids (and, with return_logprobs, the log-probs [V] each one was sampled from); greedy: the most
    likely token each time instead of a sample. memory: the stream's memory before the prompt (None: empty)."""
    gen = torch.Generator().manual_seed(seed)
    dec = Decoder(model, mem_len, memory)
    t0 = time.perf_counter()
    logprobs = dec.feed(prompt_ids)
    t_prompt = time.perf_counter() - t0
    out, dists = [], []
    for _ in range(max_new_tokens):
        if return_logprobs:
            dists.append(logprobs.float().cpu())
        tok = int(logprobs.argmax()) if greedy else sample(nucleus_probs(logprobs, top_p, temperature), gen)
        out.append(tok)
        if len(out) < max_new_tokens:
            logprobs = dec.feed([tok])
    dt = time.perf_counter() - t0 - t_prompt
    if log is not None:
        log(f"[generate] prompt {len(prompt_ids)} tokens in {t_prompt:.2f}s, {len(out)} new tokens in {dt:.2f}s "
            f"({len(out) / max(dt, 1e-9):.1f} tokens/s), memory {dec.mem_len}")
    return (out, dists) if return_logprobs else out


# ---- tokenizer -------------------------------------------------------------------------------------------------
def vocab_for(meta: dict, data_dir=None, ckpt=None):
    """The vocabulary or subword tokenizer to encode the prompt and decode with: --data's (which must hold the
    tokenizer the checkpoint records), else the file the checkpoint carries (tokenizer.json beside config.json,
    checked by sha256), else its symbols, else its training data directory's."""
    from data_pipeline import load_vocab
    from data_pipeline.remote import manifest_of
    from data_pipeline.tokenizer import load_recorded, same_tokenizer
    from data_pipeline.vocab import Vocab

    tok = meta.get("tokenizer") or {}
    if data_dir:                            # a local directory or an s3:// gs:// https:// one
        theirs = manifest_of(data_dir).get("tokenizer") or {}
        if tok and not same_tokenizer(tok, theirs):
            raise ValueError(f"--data {data_dir}: its tokenizer ({theirs.get('kind')}, sha256 "
                             f"{str(theirs.get('sha256'))[:12]}) differs from the one the checkpoint was trained "
                             f"with ({tok.get('kind')}, sha256 {str(tok.get('sha256'))[:12]})")
        return load_vocab(data_dir)
    if tok.get("kind") == "subword":
        if ckpt and (Path(ckpt) / str(tok.get("file"))).is_file():
            return load_recorded(ckpt, tok, f"{Path(ckpt) / 'config.json'}")
        d = (meta.get("data") or {}).get("dir")
        if d and (Path(d) / "manifest.json").is_file():
            return vocab_for({"tokenizer": tok}, d)
        raise ValueError(f"the checkpoint records the subword tokenizer {tok.get('file')} (sha256 "
                         f"{str(tok.get('sha256'))[:12]}) but neither it nor its data directory is there: pass "
                         f"--data SHARD_DIR")
    v = meta.get("vocab")
    if isinstance(v, dict) and "symbols" in v and "kind" in v:
        return Vocab(v["kind"], list(v["symbols"]))
    d = (meta.get("data") or {}).get("dir")
    if d and (Path(d) / "manifest.json").is_file():
        return load_vocab(d)
    raise ValueError("the checkpoint records no vocabulary (config.json meta.vocab / meta.data.dir): pass "
                     "--data SHARD_DIR to use that directory's vocabulary")


def encode_prompt(vocab, raw: bytes, where: str) -> list[int]:
    import numpy as np

    if vocab.kind == "subword":
        try:
            return vocab.encode(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte {e.start})") from None
    if vocab.kind in ("bytes", "chars"):
        return [int(i) for i in vocab.encode_bytes(np.frombuffer(raw, dtype=np.uint8), where=where)]
    text = raw.decode("utf-8")
    ids: list[int] = []
    lines = text.split("\n")
    for k, line in enumerate(lines):
        words = line.split()
        if k < len(lines) - 1:
            words.append("<eos>")
        got, _ = vocab.encode_words(words, where=where)
        ids += got
    return ids


# ---- the command -----------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="single-device checkpoint, or a training run / checkpoint dir")
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="always the most likely token (no sampling)")
    p.add_argument("--data", help="shard directory whose vocabulary to use (default: the checkpoint's)")
    p.add_argument("--mem-len", type=int, help="memory length (default: mem_len + tgt_len - 1)")
    p.add_argument("--memory", help="start from this stream's memory (memory.safetensors of `megamemo convert "
                                    "to-single --memory COLUMN`, or its directory)")
    p.add_argument("--out", help="write the continuation here instead of stdout")
    p.add_argument("--json", help="write prompt/new token ids and the text here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention", choices=("auto", "eager", "flex"), default="auto",
                   help="attention form: auto (eager: one query a step), eager, flex (FlexAttention)")
    a = p.parse_args(argv)
    from data_pipeline import ManifestError
    from megamemo.interop.convert import load_model
    from megamemo.checkpoint.single import SingleCheckpointError
    from megamemo.kernels import apply_attention, apply_kernels, resolve_attention

    try:
        model, meta = load_model(a.ckpt)
        model = model.to(a.device)
        apply_kernels(model, "auto", a.device)
        apply_attention(model, resolve_attention(a.attention, a.device, generating=True))
        vocab = vocab_for(meta, a.data, a.ckpt)
        if len(vocab) > model.cfg.vocab_size:
            raise ValueError(f"vocabulary of {len(vocab)} symbols does not fit the model's "
                             f"{model.cfg.vocab_size} (model.n_vocab or n_token)")
        raw = Path(a.prompt_file).read_bytes()
        prompt = encode_prompt(vocab, raw, a.prompt_file)
        if not prompt:
            raise ValueError(f"{a.prompt_file}: empty prompt")
        if a.max_new_tokens < 0:
            raise ValueError("--max-new-tokens must be >= 0")
        nucleus_probs(torch.zeros(2), a.top_p, a.temperature)       # argument checks
        start = None
        if a.memory:
            from megamemo.eval.start_memory import load_start_memory
            start = load_start_memory(a.memory, model, 1, default_mem_len(model) if a.mem_len is None else a.mem_len,
                                      what="generate continues one: convert with --memory COLUMN")
    except (ValueError, OSError, ManifestError, SingleCheckpointError) as e:
        print(f"megamemo generate: error: {e}", file=sys.stderr)
        return 2
    new = generate(model, prompt, a.max_new_tokens, top_p=a.top_p, temperature=a.temperature, seed=a.seed,
                   mem_len=a.mem_len, log=lambda m: print(m, file=sys.stderr, flush=True),
                   greedy=a.greedy, memory=start) if a.max_new_tokens else []
    text = vocab.decode(new)
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt_ids": prompt, "new_ids": new, "text": text, "seed": a.seed,
                                            "top_p": a.top_p, "temperature": a.temperature}) + "\n")
    return 0
