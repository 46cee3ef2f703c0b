"""`megamemo convert`: training checkpoints of any layout -> a single-device checkpoint, or -> a layout-free
checkpoint that training resumes under another layout; reference checkpoints -> a single-device checkpoint.

    megamemo convert to-single --ckpt RUN_DIR | CHECKPOINTS_DIR | STEP_DIR --out DIR [--dtype fp32|bf16|fp16]
                               [--memory all | COLUMNS] [--data SHARD_DIR] [--no-check]
    megamemo convert relayout --ckpt RUN_DIR | STEP_DIR --out NEW_RUN_DIR [--no-check]
    megamemo convert import-reference FILE.pt --out DIR [--config CONSTRUCTOR.json]

A run directory or checkpoints root resolves to its newest committed checkpoint; a step directory must be
committed (its COMMITTED marker present and every listed file at its recorded size) or it is refused. The
checkpoint is read whole (gather.py): tensor-parallel shards joined by tensor.py's rules (column, row and vocab
partitions, [Q;K;V] per head), pipeline stages by their layer files (tied copies checked equal), ZeRO partitions
of every data-parallel rank; bf16/fp16 runs give their fp32 masters (checked to round to the module's copies).
A missing or extra shard, a rank file with another layout, weights whose shapes do not fit the recorded model
config: an error naming the file, and nothing is written at --out (outputs appear by an atomic rename).

Self-check: a training run records a probe with every checkpoint (probe.py: its first streams' next 3 segments
and the per-token NLL the sharded model computed from the checkpoint's memory, eval mode, memory carried).
to-single and relayout run the merged single-device model on the same segments from the merged memory of the
same columns and compare: fp32 max |diff| <= 1e-5 per token; bf16/fp16 runs compare the model cast to the
run's dtype (the module's own rounded weights) with max |diff| <= 0.1 and mean |diff| <= 0.01 nats per token
(bf16 keeps 8 bits of mantissa: TP's split sums round differently). --no-check skips it; a checkpoint without a
probe (checkpoint.probe: false) is converted with shape and consistency checks only, which is said.

--memory chooses streams (global columns: `all`, `0-3,7`) whose memory goes to memory.safetensors (Memory
state_dict form, the chosen columns in order; their list in config.json's meta).

relayout (portable.py) carries the Adam state of ZeRO 1/2 runs (fp32, bf16, fp16) and of ZeRO-0 fp32 runs; other
optimizer layouts are refused by name. Conversion holds the full fp32 model (relayout: and its two Adam moments)
in host memory, on one machine.

`load_model(path)` is what eval / generate / analyze call: a single-device directory is loaded as is, a training
checkpoint of any layout is converted in memory.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from megamemo.checkpoint.gather import ConvertError, TrainingCheckpoint
from megamemo.checkpoint.single import FORMAT, SingleCheckpointError, load_single, read_config, save_single
from megamemo.model import Memory, MemTransformerLM, ModelConfig

MODEL_FILE = "mp_rank_00_model_states.pt"
TOLERANCE = {"fp32": {"max": 1e-5, "mean": 1e-5}, "bf16": {"max": 0.1, "mean": 0.01},
             "fp16": {"max": 0.1, "mean": 0.01}}

__all__ = ["ConvertError", "load_model", "to_single", "relayout", "import_reference_file", "resolve_committed"]


# ---- locating a committed checkpoint ---------------------------------------------------------------------------
def is_single(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
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


def open_checkpoint(path):
    """A TrainingCheckpoint (any DeepSpeed layout) or a PortableCheckpoint (written by relayout)."""
    from megamemo.checkpoint.portable import PortableCheckpoint

    step_dir, marker = resolve_committed(path)
    if (marker.get("layout") or {}).get("portable"):
        return PortableCheckpoint(step_dir, marker)
    return TrainingCheckpoint(step_dir, marker)


# ---- ZeRO-0 fp32 masters (also used by gather.py) ---------------------------------------------------------------
def _numel(shape) -> int:
    return int(math.prod(shape))


def unpartitioned_fp32(model_states: dict, where: Path) -> dict[str, torch.Tensor] | None:
    """ZeRO stage 0 with bf16/fp16: the optimizer state inside the model file holds the fp32 master of every
    parameter, per group in the optimizer's (= the module's parameter) order: `fp32_groups` (one tensor per
    parameter) or `fp32_groups_flat` (one flat tensor per group)."""
    opt = model_states.get("optimizer")
    if not isinstance(opt, dict):
        return None
    buffers = set(model_states.get("buffer_names") or [])
    names = [k for k, v in model_states["module"].items() if isinstance(v, torch.Tensor) and k not in buffers]
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


def training_state_dict(step_dir: Path, marker: dict) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, fp32 state dict, meta) of a committed checkpoint of any layout."""
    c = TrainingCheckpoint(step_dir, marker)
    return c.cfg, c.weights(), c.meta()


def _build(cfg: ModelConfig, sd: dict) -> MemTransformerLM:
    model = MemTransformerLM(cfg)
    model.load_state_dict(sd)
    return model.eval()


