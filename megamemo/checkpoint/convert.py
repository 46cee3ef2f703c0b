"""`megamemo convert to-single`: a committed training checkpoint -> a single-device checkpoint (single.py).

    megamemo convert to-single --ckpt RUN_DIR | CHECKPOINTS_DIR | STEP_DIR --out DIR [--dtype fp32|bf16|fp16]
                               [--data SHARD_DIR]

A run directory or checkpoints root resolves to its newest committed checkpoint; a step directory must be
committed (its COMMITTED marker present and every listed file at its recorded size) or it is refused, naming the
missing marker or file. Only runs with tensor and pipeline parallel size 1 are handled here.

Where the weights come from (DeepSpeed 0.19 checkpoint files, loaded with torch's weights-only unpickler):
  * fp32 runs: `mp_rank_00_model_states.pt["module"]` holds the full fp32 weights on every ZeRO stage 0-2 (the
    ZeRO-1/2 optimiser writes its updated partitions back into the module after every step);
  * bf16/fp16 runs: the module holds the low-precision copies; the fp32 master weights are consolidated from the
    optimiser files of every data-parallel rank (`*_optim_states.pt`: each holds its partition of each flattened
    parameter group, `single_partition_of_fp32_groups`), cut back into parameters with the model file's
    `param_shapes` (in group order, skipping `param_alignment_paddings` where DeepSpeed recorded them).
The config and meta (model config, step, layout, precision, and the data's tokenizer and vocabulary when the
run's shard directory is readable) go to config.json.

`load_model(path)` is what eval / generate / analyze call: a single-device directory is loaded as is, a training
checkpoint is converted in memory.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from megamemo.checkpoint.single import (FORMAT, SingleCheckpointError, load_single, read_config, save_single)
from megamemo.model import MemTransformerLM, ModelConfig

MODEL_FILE = "mp_rank_00_model_states.pt"


class ConvertError(SingleCheckpointError):
    """A training checkpoint that cannot be converted; the message names the directory or file."""


# ---- locating a committed checkpoint ---------------------------------------------------------------------------
def is_single(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        import json

        return json.loads(cfg.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def resolve_committed(path) -> tuple[Path, dict]:
    """(step directory, its COMMITTED marker) for a run dir, a checkpoints root or a step dir."""
    from megamemo.checkpoint.store import CheckpointError, newest_complete, step_of, verify

    p = Path(path)
    if not p.is_dir():
        raise ConvertError(f"{p}: not a directory")
    if step_of(p) is not None:
        try:
            return p, verify(p)
        except CheckpointError as e:
            raise ConvertError(f"refusing {p}: {e}") from None
    for cand in (p / "checkpoints", p):
        found = newest_complete(cand)
        if found is not None:
            return found, verify(found)
    raise ConvertError(f"{p}: no committed checkpoint (looked for step_* directories with a COMMITTED marker in "
                       f"{p / 'checkpoints'} and {p})")


# ---- reading DeepSpeed's files safely --------------------------------------------------------------------------
def _load_pt(path: Path) -> dict:
    from megamemo.train.engine import safe_globals

    with torch.serialization.safe_globals(safe_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling problem is reported with the file name
            raise ConvertError(f"{path}: cannot be loaded safely (weights_only): {type(e).__name__}: {e}") from None


def _numel(shape) -> int:
    return int(math.prod(shape))


def unpartitioned_fp32(model_states: dict, where: Path) -> dict[str, torch.Tensor] | None:
    """ZeRO stage 0 with bf16/fp16: the optimizer state inside the model file holds the fp32 master of every
    parameter, per group in the optimizer's (= the module's parameter) order: `fp32_groups` (one tensor per
    parameter) or `fp32_groups_flat` (one flat tensor per group)."""
    opt = model_states.get("optimizer")
    if not isinstance(opt, dict):
        return None
    names = [k for k in model_states["module"] if k not in set(model_states.get("buffer_names") or [])]
    shapes = [tuple(model_states["module"][k].shape) for k in names]
    if "fp32_groups" in opt:
        tensors = [t for group in opt["fp32_groups"] for t in group]
    elif "fp32_groups_flat" in opt:
        flat = torch.cat([g.reshape(-1) for g in opt["fp32_groups_flat"]])
        sizes = [_numel(s) for s in shapes]
        if flat.numel() < sum(sizes):
            raise ConvertError(f"{where}: fp32_groups_flat holds {flat.numel()} values, the module needs {sum(sizes)}")
        tensors = list(torch.split(flat[:sum(sizes)], sizes))
    else:
        return None
    if len(tensors) != len(names):
        raise ConvertError(f"{where}: the optimizer holds {len(tensors)} fp32 master tensors for {len(names)} "
                           f"module parameters")
    out = {}
    for name, shape, t in zip(names, shapes, tensors):
        if t.numel() != _numel(shape):
            raise ConvertError(f"{where}: fp32 master of {name} has {t.numel()} values, expected shape {shape}")
        out[name] = t.float().reshape(shape).clone()
    return out


def consolidate_fp32(step_dir: Path, model_states: dict) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO 0-2 mixed-precision run: from the model file's optimizer state (stage 0)
    or gathered from every rank's optimizer file (stages 1-2)."""
    files = sorted(step_dir.glob("*_optim_states.pt"), key=lambda f: _rank_of(f))
    if not files:
        found = unpartitioned_fp32(model_states, step_dir / MODEL_FILE)
        if found is not None:
            return found
        raise ConvertError(f"{step_dir}: no *_optim_states.pt files (the fp32 master weights of a bf16/fp16 run)")
    parts, paddings = [], None
    for f in files:
        osd = _load_pt(f).get("optimizer_state_dict", {})
        groups = osd.get("single_partition_of_fp32_groups")
        if groups is None:
            raise ConvertError(f"{f}: no single_partition_of_fp32_groups (not a ZeRO 0-2 mixed-precision optimizer "
                               f"state)")
        count = osd.get("partition_count", len(files))
        count = max(count) if isinstance(count, (list, tuple)) else count
        if count != len(files):
            raise ConvertError(f"{step_dir}: {len(files)} optimizer files but {f.name} says the state is split "
                               f"over {count} ranks")
        parts.append([g.float() for g in groups])
        paddings = paddings or osd.get("param_alignment_paddings")
    shapes = model_states.get("param_shapes")
    if shapes is None:
        raise ConvertError(f"{step_dir / MODEL_FILE}: no param_shapes")
    out = {}
    for gi, group_shapes in enumerate(shapes):
        flat = torch.cat([p[gi] for p in parts])
        off = 0
        pads = paddings[gi] if paddings is not None else None
        for pi, (name, shape) in enumerate(group_shapes.items()):
            n = _numel(shape)
            if off + n > flat.numel():
                raise ConvertError(f"{step_dir}: parameter group {gi} holds {flat.numel()} values, too few for "
                                   f"{name} at offset {off}")
            out[name] = flat[off:off + n].view(tuple(shape)).clone()
            off += n + (pads[pi] if pads is not None else 0)
        align = 2 * len(files)          # DeepSpeed pads each flattened group to a multiple of 2 x ranks
        if -(-off // align) * align != -(-flat.numel() // align) * align:
            raise ConvertError(f"{step_dir}: parameter group {gi} holds {flat.numel()} values but its parameters "
                               f"use {off}: the layout is not understood")
    for name, source in (model_states.get("shared_params") or {}).items():
        if source in out:
            out[name] = out[source]
    return out


def _rank_of(f: Path) -> int:
    import re

    m = re.search(r"zero_pp_rank_(\d+)_", f.name)
    return int(m.group(1)) if m else 0


def training_state_dict(step_dir: Path, marker: dict) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, fp32 state dict, meta) of a committed checkpoint with tensor/pipeline parallel size 1."""
    layout = marker.get("layout", {})
    if layout.get("tp", 1) != 1 or layout.get("pp", 1) != 1:
        raise ConvertError(f"{step_dir}: tensor parallel {layout.get('tp')} x pipeline parallel {layout.get('pp')}; "
                           f"only tp = pp = 1 checkpoints can be converted here")
    if "model" not in marker:
        raise ConvertError(f"{step_dir / 'COMMITTED'}: no model config recorded")
    cfg = ModelConfig.from_dict(marker["model"], where=f"{step_dir / 'COMMITTED'}:model")
    mfile = step_dir / MODEL_FILE
    if not mfile.is_file():
        raise ConvertError(f"{mfile}: missing (DeepSpeed's model states)")
    ms = _load_pt(mfile)
    module = ms.get("module")
    if not isinstance(module, dict):
        raise ConvertError(f"{mfile}: no 'module' state dict")
    precision = marker.get("precision", "fp32")
    if precision == "fp32":
        sd = {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    else:
        sd = consolidate_fp32(step_dir, ms)
        for k, v in module.items():                 # buffers and anything the optimizer does not own
            sd.setdefault(k, v.float() if v.is_floating_point() else v)
        for k, v in module.items():
            if k in sd and v.is_floating_point() and not torch.equal(sd[k].to(v.dtype), v):
                raise ConvertError(f"{step_dir}: consolidated fp32 weight {k} does not round to the module's "
                                   f"{v.dtype} copy in {mfile.name}: the optimizer files do not match")
    meta = {"source": str(step_dir), "step": marker.get("step"), "layout": layout, "precision": precision,
            "model_fingerprint": marker.get("model_fingerprint")}
    return cfg, sd, meta


def _check_state(cfg: ModelConfig, sd: dict, where: Path) -> MemTransformerLM:
    model = MemTransformerLM(cfg)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    bad = sorted(k for k in set(sd) & set(expected) if tuple(sd[k].shape) != tuple(expected[k].shape))
    if missing or extra or bad:
        raise ConvertError(f"{where}: weights do not match the recorded model config: missing {missing}, "
                           f"unexpected {extra}, wrong shapes {bad}")
    model.load_state_dict(sd)
    return model


def data_meta(data_dir) -> dict:
    """What generation needs from the shard directory: the tokenizer and the vocabulary's symbols."""
    from data_pipeline import load_manifest, load_vocab

    m = load_manifest(data_dir)
    v = load_vocab(data_dir)
    return {"data": {"dir": str(data_dir), "corpus": m.get("corpus")}, "tokenizer": m.get("tokenizer", {}),
            "vocab": {"kind": v.kind, "symbols": v.symbols}}


