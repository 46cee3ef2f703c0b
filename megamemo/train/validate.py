"""Periodic validation with its own lengths (eval.tgt_len / mem_len / clamp_len / same_length / batch_size).

Like the reference `evaluate()`: B contiguous columns, memory carried down each column from empty, the exact
per-token mean NLL over the split (or its first eval.max_segments segments). Each data-parallel rank scores its
own columns; the sums are all-reduced.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megamemo.model.lengths import Lengths
from megamemo.model.scoring import score_segments
from megamemo.parallel.stage_scoring import scoring_bank, stage_forward
from megamemo.train.config import RunConfig


def eval_lengths(cfg: RunConfig) -> Lengths:
    """Validation's lengths (eval.*; None: the model's), resolved. mem_len defaults to mem_len + tgt_len - eval
    tgt_len (the reference scripts' reset_length), so each query still sees the same number of past tokens."""
    m, e = cfg.model, cfg.eval
    tgt = e.tgt_len or m.tgt_len
    mem = e.mem_len if e.mem_len is not None else max(0, m.mem_len + m.tgt_len - tgt)
    return Lengths(tgt, mem, e.clamp_len, e.same_length).resolve(m)


class Evaluator:
    def __init__(self, cfg: RunConfig, make_reader, module_fn, device, world_size: int, metrics):
        self.cfg = cfg
        self.make_reader = make_reader  # () -> a fresh reader over the eval split for this rank
        self.module_fn = module_fn  # () -> the nn.Module to run (the engine's, possibly bf16)
        self.device = device
        self.world_size = world_size
        self.metrics = metrics
        self.lengths = eval_lengths(cfg)
        self.replicas = cfg.parallel.tp * cfg.parallel.pp  # ranks of one DP group that count the same tokens

    def segments(self):
        for i, (inp, tgt) in enumerate(self.make_reader()):
            if self.cfg.eval.max_segments and i >= self.cfg.eval.max_segments:
                break
            yield inp.to(self.device), tgt.to(self.device)

    def score(self) -> torch.Tensor:
        """This rank's [sum of token NLLs, tokens] (float64) over its streams of the split."""
        s = score_segments(self.module_fn(), self.segments(), device=self.device, lengths=self.lengths)
        return _totals(s)

    def run(self, step: int) -> float:
        t0 = time.perf_counter()
        total = self.score()
        if self.world_size > 1:
            dist.all_reduce(total)
        loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        self.metrics.eval(
            {
                "step": step,
                "split": self.cfg.eval.split,
                "loss": loss,
                "tokens": int(total[1]) // self.replicas,
                "seconds": time.perf_counter() - t0,
                **self.lengths.record(),
            }
        )
        return loss


class PipelineEvaluator(Evaluator):
    """Validation through the pipeline stages, forward only, outside DeepSpeed's schedule
    (parallel/stage_scoring.py): each stage keeps the validation memory of its layers in a bank of its own, at the
    validation lengths, and gives the training bank and lengths back afterwards. Only the last stage's first TP rank
    counts, so the all-reduced sums hold every data-parallel replica's tokens once."""

    def __init__(self, cfg, make_reader, engine_fn, stage, device, world_size: int, metrics):
        super().__init__(cfg, make_reader, lambda: engine_fn().module, device, world_size, metrics)
        self.engine_fn, self.stage = engine_fn, stage
        self.replicas = 1

    def score(self) -> torch.Tensor:
        with scoring_bank(self.stage, lengths=self.lengths):
            return _totals(
                score_segments(
                    self.module_fn(),
                    self.segments(),
                    device=self.device,
                    forward=stage_forward(self.engine_fn(), self.stage, self.device),
                )
            )


def _totals(scores) -> torch.Tensor:
    """[sum of token NLLs, tokens] (float64, on the scores' device): what the ranks all-reduce."""
    return torch.stack([scores.nll, torch.tensor(float(scores.tokens), dtype=torch.float64, device=scores.nll.device)])
