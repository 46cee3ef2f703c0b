"""`megamemo convert`: a training checkpoint of any layout -> a single-device checkpoint; a copy of one that
training resumes from under any layout; reference checkpoints -> a single-device checkpoint.

    megamemo convert to-single --ckpt RUN_DIR | CHECKPOINTS_DIR | STEP_DIR --out DIR [--dtype fp32|bf16|fp16]
                               [--memory all | COLUMNS] [--data SHARD_DIR] [--no-check]
    megamemo convert relayout --ckpt RUN_DIR | STEP_DIR --out NEW_RUN_DIR
    megamemo convert import-reference FILE.pt --out DIR [--config CONSTRUCTOR.json]

A run directory or checkpoints root resolves to its newest committed checkpoint whose files verify (sizes and
sha256, as recorded in its COMMITTED marker; a failing one is named and skipped); a step directory must verify or
it is refused. Checkpoints are layout-free (pieces.py): to-single reads each global tensor whole, one at a time,
whatever TP x PP x DP layout and ZeRO stage wrote it, and writes it into model.safetensors before reading the next
(peak memory: one tensor, then the model once for the self-check). bf16/fp16 runs give their fp32 masters, checked
to round to the module's copies. A missing shard, a piece that does not fit, weights whose shapes do not fit the
recorded model config: an error naming the file, and nothing at --out (outputs appear by an atomic rename).

Self-check: the converted model replays the checkpoint's probe (checkpoint/probe_replay.py, recorded by
train/probe_record.py) from the memory of the probe's columns.
--no-check skips it; a checkpoint without a probe (checkpoint.probe: false) is converted with shape and
consistency checks only, which is said. --memory chooses streams (global columns: `all`, `0-3,7`) whose memory goes
to memory.safetensors (Memory state_dict form, the chosen columns in order; their list in config.json's meta).

relayout copies a verified checkpoint into a new run directory (training resumes in place under any layout, so
this is only for branching a run). `load_model(path)` is what eval / generate / analyze call: a single-device
directory as is, or a training checkpoint of any layout read into a single-device model in memory.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from megamemo.checkpoint.index import open_reader
from megamemo.checkpoint.pieces import PieceError, ShardedReader
from megamemo.checkpoint.probe_replay import ProbeError, check_probe, read_probe
from megamemo.checkpoint.single import (FORMAT, SingleCheckpointError, load_single, model_from_state_dict,
                                        read_config, write_config, write_streaming)
from megamemo.checkpoint.state import rank_files
from megamemo.checkpoint.store import MARKER, CheckpointError, newest_complete, step_of, tag_for, verify
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.util.files import atomic_directory
from megamemo.util.progress import Progress
from megamemo.util.precision import NAMES as PRECISIONS, torch_dtype



class ConvertError(SingleCheckpointError):
    """A training checkpoint that cannot be converted; the message names the directory or file."""


# ---- locating and opening a committed checkpoint -----------------------------------------------------------
def is_single(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def resolve_committed(path, log=print) -> tuple[Path, dict]:
    """(step directory, its COMMITTED marker) for a run dir, a checkpoints root or a step dir, every file verified."""
    p = Path(path)
    if not p.is_dir():
        raise ConvertError(f"{p}: not a directory")
    skipped: list[str] = []

    def note(msg: str) -> None:             # what newest_complete skipped: said now, and in the error if none is left
        skipped.append(msg.removeprefix("[checkpoint] skipping "))
        log(msg)

    try:
        if step_of(p) is not None:
            return p, verify(p)
        for cand in (p / "checkpoints", p):
            found = newest_complete(cand, checksums=True, log=note)
            if found is not None:
                return found, verify(found, checksums=False)
    except CheckpointError as e:
        raise ConvertError(f"refusing {p}: {e}") from None
    if skipped:
        raise ConvertError(f"{p}: no committed checkpoint that verifies (skipped {'; '.join(skipped)})")
    raise ConvertError(f"{p}: no committed checkpoint (looked for step_* directories with a {MARKER} marker in "
                       f"{p / 'checkpoints'} and {p})")


class Checkpoint:
    """A committed training checkpoint read through its pieces."""

    def __init__(self, path, log=print):
        self.dir, self.marker = resolve_committed(path, log)
        self.where = self.dir / MARKER
        try:
            self.cfg = ModelConfig.from_dict(self.marker["model"], where=f"{self.where}:model")
            world = int(self.marker["world_size"])
            self.reader = (open_reader(self.dir) if self.marker.get("index") else
                           ShardedReader([self.dir / rank_files(r)[0] for r in range(world)]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{self.where}: {e}") from None
        self.precision = self.marker.get("precision", "fp32")
        self.layout = self.marker.get("layout") or {}
        with torch.device("meta"):
            self.shapes = {k: tuple(v.shape) for k, v in MemTransformerLM(self.cfg).state_dict().items()}
        have = {n[len("model/"):] for n in self.reader.names("model/")}
        missing, extra = sorted(set(self.shapes) - have), sorted(have - set(self.shapes))
        bad = sorted(k for k in set(self.shapes) & have
                     if math.prod(self.reader.shape(f"model/{k}")) != math.prod(self.shapes[k]))
        if missing or extra or bad:
            raise ConvertError(f"{self.where}: the model config does not match the weights: missing {missing}, "
                               f"unexpected {extra}, wrong sizes {bad}")

    def weight(self, name: str) -> torch.Tensor:
        """One fp32 tensor of the single-device model (the fp32 master of a bf16/fp16 run, checked against the
        module's own copy)."""
        try:
            module = self.reader.read(f"model/{name}").reshape(self.shapes[name])
            if f"master/{name}" not in self.reader:
                return module.float()
            master = self.reader.read(f"master/{name}").reshape(self.shapes[name])
        except PieceError as e:
            raise ConvertError(str(e)) from None
        if not torch.equal(master.to(module.dtype), module):
            raise ConvertError(f"{self.dir}: the fp32 master of {name} does not round to the module's {module.dtype} "
                               f"copy: the files do not belong together")
        return master.float()

    def memory(self, columns: slice | None = None) -> Memory | None:
        """The memory of global streams `columns` (all when None), or None when the checkpoint holds none."""
        names = [n[len("memory/"):] for n in self.reader.names("memory/")]
        if not names:
            return None
        B = int(self.layout.get("batch_size", self.reader.shape(f"memory/{names[0]}")[1]))
        c0, c1, _ = (columns or slice(0, B)).indices(B)
        out = {}
        for n in names:
            shape = self.reader.shape(f"memory/{n}")
            box = ((0, shape[0]), (c0, c1), *((0, d) for d in shape[2:]))
            try:
                out[n] = self.reader.read(f"memory/{n}", box)
            except PieceError as e:
                raise ConvertError(str(e)) from None
        return Memory(out, batch_size=c1 - c0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self.weight(k) for k in self.shapes}

    def meta(self) -> dict:
        return {"source": str(self.dir), "step": self.marker.get("step"), "layout": self.layout,
                "precision": self.precision, "model_fingerprint": self.marker.get("model_fingerprint")}

    def self_check(self, model: MemTransformerLM, log=print) -> dict | None:
        probe = read_probe(self.dir)
        if probe is None:
            log(f"[convert] {self.dir}: no probe recorded (checkpoint.probe was off): weights and memory were "
                f"checked for completeness, shapes and consistency only")
            return None
        c0, c1 = probe["columns"]
        res = check_probe(model, None if probe["empty_start"] else self.memory(slice(c0, c1)), probe,
                          probe.get("precision", self.precision))
        log(f"[convert] check: single-device per-token NLL over {res['segments']} segments x {res['streams']} "
            f"streams (columns {c0}-{c1 - 1}, memory carried) vs the sharded model's: max |diff| "
            f"{res['max_abs_diff']:.2e}, mean {res['mean_abs_diff']:.2e} ({res['precision']}, tolerance max "
            f"{res['tolerance']['max']:.3g}, mean {res['tolerance']['mean']:.3g})")
        return res


# ---- data meta -------------------------------------------------------------------------------------------------
def data_meta(data_dir) -> dict:
    """What generation needs from the shard directory: the tokenizer and the vocabulary's symbols. A subword
    tokenizer is recorded as {"kind": "subword", "vocab_size", "file", "sha256", ...}: to_single copies that file
    beside config.json (generate and exports read it from there, checked by its sha256)."""
    from data_pipeline import load_manifest, load_vocab

    m = load_manifest(data_dir)
    v = load_vocab(data_dir)
    vocab = ({"kind": v.kind, "file": v.file_name, "size": len(v)} if v.kind == "subword"
             else {"kind": v.kind, "symbols": v.symbols})
    return {"data": {"dir": str(data_dir), "corpus": m.get("corpus")}, "tokenizer": m.get("tokenizer", {}),
            "vocab": vocab}


def copy_tokenizer(meta: dict, out: Path) -> None:
    """A subword tokenizer's file from the data directory into the converted checkpoint, checked by sha256."""
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") != "subword":
        return
    from data_pipeline.tokenizer import load_recorded

    src = Path((meta.get("data") or {}).get("dir", ""))
    load_recorded(src, tok, f"{src / 'manifest.json'}")           # raises on a changed or missing file
    shutil.copyfile(src / tok["file"], out / tok["file"])


def _run_data_meta(step_dir: Path) -> dict:
    """data_meta of the run's data.dir (from <run_dir>/config.yaml), when it is there."""
    cfg = step_dir.parent.parent / "config.yaml"
    try:
        import yaml

        d = (yaml.safe_load(cfg.read_text()) or {}).get("data", {}).get("dir") if cfg.is_file() else None
        return data_meta(d) if d and (Path(d) / "manifest.json").is_file() else {}
    except Exception:  # noqa: BLE001 - the vocabulary is a convenience for generate
        return {}


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


# ---- commands --------------------------------------------------------------------------------------------------
def load_model(path, map_location="cpu") -> tuple[MemTransformerLM, dict]:
    """A single-device checkpoint, or a committed training checkpoint read in memory -> (model, meta)."""
    p = Path(path)
    if is_single(p):
        return load_single(p, map_location)
    if (p / "config.json").is_file():
        read_config(p)      # raises with the file name: a config.json that is not ours
    c = Checkpoint(p)
    model = model_from_state_dict(c.cfg, c.state_dict()).to(map_location)
    return model, {**c.meta(), **_run_data_meta(c.dir)}


def to_single(ckpt, out, dtype: str = "fp32", data=None, memory: str | None = None, check: bool = True,
              log=print, progress_every: float = 10.0) -> Path:
    p, out = Path(ckpt), Path(out)
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
            _write_single(c, tmp, meta, dtype, data, memory, check, log, progress_every)
    except ProbeError as e:
        raise ConvertError(str(e)) from None
    return out


def _write_single(c: Checkpoint, tmp: Path, meta: dict, dtype: str, data, memory: str | None, check: bool, log,
                  progress_every: float) -> None:
    """The single-device checkpoint of `c` into the directory `tmp`: weights tensor by tensor, the chosen streams'
    memory, the self-check on the probe, the vocabulary and the config."""
    specs = [(k, torch_dtype(dtype), shape) for k, shape in c.shapes.items()]
    total = sum(math.prod(shape) for _, _, shape in specs)
    with Progress("[convert] to-single", total=total, unit="param", scale=True, every=progress_every,
                  log=log,
                  line=lambda q: f"[convert] {q.n / 1e6:,.1f}M of {q.total / 1e6:,.1f}M parameters written, "
                                 f"{q.info.get('tensor', '')}") as progress:
        def produce(k):
            t = c.weight(k).to(torch_dtype(dtype))
            progress.update(t.numel(), tensor=k)
            return t
        write_streaming(tmp / "model.safetensors", specs, produce)
    if memory:
        mem = c.memory()
        if mem is None:
            raise ConvertError(f"--memory {memory}: {c.dir} holds no memory (saved at the start of an epoch)")
        cols = parse_columns(memory, mem.batch_size)
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in mem.select_batch(torch.tensor(cols)).state_dict().items()},
                  str(tmp / "memory.safetensors"))
        meta["memory_columns"] = cols
    if check:
        from safetensors.torch import load_file
        model = model_from_state_dict(c.cfg, {k: v.float() for k, v in
                                              load_file(str(tmp / "model.safetensors")).items()})
        meta["check"] = c.self_check(model, log)
        del model
    meta.update(data_meta(data) if data else _run_data_meta(c.dir))
    copy_tokenizer(meta, tmp)
    write_config(tmp, c.cfg, meta)


