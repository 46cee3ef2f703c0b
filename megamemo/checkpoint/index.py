"""The merged piece index of a committed checkpoint, and the coverage check made before it is committed.

Each rank reports the pieces it wrote (pieces.write_pieces: safetensors key -> global name, shape, box, flat,
dtype); rank 0 merges them into one file written with COMMITTED (and listed in it, with its sha256):

    index.json   {"format": "megamemo-piece-index", "version": 1,
                  "files": {"rank_00000.safetensors": {"model/w#0": {"name", "shape", "box", "flat", "dtype"}, ...}}}

A loader then opens this one file instead of every rank file's header (format 3 checkpoints); a checkpoint of
format 2, without it, is read through the headers as before (`open_reader`).

Before COMMITTED, every global tensor must be written exactly once: the boxes its pieces hold tile its shape
without overlap, and within a box the flat fragments (ZeRO partitions) tile the box's flattening. A hole or an
overlap fails the save, naming the tensor and the files.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from megamemo.checkpoint.pieces import Box, PieceError, ShardedReader, as_pair, box_shape, intersect

INDEX_FILE = "index.json"
INDEX_FORMAT = "megamemo-piece-index"


def merge(indices: list[dict]) -> dict:
    """One index document from the ranks' {rank file: {key: description}} reports."""
    files: dict = {}
    for report in indices:
        files.update(report)
    return {"format": INDEX_FORMAT, "version": 1, "files": dict(sorted(files.items()))}


def open_reader(step_dir: Path, error=PieceError) -> ShardedReader:
    """The reader of a checkpoint's pieces: from its merged index when it has one, else from every rank file's
    header (checkpoints of format 2)."""
    step_dir = Path(step_dir)
    path = step_dir / INDEX_FILE
    if not path.is_file():
        return ShardedReader(sorted(step_dir.glob("rank_*.safetensors")))
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable or not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or not isinstance(doc.get("files"), dict):
        raise error(f"{path}: not a megamemo piece index")
    return ShardedReader.from_index(step_dir, doc["files"], path)


# ---- coverage ----------------------------------------------------------------------------------------------
def coverage_problems(merged: dict) -> list[str]:
    """Every global tensor of a merged index written exactly once? -> one line per tensor that is not (a hole or
    an overlap, naming the tensor, the box and the files), empty when all are."""
    by_name: dict[str, list[tuple[Box, tuple[int, int] | None, str, tuple[int, ...]]]] = defaultdict(list)
    for rel, pieces in merged["files"].items():
        for d in pieces.values():
            box = tuple(as_pair(b) for b in d["box"])
            flat = as_pair(d["flat"]) if d["flat"] is not None else None
            by_name[d["name"]].append((box, flat, rel, tuple(int(n) for n in d["shape"])))
    problems = []
    for name in sorted(by_name):
        problem = _tensor_problem(name, by_name[name])
        if problem:
            problems.append(problem)
    return problems


def _tensor_problem(name: str, pieces: list) -> str | None:
    shapes = {p[3] for p in pieces}
    if len(shapes) > 1:
        return f"{name}: pieces disagree on its shape ({sorted(shapes)})"
    shape = shapes.pop()
    by_box: dict[Box, list[tuple[tuple[int, int] | None, str]]] = defaultdict(list)
    for box, flat, rel, _ in pieces:
        by_box[box].append((flat, rel))
    for box, parts in by_box.items():
        problem = _fragments_problem(name, box, parts)
        if problem:
            return problem
    return _boxes_problem(name, shape, {box: sorted({rel for _, rel in parts}) for box, parts in by_box.items()})


def _fragments_problem(name: str, box: Box, parts: list) -> str | None:
    """The pieces of one box: either one whole piece, or flat ranges that tile [0, n)."""
    n = math.prod(box_shape(box))
    ranges = sorted(((0, n) if flat is None else flat, rel) for flat, rel in parts)
    pos = 0
    for (a, b), _rel in ranges:
        if a > pos:
            return f"{name}: values [{pos}, {a}) of box {_show(box)} are written by no rank (a hole)"
        if a < pos:
            files = sorted({r for (x, y), r in ranges if x < pos and y > a})
            return f"{name}: values [{a}, {min(pos, b)}) of box {_show(box)} are written twice ({', '.join(files)})"
        pos = b
    if pos != n:
        return f"{name}: values [{pos}, {n}) of box {_show(box)} are written by no rank (a hole)"
    return None


def _boxes_problem(name: str, shape: tuple[int, ...], boxes: dict[Box, list[str]]) -> str | None:
    """The boxes must not overlap and must add up to the whole tensor. Overlaps are looked for by a sweep along
    the dimension where the boxes start at the most places (pairs that overlap along it are compared)."""
    total = math.prod(shape)
    if not shape:
        return None if len(boxes) == 1 else f"{name}: a scalar written {len(boxes)} times"
    dim = max(range(len(shape)), key=lambda d: len({b[d][0] for b in boxes}))
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[dim]):
        active = [a for a in active if a[dim][1] > box[dim][0]]
        for other in active:
            if intersect(other, box) is not None:
                files = sorted(set(boxes[other]) | set(boxes[box]))
                return f"{name}: boxes {_show(other)} and {_show(box)} overlap (written twice: {', '.join(files)})"
        active.append(box)
    covered = sum(math.prod(box_shape(b)) for b in boxes)
    if covered != total:
        return (
            f"{name}: the pieces cover {covered} of its {total} values {list(shape)} (a hole: a rank's share "
            f"was never written)"
        )
    return None


def _show(box: Box) -> list:
    return [list(b) for b in box]
