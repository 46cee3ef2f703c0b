"""Any checkpoint as a model: a single-device checkpoint as it is, or a committed training checkpoint of any layout
read through its pieces into a single-device model in memory (`load_model`), and put on a device with the kernels and
attention form that fit it (`open_model`). What eval, generate, analyze, the harness and the exports open a
checkpoint with; `megamemo convert` (convert.py) writes one to disk through the same `Checkpoint`.

A run directory or checkpoints root resolves to its newest committed checkpoint whose files verify (sizes and
sha256, as recorded in its COMMITTED marker; a failing one is named and skipped); a step directory must verify or
it is refused. Checkpoints are layout-free (checkpoint/pieces.py): each global tensor is read whole, whatever TP x
PP x DP layout and ZeRO stage wrote it; bf16/fp16 runs give their fp32 masters, checked to round to the module's
copies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megamemo.checkpoint.index import open_reader
from megamemo.checkpoint.layout import RunLayout
from megamemo.checkpoint.pieces import PieceError, ShardedReader
from megamemo.checkpoint.probe_replay import check_probe, read_probe
from megamemo.checkpoint.single import FORMAT, SingleCheckpointError, load_single, model_from_state_dict, read_config
from megamemo.checkpoint.state import rank_files
from megamemo.checkpoint.store import MARKER, CheckpointError, newest_complete, step_of, verify
from megamemo.kernels import apply_attention, apply_kernels, resolve_attention
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.util.precision import torch_dtype

from .vocabulary import run_data_meta


class LoadError(SingleCheckpointError):
    """A checkpoint that cannot be loaded as a model; the message names the directory or file."""


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
        raise LoadError(f"{p}: not a directory")
    skipped: list[str] = []

    def note(msg: str) -> None:  # what newest_complete skipped: said now, and in the error if none is left
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
        raise LoadError(f"refusing {p}: {e}") from None
    if skipped:
        raise LoadError(f"{p}: no committed checkpoint that verifies (skipped {'; '.join(skipped)})")
    raise LoadError(
        f"{p}: no committed checkpoint (looked for step_* directories with a {MARKER} marker in "
        f"{p / 'checkpoints'} and {p})"
    )


class Checkpoint:
    """A committed training checkpoint read through its pieces."""

    def __init__(self, path, log=print):
        self.dir, self.marker = resolve_committed(path, log)
        self.where = self.dir / MARKER
        try:
            self.cfg = ModelConfig.from_dict(self.marker["model"], where=f"{self.where}:model")
            world = int(self.marker["world_size"])
            self.reader = (
                open_reader(self.dir)
                if self.marker.get("index")
                else ShardedReader([self.dir / rank_files(r)[0] for r in range(world)])
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LoadError(f"{self.where}: {e}") from None
        self.precision = self.marker.get("precision", "fp32")
        self.layout = RunLayout.from_record(self.marker.get("layout"))
        with torch.device("meta"):
            self.shapes = {k: tuple(v.shape) for k, v in MemTransformerLM(self.cfg).state_dict().items()}
        have = {n[len("model/") :] for n in self.reader.names("model/")}
        missing, extra = sorted(set(self.shapes) - have), sorted(have - set(self.shapes))
        bad = sorted(
            k
            for k in set(self.shapes) & have
            if math.prod(self.reader.shape(f"model/{k}")) != math.prod(self.shapes[k])
        )
        if missing or extra or bad:
            raise LoadError(
                f"{self.where}: the model config does not match the weights: missing {missing}, "
                f"unexpected {extra}, wrong sizes {bad}"
            )

    def weight(self, name: str) -> torch.Tensor:
        """One fp32 tensor of the single-device model (the fp32 master of a bf16/fp16 run, checked against the
        module's own copy)."""
        try:
            module = self.reader.read(f"model/{name}").reshape(self.shapes[name])
            if f"master/{name}" not in self.reader:
                return module.float()
            master = self.reader.read(f"master/{name}").reshape(self.shapes[name])
        except PieceError as e:
            raise LoadError(str(e)) from None
        if not torch.equal(master.to(module.dtype), module):
            raise LoadError(
                f"{self.dir}: the fp32 master of {name} does not round to the module's {module.dtype} "
                f"copy: the files do not belong together"
            )
        return master.float()

    def memory(self, columns: slice | None = None) -> Memory | None:
        """The memory of global streams `columns` (all when None), or None when the checkpoint holds none."""
        names = [n[len("memory/") :] for n in self.reader.names("memory/")]
        if not names:
            return None
        B = self.layout.batch_size or int(self.reader.shape(f"memory/{names[0]}")[1])
        c0, c1, _ = (columns or slice(0, B)).indices(B)
        out = {}
        for n in names:
            shape = self.reader.shape(f"memory/{n}")
            box = ((0, shape[0]), (c0, c1), *((0, d) for d in shape[2:]))
            try:
                out[n] = self.reader.read(f"memory/{n}", box)
            except PieceError as e:
                raise LoadError(str(e)) from None
        return Memory(out, batch_size=c1 - c0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self.weight(k) for k in self.shapes}

    def meta(self) -> dict:
        return {
            "source": str(self.dir),
            "step": self.marker.get("step"),
            "layout": self.layout.record(),
            "precision": self.precision,
            "model_fingerprint": self.marker.get("model_fingerprint"),
        }

    def self_check(self, model: MemTransformerLM, log=print) -> dict | None:
        probe = read_probe(self.dir)
        if probe is None:
            log(
                f"[load] {self.dir}: no probe recorded (checkpoint.probe was off): weights and memory were "
                f"checked for completeness, shapes and consistency only"
            )
            return None
        c0, c1 = probe["columns"]
        res = check_probe(
            model,
            None if probe["empty_start"] else self.memory(slice(c0, c1)),
            probe,
            probe.get("precision", self.precision),
        )
        log(
            f"[load] check: single-device per-token NLL over {res['segments']} segments x {res['streams']} "
            f"streams (columns {c0}-{c1 - 1}, memory carried) vs the sharded model's: max |diff| "
            f"{res['max_abs_diff']:.2e}, mean {res['mean_abs_diff']:.2e} ({res['precision']}, tolerance max "
            f"{res['tolerance']['max']:.3g}, mean {res['tolerance']['mean']:.3g})"
        )
        return res


def load_model(path, map_location="cpu") -> tuple[MemTransformerLM, dict]:
    """A single-device checkpoint, or a committed training checkpoint read in memory -> (model, meta)."""
    p = Path(path)
    if is_single(p):
        return load_single(p, map_location)
    if (p / "config.json").is_file():
        read_config(p)  # raises with the file name: a config.json that is not ours
    c = Checkpoint(p)
    model = model_from_state_dict(c.cfg, c.state_dict()).to(map_location)
    return model, {**c.meta(), **run_data_meta(c.dir)}


def open_model(path, device, dtype: str = "checkpoint", attention: str | None = "auto", generating: bool = False):
    """load_model(path) ready to run on `device` -> (model in eval mode, meta): in `dtype` ("checkpoint": as
    stored), with the CPU's attention masking on a CPU and plain PyTorch elsewhere (kernels "auto"), and the
    attention form `attention` resolved for the device (generating: one query a step; None: as built)."""
    model, meta = load_model(path)
    if dtype != "checkpoint":
        model = model.to(torch_dtype(dtype))
    apply_kernels(model, "auto", device)
    if attention is not None:
        apply_attention(model, resolve_attention(attention, device, generating=generating))
    return model.to(device).eval(), meta