# ---- data meta -------------------------------------------------------------------------------------------------
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


# ---- the self-check --------------------------------------------------------------------------------------------
def check_probe(model: MemTransformerLM, memory: Memory | None, probe: dict, precision: str) -> dict:
    """The single-device model on the probe's segments vs the sharded model's recorded NLL. Raises ConvertError
    when it is off by more than the tolerance for the run's precision."""
    from megamemo.checkpoint.probe import single_device_nll

    c0, c1 = probe["columns"]
    mem = None
    if not probe["empty_start"] and memory is not None and memory.length > 0:
        mem = memory.select_batch(slice(c0, c1))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    run = model if dtype == torch.float32 else MemTransformerLM(model.cfg).to(dtype).eval()
    if run is not model:
        run.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    got = single_device_nll(run, mem, probe)
    diffs = torch.cat([(g - want.float()).abs().reshape(-1) for g, (_, _, want) in zip(got, probe["segments"])])
    tol = TOLERANCE[precision]
    res = {"segments": len(got), "streams": c1 - c0, "columns": [c0, c1], "max_abs_diff": float(diffs.max()),
           "mean_abs_diff": float(diffs.mean()), "tolerance": tol, "precision": precision}
    if not (res["max_abs_diff"] <= tol["max"] and res["mean_abs_diff"] <= tol["mean"]):
        raise ConvertError(f"{probe['path']}: the converted model's per-token NLL differs from the sharded model's "
                           f"on the recorded probe: max |diff| {res['max_abs_diff']:.3g}, mean "
                           f"{res['mean_abs_diff']:.3g} (tolerance {tol} for {precision}); nothing written")
    return res


def _self_check(c, model, memory, log) -> dict | None:
    probe = c.probe()
    if probe is None:
        log(f"[convert] {c.dir}: no probe recorded (checkpoint.probe was off): weights and memory were checked for "
            f"completeness, shapes and consistency only")
        return None
    res = check_probe(model, memory, probe, probe.get("precision", c.precision))
    log(f"[convert] check: single-device per-token NLL over {res['segments']} segments x {res['streams']} streams "
        f"(columns {res['columns'][0]}-{res['columns'][1] - 1}, memory carried) vs the sharded model's: max |diff| "
        f"{res['max_abs_diff']:.2e}, mean {res['mean_abs_diff']:.2e} ({res['precision']}, tolerance "
        f"{res['tolerance']['max']:g})")
    return res


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


# ---- commands ----------------------------------------------------------------------------------------------------
def load_model(path, map_location="cpu") -> tuple[MemTransformerLM, dict]:
    """A single-device checkpoint, or a committed training checkpoint converted in memory -> (model, meta)."""
    p = Path(path)
    if is_single(p):
        return load_single(p, map_location)
    if (p / "config.json").is_file():
        read_config(p)      # raises with the file name: a config.json that is not ours
    c = open_checkpoint(p)
    model = _build(c.cfg, c.weights())
    meta = c.meta()
    data_dir = _run_data_dir(c.dir)
    if data_dir is not None and (data_dir / "manifest.json").is_file():
        try:
            meta.update(data_meta(data_dir))
        except Exception:  # noqa: BLE001 - the vocabulary is a convenience for generate
            pass
    return model, meta


def to_single(ckpt, out, dtype: str = "fp32", data=None, memory: str | None = None, check: bool = True,
              log=print) -> Path:
    p, out = Path(ckpt), Path(out)
    if is_single(p):
        raise ConvertError(f"{p}: already a single-device checkpoint")
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    c = open_checkpoint(p)
    sd = c.weights()
    if data and not (Path(data) / "manifest.json").is_file():
        raise ConvertError(f"--data {data}: no manifest.json")
    model = _build(c.cfg, sd)
    mem = c.memory() if (memory or check) else None
    meta = c.meta()
    chosen = None
    if memory:
        cols = parse_columns(memory, mem.batch_size)
        chosen = mem.select_batch(torch.tensor(cols))
        meta["memory_columns"] = cols
    if check:
        meta["check"] = _self_check(c, model, mem, log)
    data_dir = Path(data) if data else _run_data_dir(c.dir)
    if data_dir is not None and (data_dir / "manifest.json").is_file():
        meta.update(data_meta(data_dir))
    elif data:
        raise ConvertError(f"--data {data}: no manifest.json")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return save_single(out, c.cfg, sd, memory=chosen, meta=meta, dtype=torch_dtype)


def relayout(ckpt, out, check: bool = True, log=print) -> Path:
    """A committed checkpoint of any layout -> NEW_RUN_DIR/checkpoints/step_N, layout-free (portable.py)."""
    from megamemo.checkpoint.portable import write_portable

    out = Path(out)
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    c = open_checkpoint(ckpt)
    if not isinstance(c, TrainingCheckpoint):
        raise ConvertError(f"{c.dir}: already a layout-free checkpoint (train from it directly)")
    if check:
        _self_check(c, _build(c.cfg, c.weights()), c.memory(), log)
    return write_portable(c, out)


