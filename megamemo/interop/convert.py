"""What `megamemo convert` does (megamemo/commands/convert.py): a training checkpoint of any layout -> a
single-device checkpoint (to_single); a copy of one that training resumes from under any layout (relayout); reference
checkpoints -> a single-device checkpoint (importer.py).

    megamemo convert to-single --ckpt RUN_DIR | CHECKPOINTS_DIR | STEP_DIR --out DIR [--dtype fp32|bf16|fp16]
                               [--memory all | COLUMNS] [--data SHARD_DIR] [--no-check]
    megamemo convert relayout --ckpt RUN_DIR | STEP_DIR --out NEW_RUN_DIR
    megamemo convert import-reference FILE.pt --out DIR [--config CONSTRUCTOR.json]

The checkpoint is opened as load.py opens it (the newest committed one that verifies; a step directory must verify
or it is refused). Checkpoints are layout-free (checkpoint/pieces.py): to-single reads each global tensor whole, one
at a time, whatever TP x PP x DP layout and ZeRO stage wrote it, and writes it into model.safetensors before reading
the next (peak memory: one tensor, then the model once for the self-check). bf16/fp16 runs give their fp32 masters,
checked to round to the module's copies. A missing shard, a piece that does not fit, weights whose shapes do not fit the
recorded model config: an error naming the file, and nothing at --out (outputs appear by an atomic rename).

Self-check: the converted model replays the checkpoint's probe (checkpoint/probe_replay.py, recorded by
train/probe_record.py) from the memory of the probe's columns.
--no-check skips it; a checkpoint without a probe (checkpoint.probe: false) is converted with shape and
consistency checks only, which is said. --memory chooses streams (global columns: `all`, `0-3,7`) whose memory goes
to memory.safetensors (Memory state_dict form, the chosen columns in order; their list in config.json's meta).

relayout copies a verified checkpoint into a new run directory (training resumes in place under any layout, so
this is only for branching a run).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megamemo.checkpoint.probe_replay import ProbeError
from megamemo.checkpoint.single import SingleCheckpointError, model_from_state_dict, write_config, write_streaming
from megamemo.checkpoint.store import MARKER, tag_for
from megamemo.util.files import atomic_directory
from megamemo.util.precision import torch_dtype
from megamemo.util.progress import Progress

from .load import Checkpoint, is_single, resolve_committed
from .vocabulary import copy_tokenizer, data_meta, run_data_meta


class ConvertError(SingleCheckpointError):
    """A conversion refused: its output exists, or a --memory, --data or checkpoint it cannot use; the message
    names it."""


@dataclass(frozen=True)
class ToSingle:
    """What `megamemo convert to-single` asks of a training checkpoint: each field is one of its flags
    (megamemo/commands/convert.py makes them from these fields, their comments the flags' help)."""

    out: str  # new directory for the single-device checkpoint
    dtype: str = "fp32"  # the weights' dtype in the single-device checkpoint
    data: str | None = None  # shard directory whose tokenizer/vocabulary to record (default: the run's)
    memory: str | None = None  # streams whose memory to write: 'all' or global columns like 0-3,7
    no_check: bool = False  # skip the self-check on the recorded probe


@dataclass(frozen=True)
class Relayout:
    """What `megamemo convert relayout` asks of a committed checkpoint (its flags, as ToSingle's)."""

    out: str  # new run directory


def parse_columns(spec: str, batch_size: int) -> list[int]:
    """'all' | '0-3,7' -> column indices, each in [0, batch_size)."""
    if spec == "all":
        return list(range(batch_size))
    cols = []
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ConvertError(f"--memory {spec!r}: expected 'all' or columns like 0-3,7") from None
        cols += list(range(lo, hi + 1))
    bad = [c for c in cols if not 0 <= c < batch_size]
    if bad or not cols:
        raise ConvertError(f"--memory {spec!r}: columns {bad or cols} outside the checkpoint's {batch_size} streams")
    return cols


def to_single(ckpt, request: ToSingle, log=print, progress_every: float = 10.0) -> Path:
    """The checkpoint at `ckpt` -> request.out, a single-device checkpoint (the module's doc says how)."""
    p, out, data = Path(ckpt), Path(request.out), request.data
    if is_single(p):
        raise ConvertError(f"{p}: already a single-device checkpoint")
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    if data and not (Path(data) / "manifest.json").is_file():
        raise ConvertError(f"--data {data}: no manifest.json")
    c = Checkpoint(p, log)
    meta = c.meta()
    try:
        with atomic_directory(out) as tmp:
            _write_single(c, tmp, meta, request.dtype, data, request.memory, not request.no_check, log, progress_every)
    except ProbeError as e:
        raise ConvertError(str(e)) from None
    return out


def _write_single(
    c: Checkpoint, tmp: Path, meta: dict, dtype: str, data, memory: str | None, check: bool, log, progress_every: float
) -> None:
    """The single-device checkpoint of `c` into the directory `tmp`: weights tensor by tensor, the chosen streams'
    memory, the self-check on the probe, the vocabulary and the config."""
    specs = [(k, torch_dtype(dtype), shape) for k, shape in c.shapes.items()]
    total = sum(math.prod(shape) for _, _, shape in specs)
    with Progress(
        "[convert] to-single",
        total=total,
        unit="param",
        scale=True,
        every=progress_every,
        log=log,
        line=lambda q: (
            f"[convert] {q.n / 1e6:,.1f}M of {(q.total or 0) / 1e6:,.1f}M parameters written, "
            f"{q.info.get('tensor', '')}"
        ),
    ) as progress:

        def produce(k):
            t = c.weight(k).to(torch_dtype(dtype))
            progress.update(t.numel(), tensor=k)
            return t

        write_streaming(tmp / "model.safetensors", specs, produce)
    if memory:
        mem = c.memory()
        if mem is None or mem.batch_size is None:
            raise ConvertError(f"--memory {memory}: {c.dir} holds no memory (saved at the start of an epoch)")
        cols = parse_columns(memory, mem.batch_size)
        save_file(
            {k: v.contiguous() for k, v in mem.select_batch(torch.tensor(cols)).state_dict().items()},
            str(tmp / "memory.safetensors"),
        )
        meta["memory_columns"] = cols
    if check:
        model = model_from_state_dict(
            c.cfg, {k: v.float() for k, v in load_file(str(tmp / "model.safetensors")).items()}
        )
        meta["check"] = c.self_check(model, log)
        del model
    meta.update(data_meta(data) if data else run_data_meta(c.dir))
    copy_tokenizer(meta, tmp)
    write_config(tmp, c.cfg, meta)


def relayout(ckpt, request: Relayout, log=print) -> Path:
    """A verified checkpoint copied into NEW_RUN_DIR/checkpoints/step_N (train there under any layout)."""
    out = Path(request.out)
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    step_dir, marker = resolve_committed(ckpt, log)
    name = tag_for(int(marker["step"]))
    with atomic_directory(out) as tmp:
        dst = tmp / "checkpoints" / name
        shutil.copytree(step_dir, dst, ignore=shutil.ignore_patterns(MARKER))
        shutil.copyfile(step_dir / MARKER, dst / MARKER)  # the marker last
    return out / "checkpoints" / name
