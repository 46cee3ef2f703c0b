"""Periodic validation with its own lengths (eval.tgt_len / mem_len / clamp_len / same_length / batch_size).

Like the reference `evaluate()`: B contiguous columns, memory carried down each column from empty, the exact
per-token mean NLL over the split (or its first eval.max_segments segments). Each data-parallel rank scores its
own columns; the sums are all-reduced.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megamemo.config import RunConfig


def eval_lengths(cfg: RunConfig) -> dict:
    """tgt_len and the model overrides. mem_len defaults to mem_len + tgt_len - eval tgt_len (the reference
    scripts' reset_length), so each query still sees the same number of past tokens."""
    m, e = cfg.model, cfg.eval
    tgt = e.tgt_len or m.tgt_len
    mem = e.mem_len if e.mem_len is not None else max(0, m.mem_len + m.tgt_len - tgt)
    return {"tgt_len": tgt, "mem_len": mem,
            "clamp_len": m.clamp_len if e.clamp_len is None else e.clamp_len,
            "same_length": m.same_length if e.same_length is None else e.same_length}


class Evaluator:
    def __init__(self, cfg: RunConfig, make_reader, module_fn, device, world_size: int, metrics):
        self.cfg = cfg
        self.make_reader = make_reader      # () -> a fresh reader over the eval split for this rank
        self.module_fn = module_fn          # () -> the nn.Module to run (the engine's, possibly bf16)
        self.device = device
        self.world_size = world_size
        self.metrics = metrics
        self.lengths = eval_lengths(cfg)

    @torch.no_grad()
    def run(self, step: int) -> float:
        t0 = time.perf_counter()
        model = self.module_fn()
        was_training = model.training
        model.eval()
        L = self.lengths
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        mem = None
        for i, (inp, tgt) in enumerate(self.make_reader()):
            if self.cfg.eval.max_segments and i >= self.cfg.eval.max_segments:
                break
            inp, tgt = inp.to(self.device), tgt.to(self.device)
            nll, mem = model(inp, tgt, mem, mem_len=L["mem_len"], same_length=L["same_length"],
                             clamp_len=L["clamp_len"])
            total[0] += nll.float().sum(dtype=torch.float64)
            total[1] += nll.numel()
        if self.world_size > 1:
            dist.all_reduce(total)
        model.train(was_training)
        loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        replicas = self.cfg.parallel.tp * self.cfg.parallel.pp    # ranks of one DP group score the same streams
        self.metrics.eval({"step": step, "split": self.cfg.eval.split, "loss": loss,
                           "tokens": int(total[1]) // replicas,
                           "seconds": time.perf_counter() - t0, **L})
        return loss