def import_reference_file(path, out, config_path=None, log=print) -> Path:
    """A thu-coai/LaMemo or kimiyoung/transformer-xl checkpoint -> a single-device checkpoint. FILE is either a
    dict with `state_dict` and `config` (the constructor's keyword arguments; ../shared/reference's format, whose
    `inputs`/`targets`/`nll` are then replayed as a check) or a bare state_dict with --config JSON."""
    from megamemo.interop.reference import ReferenceFormatError, config_from_reference, import_reference

    src, out = Path(path), Path(out)
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    try:
        g = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{src}: not a readable weights-only torch file ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}). A whole pickled "
                           f"model (the reference train.py's torch.save(model)) is refused because loading it runs "
                           f"code: save its state_dict with the reference code first "
                           f"(torch.save(torch.load(FILE).state_dict(), 'sd.pt')) and pass --config") from None
    if not isinstance(g, dict):
        raise ConvertError(f"{src}: expected a dict, got {type(g).__name__}")
    if "state_dict" in g:
        sd, ref_cfg = g["state_dict"], g.get("config")
    else:
        sd, ref_cfg = g, None
    if sd and all(k.startswith("module.") for k in sd):     # saved from a DistributedDataParallel wrapper
        sd = {k[len("module."):]: v for k, v in sd.items()}
    if config_path is not None:
        try:
            ref_cfg = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as e:
            raise ConvertError(f"--config {config_path}: unreadable JSON ({e})") from None
    if not isinstance(ref_cfg, dict):
        raise ConvertError(f"{src}: no constructor config (a 'config' entry, or --config JSON with the "
                           f"MemTransformerLM keyword arguments)")
    try:
        model = import_reference(ref_cfg, sd).eval()
    except (ReferenceFormatError, ValueError, KeyError) as e:
        raise ConvertError(f"{src}: {e}") from None
    meta = {"source": str(src), "imported_from": g.get("reference") or _reference_kind(sd),
            "reference_config": {k: v for k, v in ref_cfg.items() if isinstance(v, (int, float, bool, str, list))
                                 or v is None}}
    if all(k in g for k in ("inputs", "targets", "nll")):
        mem, worst = None, 0.0
        with torch.no_grad():
            for x, y, want in zip(g["inputs"], g["targets"], g["nll"]):
                nll, mem = model(x, y, mem)
                worst = max(worst, float((nll.float() - want.float()).abs().max()))
        if worst > 1e-5:
            raise ConvertError(f"{src}: the imported model's NLL differs from the file's reference NLL by {worst:.3g}"
                               f" (> 1e-5); nothing written")
        meta["check"] = {"segments": len(g["nll"]), "max_abs_diff": worst, "tolerance": 1e-5}
        log(f"[convert] check: imported model reproduces the reference per-token NLL over {len(g['nll'])} segments "
            f"(max |diff| {worst:.2e})")
    config_from_reference(ref_cfg)
    return save_single(out, model.cfg, model.state_dict(), meta=meta)


def _reference_kind(sd: dict) -> str:
    if any(k.endswith("dec_attn.q_net.weight") for k in sd):
        return "thu-coai/LaMemo"
    return "kimiyoung/transformer-xl (or LaMemo with a fused qkv_net)"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("to-single", help="committed training checkpoint (any layout) -> single-device checkpoint")
    s.add_argument("--ckpt", required=True, help="run directory, its checkpoints/ directory, or a step_* directory")
    s.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    s.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    s.add_argument("--data", help="shard directory whose tokenizer/vocabulary to record (default: the run's)")
    s.add_argument("--memory", help="streams whose memory to write: 'all' or global columns like 0-3,7")
    s.add_argument("--no-check", action="store_true", help="skip the self-check on the recorded probe")
    r = sub.add_parser("relayout", help="committed checkpoint -> layout-free checkpoint that `megamemo train` "
                                        "resumes under any tp/pp/dp")
    r.add_argument("--ckpt", required=True, help="run directory, its checkpoints/ directory, or a step_* directory")
    r.add_argument("--out", required=True, help="new run directory (train there with the new layout)")
    r.add_argument("--no-check", action="store_true", help="skip the self-check on the recorded probe")
    i = sub.add_parser("import-reference", help="thu-coai/LaMemo or kimiyoung/transformer-xl weights -> "
                                                "single-device checkpoint")
    i.add_argument("file", help=".pt with {state_dict, config} (or a bare state_dict with --config)")
    i.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    i.add_argument("--config", help="JSON file with the reference MemTransformerLM constructor arguments")
    a = p.parse_args(argv)
    try:
        if a.cmd == "to-single":
            out = to_single(a.ckpt, a.out, a.dtype, a.data, a.memory, check=not a.no_check)
        elif a.cmd == "relayout":
            out = relayout(a.ckpt, a.out, check=not a.no_check)
        else:
            out = import_reference_file(a.file, a.out, a.config)
    except (SingleCheckpointError, ValueError, OSError) as e:
        print(f"megamemo convert: error: {e}", file=sys.stderr)
        return 2
    print(f"[convert] wrote {out}", flush=True)
    return 0
