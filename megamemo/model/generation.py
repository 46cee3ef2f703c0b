"""Generation with the recurrent memory carried token by token: nucleus sampling (or greedy decoding) of a
continuation, the prompt fed in segments of tgt_len and every new token as one more one-token segment, so nothing is
re-encoded. `megamemo generate` (eval/generate.py), the lm-eval harness and the exports' checks decode through it.

The memory length defaults to mem_len + tgt_len - 1 (the reference's reset_length for one-token segments), so a
token sees as many past tokens as the last token of a training segment did. Transformer-XL's result is then the
same as re-encoding the whole context; LaMemo's memory is refreshed by look-ahead at every step (its segments are
one token long), which is its recurrence at that segment length. A model without memory (rpe) has nothing to
carry: each step re-encodes the last tgt_len tokens.

Sampling: softmax(log-probs / temperature) restricted to the smallest set of most likely tokens whose probability
reaches top_p (nucleus sampling), renormalised, drawn with a CPU generator seeded by `seed`, so a seed gives the same
text on any device.
"""

from __future__ import annotations

import time

import torch

from megamemo.util.errors import UsageError


# ---- sampling --------------------------------------------------------------------------------------------------
def nucleus_probs(logprobs: torch.Tensor, top_p: float = 1.0, temperature: float = 1.0) -> torch.Tensor:
    """[V] log-probs -> [V] fp32 sampling probabilities: temperature, then the top-p nucleus, renormalised."""
    if temperature <= 0:
        raise UsageError(f"temperature must be positive, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"top_p must be in (0, 1], got {top_p}")
    probs = torch.softmax(logprobs.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
    keep_sorted = before < top_p  # the token that crosses top_p is kept; the first always is
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
        self.mem = memory  # None: empty; else one stream's memory (eval/start_memory.py)
        self.history: list[int] = []  # only kept for models without memory

    @torch.no_grad()
    def _run(self, ids: list[int]) -> torch.Tensor:
        inp = torch.tensor(ids, dtype=torch.long, device=self.device)[:, None]
        mem = self.mem if self.mem is not None else self.model.empty_memory(1)
        hidden, self.mem = self.model.encode(inp, mem, mem_len=self.mem_len)
        return self.model.crit.log_probs(hidden[-1], self.model.word_emb)[0]

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens (the prompt: in segments of tgt_len) -> log-probs [V] of the token after them."""
        if not ids:
            raise UsageError("nothing to feed: the prompt is empty")
        c = self.model.cfg
        if not c.has_memory:
            self.history = (self.history + list(ids))[-c.tgt_len :]
            self.mem = None
            return self._run(self.history)
        out = None
        for i in range(0, len(ids), c.tgt_len):
            out = self._run(list(ids[i : i + c.tgt_len]))
        assert out is not None  # ids is not empty (checked above): the loop ran
        return out


def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    top_p: float = 0.95,
    temperature: float = 1.0,
    seed: int = 0,
    mem_len: int | None = None,
    return_logprobs: bool = False,
    log=None,
    greedy: bool = False,
    memory=None,
):
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
        log(
            f"[generate] prompt {len(prompt_ids)} tokens in {t_prompt:.2f}s, {len(out)} new tokens in {dt:.2f}s "
            f"({len(out) / max(dt, 1e-9):.1f} tokens/s), memory {dec.mem_len}"
        )
    return (out, dists) if return_logprobs else out
