"""How the ranks learn a save's outcome: a gloo process group of the checkpointer's own.

Each rank writes its files, then sends rank 0 its outcome - the files with their sizes and sha256 and the pieces
it wrote, or the one line saying which file it could not write - by a gather on this group; rank 0 decides (any
rank's error, a file it cannot see, a hole or an overlap in the pieces: index.py), commits or not, and broadcasts
the verdict, so every rank ends the same save the same way. The group is created once, by every rank, when the
store is made (as torchtitan does for its asynchronous checkpoints): the collectives run in the background
thread of an asynchronous save while the training's own collectives go on in the default group, and gloo runs on
the CPU whatever the training's backend. Its timeout is `checkpoint.commit_timeout_s`: a rank that neither
reports nor dies within it (a hung file system) fails the save on the others.

Why not finalize on the main thread at the next step (Megatron's way): the outcome would then wait for the next
step of the slowest rank, every step would pay a collective asking whether the writes are done, and a synchronous
save would need a second path. Here both kinds of save run the same code, and the training loop only asks, in the
all-reduce it makes each step anyway, whether a save failed (train/loop.py), so that every rank stops at the same
step.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megamemo.checkpoint.index import INDEX_FILE, coverage_problems, merge
from megamemo.checkpoint.state import Snapshot, WriteError, save_snapshot
from megamemo.util.files import file_sha256, write_json_atomic


class Collectives:
    """The few other collectives the store needs (choosing a checkpoint to resume from), over torch.distributed's
    default group when one is up."""

    def __init__(self, barrier: Callable[[], None]):
        self.barrier = barrier

    @staticmethod
    def _dist():
        return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None

    def broadcast(self, obj):
        dist = self._dist()
        if dist is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        dist = self._dist()
        if dist is None:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out


class OutcomeTimeout(RuntimeError):
    """The outcome collective did not complete: a rank did not report within the timeout, or is gone."""


class LocalOutcomes:
    """One process: the outcome is its own."""

    def gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj


class OutcomeGroup:
    """gather to rank 0 and broadcast from it, over a gloo group of its own (collective to create)."""

    def __init__(self, timeout_s: float):
        self.dist, self.timeout_s = dist, timeout_s
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def _call(self, fn):
        try:
            return fn()
        except RuntimeError as e:
            what = "timed out" if "timed out" in str(e).lower() else "failed"
            raise OutcomeTimeout(
                f"the ranks' save outcomes did not all arrive ({what} after at most "
                f"checkpoint.commit_timeout_s={self.timeout_s:g} s: a rank hung or died while "
                f"writing)"
            ) from e

    def gather(self, obj) -> list | None:
        """Rank 0: every rank's obj, by rank; the others: None."""
        out = [None] * self.dist.get_world_size(self.group) if self.rank == 0 else None
        self._call(lambda: self.dist.gather_object(obj, out, dst=0, group=self.group))
        return out

    def broadcast(self, obj):
        box = [obj]
        self._call(lambda: self.dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]


def outcome_channel(world_size: int, timeout_s: float):
    """The group for a run of `world_size` ranks (collective when there are several)."""
    if world_size == 1:
        return LocalOutcomes()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size):
        raise ValueError(f"a checkpoint store of {world_size} ranks needs their process group (or an outcome channel)")
    return OutcomeGroup(timeout_s)


def write_and_report(snap: Snapshot, step: int, step_dir: Path, faults) -> dict:
    """This rank's files written -> its outcome for rank 0: its files and pieces, or the line saying what failed."""
    try:
        written = save_snapshot(
            snap,
            step_dir,
            before_done=lambda: faults.at("save", step),
            before_write=lambda path: faults.write(step, path),
        )
        return {"rank": snap.rank, "error": None, "files": written.files, "index": written.index}
    except Exception as e:  # every failure becomes this rank's one-line outcome
        why = str(e) if isinstance(e, WriteError) else f"failed writing {step_dir}: {type(e).__name__}: {e}"
        return {"rank": snap.rank, "error": f"rank {snap.rank} {why}"}


def first_error(outcomes: list[dict]) -> str | None:
    """The line of the lowest rank that failed (and how many others did), or None."""
    failed = [o for o in outcomes if o.get("error")]
    if not failed:
        return None
    more = f" (and {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
    return failed[0]["error"] + more


def check_and_index(step_dir: Path, outcomes: list[dict]) -> tuple[dict | None, str | None]:
    """Rank 0, every rank having written its files: each reported file is there at its size (a rank that wrote
    elsewhere, off a shared file system, is caught here), every global tensor is covered exactly once, and the
    merged piece index is written. -> ({file: {bytes, sha256}} with the index, None) or (None, the problem)."""
    files = {}
    for o in outcomes:
        for rel, entry in o["files"].items():
            p = Path(step_dir) / rel
            size = p.stat().st_size if p.is_file() else None
            if size != entry["bytes"]:
                return None, (
                    f"rank {o['rank']} reported {p} ({entry['bytes']} bytes) but rank 0 "
                    f"{'cannot see it' if size is None else f'sees {size} bytes'} (not a shared file "
                    f"system?)"
                )
            files[rel] = entry
    merged = merge([o["index"] for o in outcomes])
    holes = coverage_problems(merged)
    if holes:
        more = f" (and {len(holes) - 1} other tensors)" if len(holes) > 1 else ""
        return None, f"the pieces do not cover every tensor exactly once: {holes[0]}{more}"
    path = Path(step_dir) / INDEX_FILE
    write_json_atomic(path, merged)
    files[INDEX_FILE] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return files, None
