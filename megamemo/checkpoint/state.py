"""The registry of everything that must survive a restart, and how a rank's share of it is written and read.

Entries (one checkpointer, stateful objects handed to it):
  * `register(name, obj, scope)`: `obj.state_dict()` / `obj.load_state_dict(d)`, nested dicts and lists of JSON
    values and tensors. scope "global": the same on every rank (data cursor, counters, LR schedule, loss scale):
    loaded from rank 0's file under any layout. scope "rank": this process's own (its RNG streams): restored
    only when the layout is unchanged; the caller re-seeds otherwise.
  * `register_sharded(name, obj)`: `obj.pieces()` -> its share of global tensors (pieces.py: weights, fp32
    masters, Adam moments, memory) and `obj.load_pieces(ctx)` with a LoadContext (a reader over every rank's
    pieces, whether the layout is unchanged, the saved marker).
Per rank, in the step directory: `rank_<r>.safetensors` (the pieces and the tensors inside JSON states) and
`rank_<r>.json` (the JSON states, the rank's layout, and the size and sha256 of its other files). The JSON file is
written last, atomically: its presence says the rank's files are complete. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from megamemo.checkpoint.index import open_reader
from megamemo.checkpoint.layout import RunMeta
from megamemo.checkpoint.pieces import Piece, ShardedReader, read_local, write_pieces
from megamemo.checkpoint.staging import Staging
from megamemo.util.files import file_sha256, write_atomic

TENSOR_KEY = "__tensor__"
FORMAT = "megamemo-checkpoint"
VERSION = 2


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointStateError(RuntimeError):
    pass


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank_{rank:05d}.safetensors", f"rank_{rank:05d}.json"


# ---- JSON with tensors inside ------------------------------------------------------------------------------
def split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor inside `obj` (nested dicts/lists/tuples) by {"__tensor__": key}, collecting copies."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = snapshot_tensor(obj)
        return {TENSOR_KEY: prefix}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointStateError(f"{prefix}: state keys must be strings, got {k!r}")
            out[k] = split_tensors(v, f"{prefix}/{k}", tensors)
        return out
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointStateError(f"{prefix}: cannot store a {type(obj).__name__} (only tensors and JSON values)")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_KEY}:
            key = obj[TENSOR_KEY]
            if key not in tensors:
                raise CheckpointStateError(f"{where}: tensor {key!r} is missing")
            return tensors[key]
        return {k: join_tensors(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors, where) for v in obj]
    return obj


def snapshot_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares nothing with the live tensor (the step may go on meanwhile)."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


# ---- files -------------------------------------------------------------------------------------------------
def read_json(path: Path, error=ValueError) -> Any:
    """The JSON document at `path`; an unreadable or malformed file raises `error` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable or not valid JSON ({e})") from None


