"""The probe a training run records with each checkpoint, so that a conversion can check itself (the reading and
checking side: megamemo/checkpoint/probe_replay.py).

At a save every rank runs, in eval mode and without gradients, its first P streams (P = 2, or 1 when a micro-batch
has an odd number of streams) over the next 3 segments of their own text, starting from the memory the
checkpoint holds for them (empty at the start of an epoch), with memory carried from segment to segment:
  * no pipeline: every rank calls its (TP-sharded) module, so the TP ranks of a group run the forward together;
  * pipeline: DeepSpeed's eval schedule (one micro-batch of the P streams) on every stage, with the stage's
    memory banks swapped for the probe's and restored afterwards; the last stage takes the NLL from the logits
    (under TP x PP its TP ranks together, from their vocabulary shards).
Rank (dp 0, tp 0, last stage) writes probe.safetensors: the inputs, targets and per-token NLL [L, P] of
each segment, with the global columns and data positions in the metadata. Nothing the training uses changes: no
RNG is drawn (eval mode), the reader's position and the committed memory are untouched.

`megamemo convert to-single` runs the converted single-device model on the same segments, starting from the
converted memory of the same columns, and compares the NLL (fp32: 1e-5; bf16/fp16: a derived bound,
checkpoint/probe_bound.py).
Cost: 3 forward passes of P streams per checkpoint.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from megamemo.checkpoint.probe_replay import PROBE_FILE, SEGMENTS
from megamemo.model.scoring import score_segments


def probe_streams(micro_batch: int) -> int:
    return 2 if micro_batch % 2 == 0 else 1


def _positions(cursor: dict, steps_per_epoch: int) -> tuple[list[tuple[int, int]], bool]:
    """The next SEGMENTS (epoch, step) positions and whether memory starts empty (a new epoch)."""
    epoch, step = int(cursor["epoch"]), int(cursor["step"])
    n = min(SEGMENTS, steps_per_epoch)
    if step >= steps_per_epoch or step + n > steps_per_epoch:
        epoch, step = epoch + 1, 0
    return [(epoch, step + i) for i in range(n)], step == 0


def _reader(cfg, first_column: int, P: int):
    from megamemo.train.data import stream

    B = cfg.data.batch_size
    return stream(cfg, cfg.data.split, B, cfg.model.tgt_len, B // P, first_column // P, roll=cfg.data.roll,
                  epochs=None, block_tokens=max(SEGMENTS + 1, 4) * cfg.model.tgt_len * P)


@torch.no_grad()
def record_probe(trainer) -> dict:
    """Collective over all ranks (called from Trainer.save). -> {relative path: writer} for the writing rank."""
    cfg, lay = trainer.cfg, trainer.rank_extra.get("layout", {})
    c0 = int(lay.get("micro_batches", [[0, trainer.micro_batch]])[0][0])
    P = probe_streams(trainer.micro_batch)
    reader = _reader(cfg, c0, P)
    try:
        positions, empty = _positions(trainer.cursor.state, reader.steps_per_epoch)
        batches = [reader.get_batch(e, s) for e, s in positions]
    finally:
        reader.close()
    device = trainer.engine.device
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    if trainer.stage is None:
        nlls = _run_module(trainer, batches, P, empty)
    else:
        nlls = _run_pipeline(trainer, batches, P, empty)
    writer = (lay.get("dp_rank", 0) == 0 and lay.get("tp_rank", 0) == 0
              and lay.get("pp_rank", 0) == lay.get("pp", 1) - 1)
    if not writer:
        return {}
    tensors = {}
    for i, ((x, y), nll) in enumerate(zip(batches, nlls)):
        tensors[f"inputs.{i}"] = x.cpu().clone()          # views of one buffer: safetensors wants their own
        tensors[f"targets.{i}"] = y.cpu().clone()
        tensors[f"nll.{i}"] = nll.float().cpu().clone()
    meta = {"format": "megamemo-probe", "version": 1, "step": trainer.counters.step, "columns": [c0, c0 + P],
            "positions": positions, "empty_start": empty, "segments": len(batches),
            "precision": cfg.precision.dtype, "layout": {k: lay.get(k) for k in ("dp", "tp", "pp")}}

    def write(path):
        from safetensors.torch import save_file
        save_file(tensors, str(path), metadata={"probe": json.dumps(meta)})

    return {PROBE_FILE: write}


def _run_module(trainer, batches, P, empty) -> list[torch.Tensor]:
    module = trainer.engine.module
    mem = None if empty else trainer.memory.mems[0].select_batch(slice(0, P))
    if mem is not None and mem.length == 0:
        mem = None
    out = []
    score_segments(module, batches, memory=mem, device=trainer.engine.device,
                   on_segment=lambda scores, x, y, nll: out.append(nll))
    return out


def _run_pipeline(trainer, batches, P, empty) -> list[torch.Tensor]:
    bank, ds = trainer.stage.bank, trainer.engine.ds
    saved_current, saved_pending = bank.current, bank.pending
    start = {} if empty else {n: t[:, :P] for n, t in saved_current.get(0, {}).items()}
    bank.current, bank.pending = ({0: start} if start else {}), {}
    tp = int(trainer.rank_extra.get("layout", {}).get("tp", 1))

    def stage_forward(module, x, y, mem):
        """One segment through DeepSpeed's eval schedule; the memory is the stages' banks. -> (NLL on the last
        stage, none elsewhere; None)."""
        res = ds.eval_batch(iter([((x, torch.tensor([0, 0, 0])), y)]), return_logits=True, compute_loss=True,
                            bcast_loss=False, num_micro_batches=1)
        bank.commit()
        if not ds.is_last_stage():
            return torch.zeros(0, device=x.device), None
        return _token_nll(res[1] if isinstance(res, tuple) else None, y, tp), None

    out = []
    try:
        score_segments(ds.module, batches, forward=stage_forward, device=trainer.engine.device,
                       on_segment=lambda scores, x, y, nll: out.append(nll) if ds.is_last_stage() else None)
    finally:
        bank.current, bank.pending = saved_current, saved_pending
    return out


def _token_nll(logits, y, tp: int) -> torch.Tensor:
    """Per-token NLL [L, B] from the last stage's logits; under TP they hold this rank's vocabulary rows and the
    TP ranks of the stage compute it together (megatron's vocab-parallel cross entropy)."""
    if tp > 1:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits.float().clone(), y)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none").view_as(y)
