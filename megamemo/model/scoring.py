"""The memory-carrying segment scorer: the one loop that scores a model over consecutive segments.

Validation (train/validate.py, pipeline included), `megamemo eval` with or without TRAMS (eval/evaluate.py, and
through it the lm-eval harness), the probe a checkpoint records and its replay after conversion
(train/probe_record.py, checkpoint/probe_replay.py), `megamemo analyze` and `reference-score` all run it:
  * eval mode, no gradients, the model's training mode restored afterwards (also on an error);
  * memory carried from one segment to the next, starting from `memory` (None: empty);
  * the NLL of every scored token summed in float64 on the device (fp32 token NLLs, as the model returns them);
  * at most `max_segments` segments (None: all of them).
`forward(model, inp, tgt, mem, **lengths) -> (nll [L, B], new memory)` is the model's own call by default; TRAMS,
analyze's observer and the pipeline stages pass theirs. A forward may return an NLL with no elements for a rank
that scores nothing (a pipeline stage before the last): it adds nothing.
`on_segment(scores, inp, tgt, nll)` is told each segment once it is counted (running totals in `scores`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .memory import Memory


@dataclass
class Scores:
    """The running totals of one scoring pass."""
    nll: torch.Tensor                   # float64, 0-d, on the device: the summed NLL (nats) of the scored tokens
    tokens: int = 0                     # tokens scored
    segments: int = 0                   # segments run
    memory: Memory | None = None        # the memory after the last segment

    @property
    def mean(self) -> float:
        """Per-token mean NLL (nats); nan when nothing was scored. A device sync."""
        return float(self.nll) / self.tokens if self.tokens else float("nan")


def model_forward(model, inp, tgt, mem, **lengths):
    """The default forward: the model's own call, `lengths` (mem_len, same_length, clamp_len) as overrides."""
    return model(inp, tgt, mem, **lengths)


@torch.no_grad()
def score_segments(model, segments: Iterable, *, memory: Memory | None = None, forward: Callable | None = None,
                   max_segments: int | None = None, device=None, on_segment: Callable | None = None,
                   **lengths) -> Scores:
    """Score `segments` of (input, target) [L, B] with memory carried. -> Scores (sums, counts, final memory)."""
    forward = forward or model_forward
    if device is None:
        device = next(model.parameters()).device
    scores = Scores(torch.zeros((), dtype=torch.float64, device=device), memory=memory)
    was_training = model.training
    model.eval()
    try:
        for inp, tgt in segments:
            if max_segments is not None and scores.segments >= max_segments:
                break
            inp, tgt = inp.to(device), tgt.to(device)
            nll, scores.memory = forward(model, inp, tgt, scores.memory, **lengths)
            scores.nll += nll.float().sum(dtype=torch.float64)
            scores.tokens += nll.numel()
            scores.segments += 1
            if on_segment is not None:
                on_segment(scores, inp, tgt, nll)
    finally:
        model.train(was_training)
    return scores