# ---- the registry ------------------------------------------------------------------------------------------
@dataclass
class LoadContext:
    reader: ShardedReader
    same_layout: bool  # world size, tp/pp/dp, grad_accum, batch and ZeRO stage as when saved
    marker: dict  # the checkpoint's COMMITTED marker (saved layout, precision, step)

    @property
    def saved(self) -> RunMeta:
        """The marker's record of the run that wrote the checkpoint (its layout, precision, model)."""
        return RunMeta.from_record(self.marker)

    @property
    def tag(self) -> str | None:
        return self.marker.get("tag")


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, copied to host memory: written by save_snapshot, in any thread."""

    rank: int
    pieces: list[Piece]
    local: dict[str, torch.Tensor]
    doc: dict
    files: dict[str, Callable[[Path], None]] = field(default_factory=dict)
    files_later: Callable[[], dict] | None = None  # the extra files, when known only after the snapshot


class LateFiles:
    """Extra files known only after the snapshot (the probe, computed on the training thread while a background
    write has started): the writer waits for them; an error on the training thread ends the wait."""

    def __init__(self):
        self._ready = threading.Event()
        self._files: dict | None = None
        self.seconds = 0.0

    def put(self, make: Callable[[], dict]) -> None:
        t0 = time.perf_counter()
        try:
            self._files = make()
        finally:
            self.seconds = time.perf_counter() - t0
            self._ready.set()

    def get(self) -> dict:
        self._ready.wait()
        if self._files is None:
            raise CheckpointStateError("the files to add after the snapshot were never made (the run is ending)")
        return self._files


class StateRegistry:
    def __init__(self):
        self.entries: dict[str, tuple[Stateful, str]] = {}
        self.sharded: dict[str, Any] = {}
        self.staging = Staging()  # the pieces' host buffers, kept from one snapshot to the next

    def _check_new(self, name: str) -> None:
        if name in self.entries or name in self.sharded:
            raise ValueError(f"state {name!r} registered twice")

    def register(self, name: str, obj: Stateful, scope: str = "global") -> None:
        if scope not in ("global", "rank"):
            raise ValueError(f"scope must be 'global' or 'rank', got {scope!r}")
        self._check_new(name)
        self.entries[name] = (obj, scope)

    def register_sharded(self, name: str, obj) -> None:
        self._check_new(name)
        self.sharded[name] = obj

    # ---- save --------------------------------------------------------------------------------------------
    def snapshot(self, rank: int, extra: dict | None = None) -> Snapshot:
        """Copy everything this rank saves (collectives inside `pieces()` are not allowed: ranks differ)."""
        local: dict[str, torch.Tensor] = {}
        state = {name: split_tensors(obj.state_dict(), name, local) for name, (obj, _) in self.entries.items()}
        pieces = [
            Piece(p.name, self.staging.copy((entry, i), p.tensor), p.shape, p.box, p.flat)
            for entry, obj in self.sharded.items()
            for i, p in enumerate(obj.pieces())
        ]
        self.staging.done()  # buffers reused by the next snapshot (staging.py): write this one first
        doc = {"format": FORMAT, "version": VERSION, "rank": rank, "state": state, **(extra or {})}
        return Snapshot(rank, pieces, local, doc)

    # ---- load --------------------------------------------------------------------------------------------
    def load(self, directory: Path, rank: int, ctx_for: Callable[[ShardedReader], LoadContext]) -> dict:
        """Restore every entry from the rank files in `directory`; -> this rank's (or rank 0's) JSON document."""
        reader = open_reader(directory)  # the merged index, or every rank file's header (format 2)
        ctx = ctx_for(reader)
        own_rank = rank if ctx.same_layout else 0
        st_name, js_name = rank_files(own_rank)
        doc = read_json(directory / js_name, CheckpointStateError)
        zero_doc = doc if own_rank == 0 else read_json(directory / rank_files(0)[1], CheckpointStateError)
        state, zero_state = doc.get("state", {}), zero_doc.get("state", {})
        missing = sorted(n for n in self.entries if n not in zero_state)
        if missing:
            raise CheckpointStateError(f"{directory / rank_files(0)[1]}: state entries missing: {missing}")
        tensors = read_local(directory / st_name)
        zero_tensors = tensors if own_rank == 0 else read_local(directory / rank_files(0)[0])
        for name, (obj, scope) in self.entries.items():
            if scope == "rank":
                if ctx.same_layout:
                    obj.load_state_dict(join_tensors(state[name], tensors, str(directory / js_name)))
                continue
            obj.load_state_dict(join_tensors(zero_state[name], zero_tensors, str(directory / rank_files(0)[1])))
        for obj in self.sharded.values():
            obj.load_pieces(ctx)
        return doc


class WriteError(CheckpointStateError):
    """A rank could not write one of its files; `path` names it."""

    def __init__(self, path: Path, error: BaseException):
        self.path = Path(path)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        super().__init__(f"could not write {path}: {reason}")


@dataclass
class Written:
    """What one rank wrote: {relative path: {bytes, sha256}} (its JSON included) and its piece index
    ({rank file: {safetensors key: name, shape, box, flat, dtype}}: pieces.write_pieces)."""

    files: dict
    index: dict


def _write_file(path: Path, write: Callable[[Path], object], before_write: Callable[[Path], None]) -> dict:
    try:
        before_write(path)
        write_atomic(path, write)
        return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    except WriteError:
        raise
    except Exception as e:  # any failure to write names the file (OSError, safetensors, ...
        raise WriteError(path, e) from e


def save_snapshot(
    snap: Snapshot,
    directory: Path,
    before_done: Callable[[], None] = lambda: None,
    before_write: Callable[[Path], None] = lambda path: None,
) -> Written:
    """Write one rank's files into `directory`: the rank safetensors file and extra files (each via a tmp file,
    fsync and rename), then the rank JSON, listing the others' sizes and sha256, last (`before_done` runs just
    before it: the crash tests kill the process there; `before_write(path)` before each file: the injected write
    errors). A file that cannot be written raises WriteError naming it."""
    st_name, js_name = rank_files(snap.rank)
    directory.mkdir(parents=True, exist_ok=True)
    index: dict = {}
    files = {
        st_name: _write_file(
            directory / st_name, lambda p: index.update(write_pieces(p, snap.pieces, snap.local)), before_write
        )
    }
    extra = snap.files if snap.files_later is None else snap.files_later()
    for rel, writer in extra.items():
        files[rel] = _write_file(directory / rel, writer, before_write)
    before_done()
    text = json.dumps({**snap.doc, "files": files}, indent=1, sort_keys=True)
    done = _write_file(directory / js_name, lambda p: p.write_text(text), before_write)
    return Written({**files, js_name: done}, {st_name: index})


# ---- stateful helpers --------------------------------------------------------------------------------------
class RNGState:
    """Python, NumPy and torch (CPU, and CUDA when present) generator states, and megatron's TP stream."""

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        legacy = np.random.get_state()
        assert isinstance(legacy, tuple)  # the legacy form (the default): MT19937's 5-tuple
        name, keys, pos, has_gauss, cached = legacy
        d = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {
                "name": name,
                "keys": keys.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            d["cuda"] = torch.cuda.get_rng_state()
        tracker = _tp_rng_tracker()
        if tracker is not None:
            d["tensor_parallel"] = tracker.get_states()
        return d

    def load_state_dict(self, d: dict) -> None:
        py = d["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        n = d["numpy"]
        np.random.set_state(
            (n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        torch.set_rng_state(d["torch"])
        if "cuda" in d and torch.cuda.is_available():
            torch.cuda.set_rng_state(d["cuda"])
        tracker = _tp_rng_tracker()
        if tracker is not None and "tensor_parallel" in d:
            tracker.set_states(dict(d["tensor_parallel"]))


def _tp_rng_tracker():
    """megatron-core's RNG tracker (the per-TP-rank dropout streams), when this process set one up."""
    rnd = sys.modules.get("megatron.core.tensor_parallel.random")
    if rnd is None or not getattr(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return rnd._CUDA_RNG_STATE_TRACKER


class Counters:
    """Plain numbers that must survive a restart (step, skipped steps, tokens seen...)."""

    def __init__(self, **values):
        self.__dict__.update(values)

    if TYPE_CHECKING:  # for the type checker only: the counters are named at run time

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, d: dict) -> None:
        unknown = set(d) - set(self.__dict__)
        if unknown:
            raise CheckpointStateError(f"counters: unexpected entries {sorted(unknown)}")
        self.__dict__.update(d)
