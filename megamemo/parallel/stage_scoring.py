"""Scoring through the pipeline stages, forward only, outside DeepSpeed's schedule: the one path validation
(train/validate.py) and the conversion probe (train/probe_record.py) take, given the model's parts - this rank's
DeepSpeed pipeline engine, its StageContext and its device - not the trainer.

Each stage runs its layers on a segment and hands (rows, meta) to the next with DeepSpeed's stage-to-stage p2p (a
shape header first: memory rows make the rows' length vary); the last stage takes the per-token NLL from its
logits (under TP its TP ranks together, from their vocabulary shards: pipeline.token_nll). Every tensor handed to
p2p is made on the device (NCCL takes no CPU tensor): the header, the receive buffers, the stage's (rows, meta)
output. The memory is the stages' banks: `scoring_bank` gives the stage a bank of the scorer's own (and the lengths
it scores at) and hands the training bank and lengths back afterwards.
"""

from __future__ import annotations

import contextlib

import torch

from megamemo.model.lengths import Lengths

from .pipeline import StageContext, StageMemory, stage_input, token_nll


@contextlib.contextmanager
def scoring_bank(ctx: StageContext, current: dict | None = None, lengths: Lengths | None = None):
    """Inside the block the stage's layers keep their memory in a new bank, starting from `current` ({micro-batch:
    {name: tensor}}; None: empty), at `lengths` (resolved: Lengths.resolve; None: the lengths the stage has);
    afterwards the training bank and lengths are back, untouched."""
    saved = ctx.bank, ctx.mem_len, ctx.clamp_len, ctx.same_length
    ctx.bank = StageMemory()
    ctx.bank.replace(current or {})
    if lengths is not None:
        ctx.mem_len, ctx.clamp_len, ctx.same_length = lengths.mem, lengths.clamp, lengths.same_length
    try:
        yield ctx.bank
    finally:
        ctx.bank, ctx.mem_len, ctx.clamp_len, ctx.same_length = saved


def stage_forward(ds, ctx: StageContext, device, every_tp_rank: bool = False):
    """The scorer's forward (model/scoring.py score_segments: forward(module, inp, tgt, mem)) through this rank's
    stage: one segment in (the first stage: the tokens as micro-batch 0; later ones: the previous stage's rows and
    meta), out to the next stage or, on the last, the per-token NLL [L, B] -> (the NLL this rank counts, None): the
    last stage's on its first TP rank (every_tp_rank: on each of them), no elements elsewhere. The memory is the
    bank's, committed after each segment."""
    # deepspeed picks its accelerator at import: only after runtime/device.resolve()
    from deepspeed.runtime.pipe import p2p

    def forward(module, inp, tgt, mem):
        if ds.is_first_stage():
            x = stage_input(inp, 0)  # micro-batch 0
        else:
            shape = torch.empty(3, dtype=torch.long, device=device)
            p2p.recv(shape, ds.prev_stage)
            rows = torch.empty(*shape.tolist(), dtype=next(module.parameters()).dtype, device=device)
            meta = torch.empty(3, dtype=torch.long, device=device)
            p2p.recv(rows, ds.prev_stage)
            p2p.recv(meta, ds.prev_stage)
            x = (rows, meta)
        out = module(x)
        counted = torch.zeros(0, device=device)
        if not ds.is_last_stage():
            rows, meta = out
            p2p.send(torch.tensor(rows.shape, dtype=torch.long, device=device), ds.next_stage)
            p2p.send(rows.contiguous(), ds.next_stage)
            p2p.send(meta, ds.next_stage)
        else:
            nll = token_nll(out, tgt, vocab_parallel=ctx.tp > 1)  # collective over TP ranks
            if every_tp_rank or ctx.tp_rank == 0:
                counted = nll
        ctx.bank.commit()
        return counted, None

    return forward
