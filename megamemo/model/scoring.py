"""The memory-carrying segment scorer: the one loop that scores a model over consecutive segments (score_segments),
and the evaluation pass over a split built on it (evaluate: progress, TRAMS, per-token hits, bytes).

Validation (train/validate.py, pipeline included), `megamemo eval` with or without TRAMS and the lm-eval harness
(through evaluate), the probe a checkpoint records and its replay after conversion
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

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megamemo.util.progress import Progress
from megamemo.util.units import bits_per_byte

from .lengths import Lengths
from .memory import Memory
from .trams import TramsConfig
from .trams import forward as trams_forward


@dataclass
class Scores:
    """The running totals of one scoring pass."""

    nll: torch.Tensor  # float64, 0-d, on the device: the summed NLL (nats) of the scored tokens
    tokens: int = 0  # tokens scored
    segments: int = 0  # segments run
    memory: Memory | None = None  # the memory after the last segment

    @property
    def mean(self) -> float:
        """Per-token mean NLL (nats); nan when nothing was scored. A device sync."""
        return float(self.nll) / self.tokens if self.tokens else float("nan")


def model_forward(model, inp, tgt, mem, lengths: Lengths | None = None):
    """The default forward: the model's own call at `lengths` (mem, same_length, clamp; None: the model's)."""
    if lengths is None:
        return model(inp, tgt, mem)
    return model(inp, tgt, mem, mem_len=lengths.mem, same_length=lengths.same_length, clamp_len=lengths.clamp)


@torch.no_grad()
def score_segments(
    model,
    segments: Iterable,
    *,
    memory: Memory | None = None,
    forward: Callable | None = None,
    max_segments: int | None = None,
    device=None,
    on_segment: Callable | None = None,
    lengths: Lengths | None = None,
) -> Scores:
    """Score `segments` of (input, target) [L, B] with memory carried. -> Scores (sums, counts, final memory).
    forward(model, inp, tgt, mem) -> (nll, memory): default the model's own call, at `lengths` (the default
    forward's only: a forward of one's own runs at the lengths it chooses)."""
    if forward is not None and lengths is not None:
        raise ValueError("score_segments: lengths are the default forward's; a forward of one's own sets its own")
    forward = forward or functools.partial(model_forward, lengths=lengths)
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
            nll, scores.memory = forward(model, inp, tgt, scores.memory)
            scores.nll += nll.float().sum(dtype=torch.float64)
            scores.tokens += nll.numel()
            scores.segments += 1
            if on_segment is not None:
                on_segment(scores, inp, tgt, nll)
    finally:
        model.train(was_training)
    return scores


def evaluate(
    model,
    batches,
    *,
    mem_len=None,
    same_length=None,
    clamp_len=None,
    trams: TramsConfig | None = None,
    max_segments: int = 0,
    device=None,
    log=None,
    total_segments: int | None = None,
    log_every: float = 10.0,
    bar: bool | None = False,
    token_bytes: torch.Tensor | None = None,
    on_segment=None,
    memory: Memory | None = None,
) -> dict:
    """Exact per-token mean NLL (nats) of `model` over `batches` of (input, target) [L, B], memory carried from
    `memory` (None: empty), through the one scorer (score_segments, above).
    Progress: a line to `log` every `log_every` seconds, or a tqdm bar (bar=True; None: on a terminal).
    token_bytes (int64 [V], subword corpora): also the UTF-8 bytes of the scored target tokens ("bytes").
    on_segment(nll [L, B], hit [L, B] bool): told each segment's per-token NLL and whether each target was the
    most likely token (the harness's loglikelihood; without TRAMS).
    -> {"nll", "tokens", "segments", "seconds"[, "bytes", "bits_per_byte"]}."""
    if trams is not None and on_segment is not None:
        raise ValueError("on_segment is not available with TRAMS")
    lengths = Lengths(mem=mem_len, same_length=same_length, clamp=clamp_len)
    forward = functools.partial(model_forward, lengths=lengths)
    if trams is not None:  # the TRAMS pool is the memory length
        forward = functools.partial(trams_forward, select=trams, same_length=same_length, clamp_len=clamp_len)
    elif on_segment is not None:
        forward = functools.partial(_forward_with_hits, on_segment, lengths=lengths)
    n_bytes = 0
    t0 = time.perf_counter()
    n_seg = min(total_segments, max_segments or total_segments) if total_segments else (max_segments or None)
    show = log is not None or bool(bar)
    progress = Progress(
        "[eval]",
        total=n_seg,
        unit="seg",
        every=log_every if show else float("inf"),
        bar=bar if show else False,
        log=log,
        line=_progress_line,
    )

    def counted(scores, inp, tgt, nll):
        nonlocal n_bytes
        if token_bytes is not None:
            n_bytes += int(token_bytes[tgt.cpu()].sum())
        progress.update(1, tokens=scores.tokens, nll=lambda: scores.mean)  # nll: a device sync, when shown

    try:
        scores = score_segments(
            model,
            batches,
            memory=memory,
            forward=forward,
            max_segments=max_segments or None,
            device=device,
            on_segment=counted,
        )
    finally:
        progress.close()
    out = {
        "nll": scores.mean,
        "tokens": scores.tokens,
        "segments": scores.segments,
        "seconds": time.perf_counter() - t0,
    }
    if token_bytes is not None:
        out["bytes"], out["bits_per_byte"] = n_bytes, bits_per_byte(float(scores.nll), n_bytes)
    return out


def _forward_with_hits(on_segment, model, inp, tgt, mem, lengths: Lengths):
    """The model's log-probs: the targets' NLL, and whether each target was the most likely token (on_segment)."""
    logp, mem = model_forward(model, inp, None, mem, lengths)
    nll = -logp.gather(2, tgt.long()[..., None]).squeeze(2)
    on_segment(nll, logp.argmax(2) == tgt)
    return nll, mem


def _progress_line(p) -> str:
    of = f"/{p.total}" if p.total else ""
    return (
        f"[eval] segment {p.n}{of}: {p.info['tokens']:,} tokens, {p.info['tokens'] / p.elapsed:,.0f} tokens/s, "
        f"running nll {p.info['nll']:.4f}"
    )
