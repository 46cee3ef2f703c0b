"""Checkpoint directories: the commit protocol, checksums, newest-verified lookup, retention, asynchronous saves.

Layout (`root` is `<run_dir>/checkpoints`):
    root/step_00000200/
        rank_<r>.safetensors   rank r's pieces of the global tensors (pieces.py) and its rank-local tensors
        rank_<r>.json          rank r's JSON state, layout, and the size + sha256 of its other files (written last)
        probe.safetensors      the conversion self-check (train/probe_record.py), from one rank
        COMMITTED              written last, by rank 0, atomically: step, layout, model config, and every file
                               with its size and sha256
A directory without COMMITTED is an interrupted save: never loaded, removed at the next start. A committed one whose
files do not match their recorded size or sha256 is moved aside (`step_N.corrupt`, never deleted) and the next
newest is used, saying so.

Save (collective). Every rank copies its state to host memory (the only part the step waits for when
`checkpoint.async_save` is on), then writes its files (tmp + fsync + rename; the rank JSON last) and reports the
outcome to rank 0 (commit.py); rank 0 checks the pieces cover every tensor once, writes index.json and COMMITTED
(tmp, fsync, rename), applies retention (a removed checkpoint loses its COMMITTED marker first), and tells every
rank the verdict: a failed save fails on every rank alike (SaveFailed). A crash anywhere before the rename leaves
the previous checkpoint the newest. Async saves run the writing and the commit in a background thread.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megamemo.checkpoint.commit import (
    Collectives,
    OutcomeTimeout,
    check_and_index,
    first_error,
    outcome_channel,
    write_and_report,
)
from megamemo.checkpoint.faults import FaultPoints
from megamemo.checkpoint.index import INDEX_FILE
from megamemo.checkpoint.layout import Compatibility, RankLayout, RunMeta
from megamemo.checkpoint.replicas import ReplicaRecord
from megamemo.checkpoint.state import LateFiles, LoadContext, Snapshot, StateRegistry, read_json
from megamemo.util.errors import MegamemoError
from megamemo.util.files import entry_mismatch, file_sha256, fsync_dir, write_json_atomic

MARKER = "COMMITTED"
FORMAT = 3  # 3: with the merged piece index (index.json); 2: without (read through the headers)
FORMATS = (2, 3)
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(MegamemoError, RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or file."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def read_marker(step_dir: Path) -> dict:
    marker = Path(step_dir) / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{step_dir}: not committed (no {MARKER} marker): an interrupted save")
    return read_json(marker, CheckpointError)


def check_file(step_dir: Path, rel: str, entry: dict, checksum: bool = True) -> None:
    p = Path(step_dir) / rel
    if not p.is_file():
        raise CheckpointError(f"{p}: listed in {Path(step_dir) / MARKER} but missing")
    problem = entry_mismatch(
        entry,
        p.stat().st_size,
        (lambda: file_sha256(p)) if checksum else None,
        recorded=str(Path(step_dir) / MARKER),
        what="size",
    )
    if problem:
        raise CheckpointError(
            f"{p}: {problem}"
            + (": the file changed after it was written (corrupt)" if problem.startswith("sha256") else "")
        )


def verify(step_dir: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> dict:
    """The marker of a committed checkpoint whose files are present at their recorded sizes and, with checksums,
    sha256. share=(i, n): only every n-th file from the i-th (ranks verify a checkpoint together)."""
    info = read_marker(step_dir)
    if info.get("format") not in FORMATS or not isinstance(info.get("files"), dict):
        raise CheckpointError(
            f"{Path(step_dir) / MARKER}: not a megamemo checkpoint of format 2 or 3 (format {info.get('format')!r})"
        )
    for rel in sorted(info["files"])[share[0] :: share[1]]:
        check_file(step_dir, rel, info["files"][rel], checksums)
    return info


def list_checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, directory, committed) for every step directory under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(step, p, (p / MARKER).is_file()) for p in root.iterdir() if (step := step_of(p)) is not None and p.is_dir()]
    return sorted(out)


def newest_complete(root: Path, checksums: bool = False, log=print) -> Path | None:
    """The newest committed checkpoint whose files verify (sizes; sha256 too with checksums), saying what it
    skipped. Reads only: resuming moves bad ones aside (CheckpointStore.select)."""
    for _step, path, committed in reversed(list_checkpoints(root)):
        if not committed:
            log(f"[checkpoint] skipping {path}: never committed (interrupted save)")
            continue
        try:
            verify(path, checksums)
        except CheckpointError as e:
            log(f"[checkpoint] skipping {path}: {e}")
            continue
        return path
    return None


def move_aside(step_dir: Path) -> Path:
    """Rename a checkpoint that failed verification so it is no longer a step directory (kept for inspection)."""
    target = step_dir.with_name(step_dir.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}.corrupt{n}")
    os.replace(step_dir, target)
    fsync_dir(step_dir.parent)
    return target


def remove_checkpoint(step_dir: Path, between: Callable[[], None] = lambda: None) -> None:
    """Delete a checkpoint: its COMMITTED marker first (durably), so a crash midway leaves an uncommitted dir."""
    marker = step_dir / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(step_dir)
    between()
    shutil.rmtree(step_dir, ignore_errors=True)


class SaveFailed(CheckpointError):
    """A save failed on every rank alike (a rank's write error, a hole in the pieces, a rank silent past the
    timeout), nothing committed: every rank raises the same line, so one says it."""

    same_on_every_rank = True


class CheckpointStore:
    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep_last: int,
        meta: RunMeta,
        barrier: Callable[[], None],
        async_save: bool = False,
        commit_timeout_s: float = 600.0,
        log: Callable[[str], None] = print,
        outcomes=None,
    ):  # outcomes: commit.py (collective)
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.keep_last = keep_last
        self.meta = meta  # model config + fingerprint, layout, precision: recorded, checked on resume
        self.comm = Collectives(barrier)
        self.async_save = async_save
        self.commit_timeout_s = commit_timeout_s
        self.overlap_late_files = torch.cuda.is_available()  # files made after the snapshot, beside the write
        self.outcomes = outcomes if outcomes is not None else outcome_channel(world_size, commit_timeout_s)
        self.log = log if rank == 0 else (lambda *a, **k: None)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._abandoned = threading.Event()
        self.faults = FaultPoints(rank)  # crash tests and bench/soak.py only (checkpoint/faults.py)
        self._compatible: tuple[Path, Compatibility] | None = None  # check_compatible's, once

    # ---- save --------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        registry: StateRegistry,
        layout: RankLayout | None = None,
        replicas: ReplicaRecord | None = None,
        files: dict[str, Callable[[Path], None]] | Callable[[], dict[str, Callable[[Path], None]]] | None = None,
    ) -> Path:
        """Collective. layout: this rank's (rank_<r>.json keeps it); replicas: the replica check's record of this
        step (train/numerics.py; rank_<r>.json keeps its record()). files: {name: writer(path)} this rank adds to
        the step directory, or a function making them after the snapshot (the probe). A failed save raises SaveFailed on
        every rank: here (sync), or in wait() once failed() says so (async)."""
        self.wait()
        step_dir = self.root / tag_for(step)
        self.comm.barrier()  # every rank's previous save is written, and rank 0 has committed it
        if (step_dir / MARKER).is_file():  # e.g. the final save right after a periodic one (all ranks see it)
            return step_dir
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if step_dir.exists():
                self.log(f"[checkpoint] removing incomplete {step_dir} before saving it again")
                shutil.rmtree(step_dir)
        self.comm.barrier()
        t0 = time.perf_counter()
        doc: dict[str, object] = {"step": step}
        if layout is not None:
            doc["layout"] = layout.record()
        if replicas is not None:
            doc["replicas"] = replicas.record()
        snap = registry.snapshot(self.rank, doc)
        stall = time.perf_counter() - t0
        make, late = (files, LateFiles()) if callable(files) else (None, None)
        if late is None:
            assert not callable(files)
            snap.files, snap.files_later = dict(files or {}), None
        else:
            snap.files, snap.files_later = {}, late.get
        overlap = late is not None and self.async_save and self.overlap_late_files
        if late is not None and make is not None and not overlap:  # e.g. the probe: after the snapshot, before
            late.put(make)  # the write (cores shared)
        if self.async_save:
            self._thread = threading.Thread(
                target=self._background,
                args=(snap, step, step_dir, t0, stall, late),
                name=f"checkpoint-{step}",
                daemon=True,
            )
            self._thread.start()
        if overlap and late is not None and make is not None:  # on a GPU: device work beside the write
            late.put(make)
        if not self.async_save:
            self._write_and_commit(snap, step, step_dir)
            self.log(f"[checkpoint] committed {step_dir} ({time.perf_counter() - t0:.1f}s, synchronous)")
        return step_dir

    def _background(self, snap: Snapshot, step: int, step_dir: Path, t0: float, stall: float, late) -> None:
        try:
            self._write_and_commit(snap, step, step_dir)
            self.log(
                f"[checkpoint] committed {step_dir} ({time.perf_counter() - t0:.1f}s in the background, "
                f"training stalled {stall:.2f}s"
                + (f", then {late.seconds:.2f}s for the files made after the snapshot" if late else "")
                + ")"
            )
        except BaseException as e:  # reported by wait() on the main thread
            self._error = e

    def _write_and_commit(self, snap: Snapshot, step: int, step_dir: Path) -> None:
        """This rank's files, its outcome to rank 0, rank 0's verdict (and commit) back to every rank."""
        mine = write_and_report(snap, step, step_dir, self.faults)
        if self._abandoned.is_set():
            raise CheckpointError(f"step {step}: abandoned (the run is ending with an error; not committed)")
        try:
            outcomes = self.outcomes.gather(mine)
            verdict = self._commit(step, step_dir, outcomes) if self.rank == 0 else None
            verdict = self.outcomes.broadcast(verdict)
        except OutcomeTimeout as e:
            raise SaveFailed(f"checkpoint step {step}: {e}; nothing committed") from None
        if verdict:
            raise SaveFailed(verdict)

    def failed(self) -> bool:
        """This rank's background save has ended with an error (the training loop asks every step)."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def wait(self, timeout_s: float | None = None) -> None:
        """Finish this rank's background save; re-raise its error here. timeout_s: after another rank reported a
        failure, a write of this rank stuck in the file system is given up on."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise SaveFailed(
                    f"rank {self.rank}: its checkpoint write did not end within {timeout_s:g} s after "
                    f"the save failed (a hung file system?); nothing committed"
                )
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e if isinstance(e, SaveFailed) else CheckpointError(f"background checkpoint write failed: {e}") from e

    def abandon(self, timeout_s: float = 60.0) -> None:
        """On an error path, before the process exits: a background save in flight does not report its outcome
        (never committed; the next start removes it) and its thread ends, so that no thread is inside C++ code
        when the interpreter shuts down (the process would abort). Not collective."""
        self._abandoned.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._error = None

    def finish(self) -> None:
        """Before exiting: every rank's pending save committed (collective)."""
        self.wait()
        self.comm.barrier()

    def _commit(self, step: int, step_dir: Path, outcomes: list[dict]) -> str | None:
        """Rank 0, with every rank's outcome: COMMITTED written (-> None), or the line saying why not (the step
        directory then removed: every rank has finished writing it)."""
        problem = first_error(outcomes)
        try:
            if problem is None:
                files, problem = check_and_index(step_dir, outcomes)
            if problem is None:
                info = {
                    "format": FORMAT,
                    "step": step,
                    "tag": step_dir.name,
                    "world_size": self.world_size,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "index": INDEX_FILE,
                    "files": files,
                    **self.meta.record(),
                }
                fsync_dir(step_dir)
                self.faults.at("commit")
                write_json_atomic(step_dir / MARKER, info)
                fsync_dir(step_dir)
                self.faults.at("retention")
                self._retain()
                return None
        except (OSError, ValueError) as e:
            problem = f"rank 0 could not commit {step_dir}: {e}"
        shutil.rmtree(step_dir, ignore_errors=True)
        return f"checkpoint step {step} failed: {problem}; nothing committed"

    def _retain(self) -> None:
        ckpts = list_checkpoints(self.root)
        committed = [p for _, p, c in ckpts if c]
        for p in committed[: max(0, len(committed) - self.keep_last)]:
            remove_checkpoint(p, between=lambda: self.faults.at("removal"))
        if committed:
            newest = [s for s, _, c in ckpts if c][-1]  # committed[-1]'s step
            for s, p, c in ckpts:
                if not c and s < newest:  # an interrupted save that a newer commit superseded
                    shutil.rmtree(p, ignore_errors=True)

    def remove_incomplete(self) -> list[Path]:
        """Delete never-committed step directories (interrupted saves). Rank 0 calls this at start-up, holding
        the run directory's lock, when no rank of this run is writing."""
        removed = []
        for _, p, committed in list_checkpoints(self.root):
            if not committed:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    # ---- choosing what to resume from ---------------------------------------------------------------------
    def select(self, resume: str) -> Path | None:
        """Collective: the checkpoint to resume from. `auto`: the newest committed one under root whose files
        all verify (every rank checks the sha256 of a share of the files); one that fails is moved aside, named,
        and the next newest is tried. `never`: none. A path: that checkpoint (or a run / checkpoints directory's
        newest), which must verify."""
        if resume == "never":
            return None
        explicit = None if resume == "auto" else Path(resume)
        if explicit is not None and not explicit.is_dir():
            raise CheckpointError(f"checkpoint.resume: {explicit} is not a directory")
        while True:
            cand = None
            if self.rank == 0:
                if explicit is not None and step_of(explicit) is not None:
                    cand = str(explicit)
                else:
                    roots = [self.root] if explicit is None else [explicit / "checkpoints", explicit]
                    cand = self._newest_sized(roots, may_move=explicit is None)
                    if cand is None and explicit is not None:
                        cand = f"!no committed checkpoint under {explicit}"
            cand = self.comm.broadcast(cand)
            if cand is None:
                return None
            if cand.startswith("!"):
                raise CheckpointError(f"checkpoint.resume: {cand[1:]}")
            path = Path(cand)
            try:
                verify(path, checksums=True, share=(self.rank, self.world_size))
                problem = ""
            except CheckpointError as e:
                problem = str(e)
            problems = [p for p in self.comm.all_gather(problem) if p]
            if not problems:
                return path
            if explicit is not None or path.parent != self.root:
                raise CheckpointError(f"checkpoint.resume: {problems[0]}")
            if self.rank == 0:
                aside = move_aside(path)
                self.log(
                    f"[checkpoint] {problems[0]}; moved {path.name} aside to {aside.name} and trying the "
                    f"next newest checkpoint"
                )
            self.comm.barrier()

    def _newest_sized(self, roots: list[Path], may_move: bool) -> str | None:
        """Rank 0: the newest committed checkpoint whose files are all there at their sizes (checksums come next,
        shared by the ranks); in this run's own root a committed one that fails is moved aside."""
        for root in roots:
            for _, path, committed in reversed(list_checkpoints(root)):
                if not committed:
                    self.log(f"[checkpoint] skipping {path}: never committed (interrupted save)")
                    continue
                try:
                    verify(path, checksums=False)
                    return str(path)
                except CheckpointError as e:
                    if not may_move:
                        self.log(f"[checkpoint] skipping {path}: {e}")
                        continue
                    aside = move_aside(path)
                    self.log(f"[checkpoint] {e}; moved {path.name} aside to {aside.name}")
        return None

    def check_compatible(self, step_dir: Path) -> Compatibility:
        """(marker, same layout?, a line saying what changed) after checking the model config is the same. Read and
        checked once per checkpoint: the trainer's start-up, its resume and the load all ask."""
        if self._compatible is not None and self._compatible[0] == step_dir:
            return self._compatible[1]
        self._compatible = (step_dir, self._check_compatible(step_dir))
        return self._compatible[1]

    def _check_compatible(self, step_dir: Path) -> Compatibility:
        info = read_marker(step_dir)
        saved = RunMeta.from_record(info)
        saved_model, want_model = saved.model, self.meta.model
        if saved_model != want_model:
            diffs = [
                f"model.{k}: checkpoint {saved_model.get(k)!r} vs config {want_model.get(k)!r}"
                for k in sorted(set(saved_model) | set(want_model))
                if saved_model.get(k) != want_model.get(k)
            ]
            raise CheckpointError(f"{step_dir} was saved from a different model config: " + "; ".join(diffs))
        old, new = saved.layout, self.meta.layout
        same = old == new
        notes = []
        if not same:
            notes.append(f"saved under {old.describe()}, resuming under {new.describe()}: resharding on load")
            if old.batch_size != new.batch_size:
                notes.append(
                    f"global batch {old.batch_size} -> {new.batch_size} streams: every stream "
                    f"restarts with empty memory"
                )
        masks = (saved.masks, self.meta.masks)
        if masks[0] != masks[1]:  # a checkpoint from before the key existed was drawn from the streams
            notes.append(f"dropout masks {masks[0]} -> {masks[1]} (train.dropout_masks)")
        if saved.precision != self.meta.precision:
            notes.append(f"precision {saved.precision} -> {self.meta.precision} (from the fp32 masters)")
        return Compatibility(info, same, "; ".join(notes))

    def load(self, step_dir: Path, registry: StateRegistry) -> dict:
        info, same, note = self.check_compatible(step_dir)
        if note:
            self.log(f"[checkpoint] {step_dir.name}: {note}")
        return registry.load(step_dir, self.rank, lambda reader: LoadContext(reader, same, info))
