"""The conversion self-check: a checkpoint's probe (recorded by train/probe_record.py) read back and replayed on a
single-device model.

A probe is the first P streams' next SEGMENTS segments and the per-token NLL the sharded model computed for them
from the checkpoint's memory (eval mode, memory carried). A converted model must reproduce it from the memory of the
same columns: fp32 within 1e-5 per token; bf16/fp16 runs compare the model cast to the run's dtype with max |diff|
<= 0.1 and mean |diff| <= 0.01 nats (bf16 keeps 8 bits of mantissa: TP's split sums round differently).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megamemo.model import Memory, MemTransformerLM
from megamemo.model.scoring import score_segments
from megamemo.util.precision import torch_dtype

PROBE_FILE = "probe.safetensors"
SEGMENTS = 3
TOLERANCE = {"fp32": {"max": 1e-5, "mean": 1e-5}, "bf16": {"max": 0.1, "mean": 0.01},
             "fp16": {"max": 0.1, "mean": 0.01}}


class ProbeError(ValueError):
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
    except Exception as e:  # noqa: BLE001
        raise ProbeError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    n = int(meta.get("segments", 0))
    try:
        segs = [(tensors[f"inputs.{i}"], tensors[f"targets.{i}"], tensors[f"nll.{i}"]) for i in range(n)]
    except KeyError as e:
        raise ProbeError(f"{path}: tensor {e} missing") from None
    if n == 0:
        raise ProbeError(f"{path}: no segments recorded")
    return {**meta, "segments": segs, "path": path}


def single_device_nll(model, memory: Memory | None, probe: dict) -> list[torch.Tensor]:
    """The single-device model on the probe's segments, from `memory` (the probe's columns) or empty."""
    mem = None if probe["empty_start"] or memory is None or memory.length == 0 else memory
    out = []
    score_segments(model, ((x, y) for x, y, _ in probe["segments"]), memory=mem,
                   on_segment=lambda scores, x, y, nll: out.append(nll.float()))
    return out


def check_probe(model: MemTransformerLM, memory: Memory | None, probe: dict, precision: str) -> dict:
    """The single-device model (fp32) on the probe's segments vs the sharded model's recorded NLL; `memory` holds
    the probe's columns. Raises ProbeError when it is off by more than the tolerance for the run's precision."""
    dtype = torch_dtype(precision)
    run = model if dtype == torch.float32 else MemTransformerLM(model.cfg).to(dtype).eval()
    if run is not model:
        run.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    got = single_device_nll(run, memory, probe)
    diffs = torch.cat([(g - want.float()).abs().reshape(-1) for g, (_, _, want) in zip(got, probe["segments"])])
    tol = TOLERANCE[precision]
    c0, c1 = probe["columns"]
    res = {"segments": len(got), "streams": c1 - c0, "columns": [c0, c1], "max_abs_diff": float(diffs.max()),
           "mean_abs_diff": float(diffs.mean()), "tolerance": tol, "precision": precision}
    if not (res["max_abs_diff"] <= tol["max"] and res["mean_abs_diff"] <= tol["mean"]):
        raise ProbeError(f"{probe['path']}: the converted model's per-token NLL differs from the sharded model's on "
                         f"the recorded probe: max |diff| {res['max_abs_diff']:.3g}, mean {res['mean_abs_diff']:.3g} "
                         f"(tolerance {tol} for {precision}); nothing written")
    return res
