"""The probe a training run records with each checkpoint, so that a conversion can check itself (the reading and
checking side: megamemo/checkpoint/probe_replay.py).

At a save every rank runs, in eval mode and without gradients, its first P streams (P = 2, or 1 when a micro-batch
has an odd number of streams) over the next 3 segments of their own text, starting from the memory the
checkpoint holds for them (empty at the start of an epoch), with memory carried from segment to segment:
  * no pipeline: every rank calls its (TP-sharded) module, so the TP ranks of a group run the forward together;
  * pipeline: the stages score the P streams as one micro-batch (parallel/stage_scoring.py, the path validation
    takes), with the stage's memory banks swapped for the probe's and restored afterwards; the last stage takes the
    NLL from the logits (under TP x PP its TP ranks together, from their vocabulary shards).
The reader of the probe's streams is opened at the first save and kept for the next ones (Probe).
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
from safetensors.torch import save_file

from megamemo.checkpoint.layout import RankLayout
from megamemo.checkpoint.probe_replay import PROBE_FILE, SEGMENTS
from megamemo.model.scoring import score_segments
from megamemo.parallel.stage_scoring import scoring_bank, stage_forward
from megamemo.train.data import stream


def probe_streams(micro_batch: int) -> int:
    return 2 if micro_batch % 2 == 0 else 1


def _positions(cursor: dict, steps_per_epoch: int) -> tuple[list[tuple[int, int]], bool]:
    """The next SEGMENTS (epoch, step) positions and whether memory starts empty (a new epoch)."""
    epoch, step = int(cursor["epoch"]), int(cursor["step"])
    n = min(SEGMENTS, steps_per_epoch)
    if step >= steps_per_epoch or step + n > steps_per_epoch:
        epoch, step = epoch + 1, 0
    return [(epoch, step + i) for i in range(n)], step == 0


class Probe:
    """The probe of a run's checkpoints: this rank's first P streams of micro-batch 0, read by a reader of the run's
    data (the data section) opened at the first save and kept for the next ones. `record` is collective over all
    ranks (called from Trainer.save); `close` lets the reader go."""

    def __init__(self, data, tgt_len: int, micro_batch: int, layout: RankLayout, precision: str):
        self.data, self.tgt_len, self.layout, self.precision = data, tgt_len, layout, precision
        self.c0 = layout.micro_batches[0][0]
        self.P = probe_streams(micro_batch)
        self._reader = None

    def reader(self):
        if self._reader is None:
            B, P = self.data.batch_size, self.P
            self._reader = stream(
                self.data,
                self.data.split,
                B,
                self.tgt_len,
                B // P,
                self.c0 // P,
                roll=self.data.roll,
                epochs=None,
                block_tokens=max(SEGMENTS + 1, 4) * self.tgt_len * P,
            )
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @torch.no_grad()
    def record(self, engine, stage, memory, cursor: dict, step: int) -> dict:
        """The next SEGMENTS segments of the probe's streams after `cursor` (the data cursor's state) through the
        engine's model - its module, or under a pipeline its stages (stage: their StageContext) - from the committed
        memory of micro-batch 0 (`memory`: the trainer's, or the stage's bank) -> {relative path: writer} for the
        writing rank (dp 0, tp 0, the last stage), {} for the others."""
        lay, P, c0 = self.layout, self.P, self.c0
        reader = self.reader()
        positions, empty = _positions(cursor, reader.steps_per_epoch)
        device = engine.device
        batches = [(x.to(device), y.to(device)) for x, y in (reader.get_batch(e, s) for e, s in positions)]
        if stage is None:
            nlls = _run_module(engine.module, memory, batches, P, empty, device)
        else:
            nlls = _run_pipeline(engine.ds, stage, batches, P, empty, device)
        if not lay.writes_probe:
            return {}
        tensors = {}
        for i, ((x, y), nll) in enumerate(zip(batches, nlls, strict=True)):
            tensors[f"inputs.{i}"] = x.cpu().clone()  # views of one buffer: safetensors wants their own
            tensors[f"targets.{i}"] = y.cpu().clone()
            tensors[f"nll.{i}"] = nll.float().cpu().clone()
        meta = {
            "format": "megamemo-probe",
            "version": 1,
            "step": step,
            "columns": [c0, c0 + P],
            "positions": positions,
            "empty_start": empty,
            "segments": len(batches),
            "precision": self.precision,
            "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp},
        }

        def write(path):
            save_file(tensors, str(path), metadata={"probe": json.dumps(meta)})

        return {PROBE_FILE: write}


def _run_module(module, memory, batches, P, empty, device) -> list[torch.Tensor]:
    mem = None if empty else memory.mems[0].select_batch(slice(0, P))
    if mem is not None and mem.length == 0:
        mem = None
    out = []
    score_segments(module, batches, memory=mem, device=device, on_segment=lambda scores, x, y, nll: out.append(nll))
    return out


def _run_pipeline(ds, stage, batches, P, empty, device) -> list[torch.Tensor]:
    """Through the stages (parallel/stage_scoring.py), with the stages' banks swapped for the probe's: the first P
    streams of micro-batch 0's committed memory."""
    start = {} if empty else {n: t[:, :P] for n, t in stage.bank.current.get(0, {}).items()}
    out = []
    with scoring_bank(stage, {0: start} if start else None):
        score_segments(
            ds.module,
            batches,
            forward=stage_forward(ds, stage, device, every_tp_rank=True),
            device=device,
            on_segment=lambda scores, x, y, nll: out.append(nll) if ds.is_last_stage() else None,
        )
    return out