def relayout(ckpt, out, log=print) -> Path:
    """A verified checkpoint copied into NEW_RUN_DIR/checkpoints/step_N (train there under any layout)."""
    out = Path(out)
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    step_dir, marker = resolve_committed(ckpt, log)
    name = tag_for(int(marker["step"]))
    with atomic_directory(out) as tmp:
        dst = tmp / "checkpoints" / name
        shutil.copytree(step_dir, dst, ignore=shutil.ignore_patterns(MARKER))
        shutil.copyfile(step_dir / MARKER, dst / MARKER)          # the marker last
    return out / "checkpoints" / name


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("to-single", help="committed training checkpoint (any layout) -> single-device checkpoint")
    s.add_argument("--ckpt", required=True, help="run directory, its checkpoints/ directory, or a step_* directory")
    s.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    s.add_argument("--dtype", choices=PRECISIONS, default="fp32")
    s.add_argument("--data", help="shard directory whose tokenizer/vocabulary to record (default: the run's)")
    s.add_argument("--memory", help="streams whose memory to write: 'all' or global columns like 0-3,7")
    s.add_argument("--no-check", action="store_true", help="skip the self-check on the recorded probe")
    r = sub.add_parser("relayout", help="copy a committed checkpoint into a new run directory (training resumes "
                                        "from it under any tp/pp/dp)")
    r.add_argument("--ckpt", required=True, help="run directory, its checkpoints/ directory, or a step_* directory")
    r.add_argument("--out", required=True, help="new run directory")
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
            out = relayout(a.ckpt, a.out)
        else:
            from megamemo.interop.importer import import_reference_file
            out = import_reference_file(a.file, a.out, a.config)
    except (SingleCheckpointError, CheckpointError, PieceError, ValueError, OSError) as e:
        print(f"megamemo convert: error: {e}", file=sys.stderr)
        return 2
    print(f"[convert] wrote {out}", flush=True)
    return 0


__all__ = ["ConvertError", "Checkpoint", "load_model", "to_single", "relayout", "resolve_committed"]
