"""Checkpoint directories, the commit protocol, newest-complete lookup and retention.

Layout (`root` is `<run_dir>/checkpoints`):
    root/step_00000200/                       one checkpoint (the DeepSpeed tag is the directory name)
        mp_rank_00_model_states.pt            DeepSpeed's sharded files (model, optimizer, LR scheduler, scaler)
        zero_pp_rank_<r>_mp_rank_00_optim_states.pt  (ZeRO 1/2; bf16_... under bf16)
        megamemo/rank_<r>.json                per-rank state: data cursor, counters, RNG, layout (JSON)
        megamemo/rank_<r>.safetensors         per-rank tensors: memory of each micro-batch, torch RNG state
        COMMITTED                             written last, by rank 0, atomically: the checkpoint's manifest
A directory without COMMITTED is incomplete (a crash while saving) and is never loaded; the newest committed
one is. DeepSpeed's own `latest` file is not written and never consulted.

Save (collective):  1. every rank: sharded savers (DeepSpeed), then its per-rank files (tmp + fsync + rename)
                    2. barrier
                    3. rank 0 checks every rank's files are there, writes COMMITTED.tmp (step, world size,
                       model fingerprint, every file with its size), fsyncs, renames it to COMMITTED, fsyncs the
                       directory; then deletes committed checkpoints beyond the newest K and stale incomplete ones
                    4. barrier
A crash before 3's rename leaves a directory without COMMITTED; a resume skips it and a later save of the same
step replaces it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

from megamemo.checkpoint.state import StateRegistry, _write_atomic, read_json, write_json_atomic

MARKER = "COMMITTED"
RANK_DIR = "megamemo"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or file."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def read_marker(step_dir: Path) -> dict:
    marker = step_dir / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{step_dir}: not committed (no {MARKER} marker): an interrupted save")
    return read_json(marker, CheckpointError)


def verify(step_dir: Path) -> dict:
    """The marker of a committed checkpoint whose files are all present with their recorded sizes."""
    info = read_marker(step_dir)
    for rel, size in info.get("files", {}).items():
        p = step_dir / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: listed in {step_dir / MARKER} but missing")
        if p.stat().st_size != size:
            raise CheckpointError(f"{p}: size {p.stat().st_size} differs from the committed {size} (truncated?)")
    return info


def list_checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, directory, committed) for every step directory under root, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        s = step_of(p)
        if s is not None and p.is_dir():
            out.append((s, p, (p / MARKER).is_file()))
    return sorted(out)


def newest_complete(root: Path) -> Path | None:
    """The newest committed checkpoint whose files verify; incomplete ones are skipped (with a note)."""
    for step, path, committed in reversed(list_checkpoints(root)):
        if not committed:
            print(f"[checkpoint] skipping {path}: never committed (interrupted save)", flush=True)
            continue
        try:
            verify(path)
        except CheckpointError as e:
            print(f"[checkpoint] skipping {path}: {e}", flush=True)
            continue
        return path
    return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointStore:
    def __init__(self, root: Path, rank: int, world_size: int, keep_last: int, meta: dict,
                 barrier: Callable[[], None]):
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.meta = meta            # model config + fingerprint, layout, precision...: checked on resume
        self.barrier = barrier
        # Fault injection for the crash tests: MEGAMEMO_FAULT_KILL_IN_SAVE="STEP:RANK" makes that rank SIGKILL
        # itself after writing its files of that step, before the commit (a half-written checkpoint).
        fault = os.environ.get("MEGAMEMO_FAULT_KILL_IN_SAVE", "")
        self._kill_at = tuple(int(x) for x in fault.split(":")) if fault else None

    # ---- save --------------------------------------------------------------------------------------------
    def save(self, step: int, registry: StateRegistry, rank_extra: dict | None = None,
             files: dict[str, Callable[[Path], None]] | None = None) -> Path:
        """files: {path relative to the step directory: writer(path)} this rank adds (e.g. the conversion probe);
        written atomically before the commit, so the marker lists them with their sizes."""
        tag = tag_for(step)
        step_dir = self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        already = (step_dir / MARKER).is_file()
        self.barrier()
        if already:                     # e.g. the final save right after a periodic one
            return step_dir
        if self.rank == 0 and step_dir.exists():
            print(f"[checkpoint] removing incomplete {step_dir} before saving it again", flush=True)
            shutil.rmtree(step_dir)
        self.barrier()
        t0 = time.time()
        for saver in registry.sharded.values():
            saver.save_sharded(self.root, tag)
        registry.save_rank(step_dir / RANK_DIR, self.rank, extra=rank_extra)
        for rel, write in (files or {}).items():
            (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(step_dir / rel, write)
        if self._kill_at == (step, self.rank):
            print(f"[fault] rank {self.rank} kills itself while saving step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.barrier()
        if self.rank == 0:
            self._commit(step, step_dir)
            self._retain()
        self.barrier()
        if self.rank == 0:
            print(f"[checkpoint] committed {step_dir} ({time.time() - t0:.1f}s)", flush=True)
        return step_dir

    def _commit(self, step: int, step_dir: Path) -> None:
        rank_dir = step_dir / RANK_DIR
        missing = [f"rank_{r:05d}.{ext}" for r in range(self.world_size) for ext in ("json", "safetensors")
                   if not (rank_dir / f"rank_{r:05d}.{ext}").is_file()]
        if missing:
            raise CheckpointError(f"{rank_dir}: files of other ranks are missing after the barrier: {missing}")
        files = {}
        for p in sorted(step_dir.rglob("*")):
            if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp"):
                files[str(p.relative_to(step_dir))] = p.stat().st_size
        info = {"format": 1, "step": step, "tag": step_dir.name, "world_size": self.world_size,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **self.meta}
        for sub in (rank_dir, step_dir):
            _fsync_dir(sub)
        write_json_atomic(step_dir / MARKER, info)
        _fsync_dir(step_dir)

    def _retain(self) -> None:
        ckpts = list_checkpoints(self.root)
        committed = [(s, p) for s, p, c in ckpts if c]
        for s, p in committed[: max(0, len(committed) - self.keep_last)]:
            shutil.rmtree(p, ignore_errors=True)
        if committed:
            newest = committed[-1][0]
            for s, p, c in ckpts:
                if not c and s < newest:          # an interrupted save that a newer commit superseded
                    shutil.rmtree(p, ignore_errors=True)

    def remove_incomplete(self) -> list[Path]:
        """Delete never-committed step directories (interrupted saves). Rank 0 calls this at start-up, when no
        rank of this run is writing; a later save of the same step would replace them anyway."""
        removed = []
        for s, p, committed in list_checkpoints(self.root):
            if not committed:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    # ---- load --------------------------------------------------------------------------------------------
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from: `auto` = newest complete under root (or none), `never`, or a path."""
        if resume == "never":
            return None
        if resume == "auto":
            return newest_complete(self.root)
        p = Path(resume)
        if not p.is_dir():
            raise CheckpointError(f"checkpoint.resume: {p} is not a directory")
        if step_of(p) is None:          # a checkpoints root or a run dir: take its newest complete one
            for cand in (p / "checkpoints", p):
                found = newest_complete(cand)
                if found is not None:
                    return found
            raise CheckpointError(f"checkpoint.resume: no committed checkpoint under {p}")
        verify(p)
        return p

    def check_compatible(self, step_dir: Path) -> dict:
        """The marker of `step_dir`, after checking it was written by the same model and layout."""
        info = verify(step_dir)
        portable = bool((info.get("layout") or {}).get("portable"))   # convert relayout: loads into any layout
        saved_model = info.get("model", {})
        want_model = self.meta.get("model", {})
        if saved_model != want_model:
            diffs = [f"model.{k}: checkpoint {saved_model.get(k)!r} vs config {want_model.get(k)!r}"
                     for k in sorted(set(saved_model) | set(want_model)) if saved_model.get(k) != want_model.get(k)]
            raise CheckpointError(f"{step_dir} was saved from a different model config: " + "; ".join(diffs))
        for key in () if portable else ("layout", "precision"):
            if key in self.meta and info.get(key) != self.meta[key]:
                raise CheckpointError(
                    f"{step_dir}: {key} differs (checkpoint {info.get(key)} vs this run {self.meta[key]}); "
                    f"resuming under another {key} needs a layout-free checkpoint: megamemo convert relayout "
                    f"--ckpt {step_dir} --out NEW_RUN_DIR, then train in NEW_RUN_DIR")
        return info

    def load(self, step_dir: Path, registry: StateRegistry) -> dict:
        info = self.check_compatible(step_dir)
        for saver in registry.sharded.values():
            saver.load_sharded(step_dir.parent, step_dir.name)
        doc = registry.load_rank(step_dir / RANK_DIR, self.rank)
        return {"marker": info, "rank": doc}
