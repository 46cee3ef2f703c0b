"""The registry of everything that must survive a restart.

Two kinds of entries:
  - sharded savers: objects that write their own sharded files collectively into a checkpoint directory
    (the DeepSpeed engine: model, optimizer, LR scheduler, loss scaler; later a pipeline/tensor-parallel engine).
    They implement `save_sharded(root, tag)` / `load_sharded(root, tag)`.
  - per-rank stateful objects with `state_dict()` / `load_state_dict()` (data cursor, memory of each
    micro-batch, RNG states, step counters). Their state dicts may nest dicts/lists and mix tensors with plain
    values: tensors go to one safetensors file per rank, everything else to one JSON file per rank, so loading
    never unpickles anything.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TENSOR_KEY = "__tensor__"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ShardedSaver(Protocol):
    def save_sharded(self, root: Path, tag: str) -> None: ...

    def load_sharded(self, root: Path, tag: str) -> None: ...


class CheckpointStateError(RuntimeError):
    pass


# ---- per-rank serialisation: tensors -> safetensors, the rest -> JSON --------------------------------------
def split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor inside `obj` (nested dicts/lists/tuples) by {"__tensor__": key}, collecting them."""
    if isinstance(obj, torch.Tensor):
        key = prefix
        t = obj.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        shared = storage.nbytes() != t.numel() * t.element_size() or any(
            storage.data_ptr() == o.untyped_storage().data_ptr() for o in tensors.values() if o.numel())
        tensors[key] = t.clone() if shared and t.numel() else t   # safetensors refuses shared storage
        return {TENSOR_KEY: key}
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


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(obj, indent=1, sort_keys=True)))


def read_json(path: Path, error=ValueError) -> Any:
    """The JSON document at `path`; an unreadable or malformed file raises `error` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable or not valid JSON ({e})") from None


# ---- the registry ------------------------------------------------------------------------------------------
class StateRegistry:
    def __init__(self):
        self.sharded: dict[str, ShardedSaver] = {}
        self.per_rank: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        if name in self.per_rank or name in self.sharded:
            raise ValueError(f"state {name!r} registered twice")
        self.per_rank[name] = obj

    def register_sharded(self, name: str, obj: ShardedSaver) -> None:
        if name in self.per_rank or name in self.sharded:
            raise ValueError(f"state {name!r} registered twice")
        self.sharded[name] = obj

    # per-rank files: <dir>/rank_<r>.json and <dir>/rank_<r>.safetensors
    def save_rank(self, directory: Path, rank: int, extra: dict | None = None) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        skeleton = {name: split_tensors(obj.state_dict(), name, tensors) for name, obj in self.per_rank.items()}
        doc = {"format": 1, "rank": rank, "state": skeleton, **(extra or {})}
        st_path = directory / f"rank_{rank:05d}.safetensors"
        js_path = directory / f"rank_{rank:05d}.json"
        _write_atomic(st_path, lambda p: save_file(tensors, str(p), metadata={"rank": str(rank)}))
        write_json_atomic(js_path, doc)
        return [st_path, js_path]

    def load_rank(self, directory: Path, rank: int) -> dict:
        js_path = directory / f"rank_{rank:05d}.json"
        st_path = directory / f"rank_{rank:05d}.safetensors"
        for p in (js_path, st_path):
            if not p.is_file():
                raise CheckpointStateError(f"{p}: missing (this rank's state)")
        doc = read_json(js_path, CheckpointStateError)
        try:
            tensors = load_file(str(st_path), device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointStateError(f"{st_path}: unreadable ({e})") from None
        state = doc.get("state", {})
        missing = sorted(set(self.per_rank) - set(state))
        extra = sorted(set(state) - set(self.per_rank))
        if missing or extra:
            raise CheckpointStateError(f"{js_path}: state entries differ (missing {missing}, unexpected {extra})")
        for name, obj in self.per_rank.items():
            obj.load_state_dict(join_tensors(state[name], tensors, str(js_path)))
        return doc


# ---- stateful helpers --------------------------------------------------------------------------------------
class RNGState:
    """Python, NumPy and torch (CPU, and CUDA when present) generator states."""

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        d = {"python": {"version": version, "state": list(internal), "gauss": gauss},
             "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
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
        np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(d["torch"])
        if "cuda" in d and torch.cuda.is_available():
            torch.cuda.set_rng_state(d["cuda"])
        tracker = _tp_rng_tracker()
        if tracker is not None and "tensor_parallel" in d:
            tracker.set_states(dict(d["tensor_parallel"]))


def _tp_rng_tracker():
    """megatron-core's RNG tracker (the per-TP-rank dropout streams), when this process set one up."""
    import sys

    rnd = sys.modules.get("megatron.core.tensor_parallel.random")
    if rnd is None or not getattr(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return rnd._CUDA_RNG_STATE_TRACKER


class Counters:
    """Plain numbers that must survive a restart (step, skipped steps, tokens seen...)."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, d: dict) -> None:
        unknown = set(d) - set(self.__dict__)
        if unknown:
            raise CheckpointStateError(f"counters: unexpected entries {sorted(unknown)}")
        self.__dict__.update(d)
