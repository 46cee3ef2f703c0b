"""The conversion self-check: a checkpoint's probe (recorded by train/probe_record.py) read back and replayed on a
single-device model.

A probe is the first P streams' next SEGMENTS segments and the per-token NLL the sharded model computed for them
from the checkpoint's memory (eval mode, memory carried). A converted model must reproduce it from the memory of the
same columns: fp32 within 1e-5 per token; bf16/fp16 runs compare the model cast to the run's dtype within a bound
derived from the dtype's unit roundoff, the model's depth and width and the scale of its log-probs (probe_bound.py:
the recording and the replay round in different places, which at d_model 1024 alone moves tokens by 0.1 nats).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megamemo.checkpoint.probe_bound import half_tolerance
from megamemo.model import Memory, MemTransformerLM
from megamemo.model.scoring import model_forward, score_segments
from megamemo.util.errors import MegamemoError
from megamemo.util.precision import torch_dtype
from megamemo.util.rounding import RoundingCounter

PROBE_FILE = "probe.safetensors"
SEGMENTS = 3
FP32_TOLERANCE = {"max": 1e-5, "mean": 1e-5}


class ProbeError(MegamemoError, ValueError):
    """An unreadable probe, or a converted model that does not reproduce it; names the file."""


def read_probe(step_dir: Path) -> dict | None:
    """The probe recorded at this checkpoint, or None when the run recorded none (checkpoint.probe: false)."""
    path = Path(step_dir) / PROBE_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("probe", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ProbeError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    n = int(meta.get("segments", 0))
    try:
        segs = [(tensors[f"inputs.{i}"], tensors[f"targets.{i}"], tensors[f"nll.{i}"]) for i in range(n)]
    except KeyError as e:
        raise ProbeError(f"{path}: tensor {e} missing") from None
    if n == 0:
        raise ProbeError(f"{path}: no segments recorded")
    return {**meta, "segments": segs, "path": path}


def replay_memory(memory: Memory | None, probe: dict) -> Memory | None:
    """What the replay starts from: the probe's columns' memory, or None for an empty start."""
    return None if probe["empty_start"] or memory is None or memory.length == 0 else memory


def single_device_nll(model, memory: Memory | None, probe: dict, counter_dtype=None):
    """The single-device model on the probe's segments, from `memory` (the probe's columns) or empty.
    -> per-segment NLL; with counter_dtype, (that, the most rounding operations in that dtype of one forward)."""
    out, counts = [], [0]

    def forward(m, inp, tgt, mem, **lengths):
        if counter_dtype is None:
            return model_forward(m, inp, tgt, mem, **lengths)
        counter = RoundingCounter(counter_dtype)
        with counter:
            res = model_forward(m, inp, tgt, mem, **lengths)
        counts.append(counter.count)
        return res

    score_segments(
        model,
        ((x, y) for x, y, _ in probe["segments"]),
        memory=replay_memory(memory, probe),
        forward=forward,
        on_segment=lambda scores, x, y, nll: out.append(nll.float()),
    )
    return out if counter_dtype is None else (out, max(counts))


def check_probe(model: MemTransformerLM, memory: Memory | None, probe: dict, precision: str) -> dict:
    """The single-device model (fp32) on the probe's segments vs the sharded model's recorded NLL; `memory` holds
    the probe's columns. Raises ProbeError when it is off by more than the tolerance for the run's precision: fp32
    FP32_TOLERANCE, bf16/fp16 the bound probe_bound.py derives for this model (the model cast to the dtype)."""
    dtype = torch_dtype(precision)
    if dtype == torch.float32:
        run, tol = model, FP32_TOLERANCE
        got = single_device_nll(run, memory, probe)
    else:
        run = MemTransformerLM(model.cfg).to(dtype).eval()
        run.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
        got, roundings = single_device_nll(run, memory, probe, counter_dtype=dtype)
        tol = half_tolerance(run, dtype, roundings, probe, replay_memory(memory, probe))
    diffs = torch.cat(
        [(g - want.float()).abs().reshape(-1) for g, (_, _, want) in zip(got, probe["segments"], strict=True)]
    )
    c0, c1 = probe["columns"]
    res = {
        "segments": len(got),
        "streams": c1 - c0,
        "columns": [c0, c1],
        "max_abs_diff": float(diffs.max()),
        "mean_abs_diff": float(diffs.mean()),
        "tolerance": tol,
        "precision": precision,
    }
    if not (res["max_abs_diff"] <= tol["max"] and res["mean_abs_diff"] <= tol["mean"]):
        raise ProbeError(
            f"{probe['path']}: the converted model's per-token NLL differs from the sharded model's on "
            f"the recorded probe: max |diff| {res['max_abs_diff']:.3g}, mean {res['mean_abs_diff']:.3g} "
            f"(tolerance max {tol['max']:.3g}, mean {tol['mean']:.3g} for {precision}); nothing written"
        )
    return res
