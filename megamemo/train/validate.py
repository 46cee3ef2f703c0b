"""Periodic validation with its own lengths (eval.tgt_len / mem_len / clamp_len / same_length / batch_size).

Like the reference `evaluate()`: B contiguous columns, memory carried down each column from empty, the exact
per-token mean NLL over the split (or its first eval.max_segments segments). Each data-parallel rank scores its
own columns; the sums are all-reduced.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megamemo.train.config import RunConfig
from megamemo.model.scoring import score_segments


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
        self.replicas = cfg.parallel.tp * cfg.parallel.pp    # ranks of one DP group that count the same tokens

    def segments(self):
        for i, (inp, tgt) in enumerate(self.make_reader()):
            if self.cfg.eval.max_segments and i >= self.cfg.eval.max_segments:
                break
            yield inp.to(self.device), tgt.to(self.device)

    def score(self) -> torch.Tensor:
        """This rank's [sum of token NLLs, tokens] (float64) over its streams of the split."""
        L = self.lengths
        s = score_segments(self.module_fn(), self.segments(), device=self.device, mem_len=L["mem_len"],
                           same_length=L["same_length"], clamp_len=L["clamp_len"])
        return _totals(s)

    def run(self, step: int) -> float:
        t0 = time.perf_counter()
        total = self.score()
        if self.world_size > 1:
            dist.all_reduce(total)
        loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        self.metrics.eval({"step": step, "split": self.cfg.eval.split, "loss": loss,
                           "tokens": int(total[1]) // self.replicas,
                           "seconds": time.perf_counter() - t0, **self.lengths})
        return loss


class PipelineEvaluator(Evaluator):
    """Validation through the pipeline stages, forward only, outside DeepSpeed's schedule: each stage runs its
    layers on a segment and hands (rows, meta) to the next with DeepSpeed's stage-to-stage p2p (a shape header
    first: memory rows make the rows' length vary); the last stage scores the tokens. Each stage keeps the
    validation memory of its layers in a bank of its own, with the validation lengths, and gives the training
    bank and lengths back afterwards. Only the last stage's first TP rank counts, so the all-reduced sums hold
    every data-parallel replica's tokens once. Every tensor handed to p2p is made on the engine's device (NCCL
    takes no CPU tensor): the header, the receive buffers, and the stage's (rows, meta) output."""

    def __init__(self, cfg, make_reader, engine_fn, stage, device, world_size: int, metrics):
        super().__init__(cfg, make_reader, lambda: engine_fn().module, device, world_size, metrics)
        self.engine_fn, self.stage = engine_fn, stage
        self.replicas = 1

    def score(self) -> torch.Tensor:
        from megamemo.parallel.pipeline import StageMemory

        ctx, L = self.stage, self.lengths
        saved = ctx.bank, ctx.mem_len, ctx.clamp_len, ctx.same_length
        ctx.bank, ctx.mem_len, ctx.clamp_len, ctx.same_length = (StageMemory(), L["mem_len"], L["clamp_len"],
                                                                 L["same_length"])
        try:
            return _totals(score_segments(self.module_fn(), self.segments(), device=self.device,
                                          forward=self._stage_forward))
        finally:
            ctx.bank, ctx.mem_len, ctx.clamp_len, ctx.same_length = saved

    def _stage_forward(self, module, inp, tgt, mem):
        """One segment through this stage (the scorer's forward): -> (the NLL this rank counts, None). The memory
        is the stage's bank, not a value: only the last stage's first TP rank counts tokens, the others return no
        elements."""
        from deepspeed.runtime.pipe import p2p

        from megamemo.parallel.pipeline import stage_input, token_nll

        ds, ctx = self.engine_fn(), self.stage
        if ds.is_first_stage():
            x = stage_input(inp, 0)                                         # micro-batch 0
        else:
            shape = torch.empty(3, dtype=torch.long, device=self.device)
            p2p.recv(shape, ds.prev_stage)
            rows = torch.empty(*shape.tolist(), dtype=next(module.parameters()).dtype, device=self.device)
            meta = torch.empty(3, dtype=torch.long, device=self.device)
            p2p.recv(rows, ds.prev_stage)
            p2p.recv(meta, ds.prev_stage)
            x = (rows, meta)
        out = module(x)
        counted = torch.zeros(0, device=self.device)
        if not ds.is_last_stage():
            rows, meta = out
            p2p.send(torch.tensor(rows.shape, dtype=torch.long, device=self.device), ds.next_stage)
            p2p.send(rows.contiguous(), ds.next_stage)
            p2p.send(meta, ds.next_stage)
        else:
            nll = token_nll(out, tgt, vocab_parallel=ctx.tp > 1)    # collective over TP ranks
            if ctx.tp_rank == 0:
                counted = nll
        ctx.bank.commit()
        return counted, None


def _totals(scores) -> torch.Tensor:
    """[sum of token NLLs, tokens] (float64, on the scores' device): what the ranks all-reduce."""
    return torch.stack([scores.nll, torch.tensor(float(scores.tokens), dtype=torch.float64,
                                                 device=scores.nll.device)])