def _run_data_dir(step_dir: Path) -> Path | None:
    """The run's data.dir from <run_dir>/config.yaml, if it is there."""
    run_dir = step_dir.parent.parent
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        import yaml

        d = (yaml.safe_load(cfg.read_text()) or {}).get("data", {}).get("dir")
    except Exception:  # noqa: BLE001 - the data dir is optional information
        return None
    return Path(d) if d else None


# ---- what eval / generate / analyze call -----------------------------------------------------------------------
def load_model(path, map_location="cpu") -> tuple[MemTransformerLM, dict]:
    """A single-device checkpoint, or a committed training checkpoint converted in memory -> (model, meta)."""
    p = Path(path)
    if is_single(p):
        return load_single(p, map_location)
    if (p / "config.json").is_file():
        read_config(p)      # raises with the file name: a config.json that is not ours
    step_dir, marker = resolve_committed(p)
    cfg, sd, meta = training_state_dict(step_dir, marker)
    model = _check_state(cfg, sd, step_dir)
    data_dir = _run_data_dir(step_dir)
    if data_dir is not None and (data_dir / "manifest.json").is_file():
        try:
            meta.update(data_meta(data_dir))
        except Exception:  # noqa: BLE001 - the vocabulary is a convenience for generate
            pass
    return model.eval(), meta


def to_single(ckpt, out, dtype: str = "fp32", data=None) -> Path:
    p = Path(ckpt)
    if is_single(p):
        raise ConvertError(f"{p}: already a single-device checkpoint")
    step_dir, marker = resolve_committed(p)
    cfg, sd, meta = training_state_dict(step_dir, marker)
    _check_state(cfg, sd, step_dir)
    data_dir = Path(data) if data else _run_data_dir(step_dir)
    if data_dir is not None and (data_dir / "manifest.json").is_file():
        meta.update(data_meta(data_dir))
    elif data:
        raise ConvertError(f"--data {data}: no manifest.json")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return save_single(out, cfg, sd, meta=meta, dtype=torch_dtype)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("to-single", help="committed training checkpoint -> single-device checkpoint")
    s.add_argument("--ckpt", required=True, help="run directory, its checkpoints/ directory, or a step_* directory")
    s.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    s.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    s.add_argument("--data", help="shard directory whose tokenizer/vocabulary to record (default: the run's)")
    a = p.parse_args(argv)
    try:
        out = to_single(a.ckpt, a.out, a.dtype, a.data)
    except (SingleCheckpointError, ValueError, OSError) as e:
        print(f"megamemo convert: error: {e}", file=sys.stderr)
        return 2
    print(f"[convert] wrote {out}", flush=True)
    return 0
