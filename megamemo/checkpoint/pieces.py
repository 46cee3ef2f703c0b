"""The layout-free description of training state: every tensor a rank writes is a *piece* of a global tensor.

A piece names its global tensor (`model/layers.0.ff.fc1.weight`, `exp_avg/...`, `memory/ctx.0`), gives the global
shape, the box of it this rank holds (a [start, stop) per dimension) and, for ZeRO's flat partitions, the range of
that box's row-major flattening the rank holds (`flat`). Examples:
    a TP=2 column-parallel fc1.weight [F, d] on tp rank 1:  box [[F/2, F], [0, d]]
    its Adam moment under ZeRO-1 on dp rank 0:              the same box, flat [0, k) (the rank's fragment)
    LaMemo's ctx.0 memory of streams 4-7, heads 0-1:        shape [M, B, n, dh], box [[0,M],[4,8],[0,2],[0,dh]]
[Q;K;V] projections are described in a [3, n*dh, d] view of the single-device [3*n*dh, d] tensor, so that a TP
shard (its heads of Q, K and V) is one box; readers reshape to the model's shape.

Each rank writes its pieces into one safetensors file; the description lives in that file's header metadata
(`megamemo.index`: safetensors key -> name, shape, box, flat), so a reader opens headers only and then reads the
bytes it needs. `ShardedReader.read(name, box, flat)` assembles any box (or flat range of a box) of a global
tensor from whatever pieces the writers held - the same layout (an exact piece: read as is) or another one.
Nothing is unpickled: safetensors files and JSON only.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megamemo.util.errors import MegamemoError

INDEX_KEY = "megamemo.index"
Box = tuple[tuple[int, int], ...]


class PieceError(MegamemoError, ValueError):
    """A description that does not add up (bad box, missing coverage, duplicate piece); names the file."""


@dataclass(frozen=True)
class Piece:
    name: str  # global tensor name
    tensor: torch.Tensor  # box-shaped data, or 1-D when `flat` is set
    shape: tuple[int, ...]  # global shape
    box: Box | None = None  # None: the whole tensor
    flat: tuple[int, int] | None = None  # a [start, stop) range of the box's row-major flattening

    def resolved_box(self) -> Box:
        return self.box if self.box is not None else tuple((0, n) for n in self.shape)


def as_pair(xs) -> tuple[int, int]:
    """A box's (start, end) or a flat range, as ints (ValueError unless exactly two)."""
    lo, hi = (int(x) for x in xs)
    return lo, hi


def full_box(shape) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _rel(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=True))


# ---- writing ---------------------------------------------------------------------------------------------------
def write_pieces(path: Path, pieces: list[Piece], local: dict[str, torch.Tensor] | None = None) -> dict:
    """One safetensors file: the pieces (with their description in the header) and rank-local tensors
    (`local`, e.g. the RNG state: stored under `local/<key>`, not part of any global tensor). Tensors must be CPU
    copies that nothing else shares (the snapshot makes them). -> the header's index, each entry with its
    safetensors dtype too (what the merged index of a committed checkpoint holds: index.py)."""
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    seen: Counter[str] = Counter()
    for p in pieces:
        key = f"{p.name}#{seen[p.name]}"
        seen[p.name] += 1
        box = p.resolved_box()
        want = (p.flat[1] - p.flat[0],) if p.flat is not None else box_shape(box)
        if tuple(p.tensor.shape) != want:
            raise PieceError(
                f"{path}: piece {p.name}: data {list(p.tensor.shape)} does not fit box {box} flat {p.flat}"
            )
        tensors[key] = p.tensor
        index[key] = {
            "name": p.name,
            "shape": list(p.shape),
            "box": [list(b) for b in box],
            "flat": list(p.flat) if p.flat is not None else None,
        }
    for k, t in (local or {}).items():
        tensors[f"local/{k}"] = t
    save_file(tensors, str(path), metadata={INDEX_KEY: json.dumps(index, separators=(",", ":"))})
    return {k: {**d, "dtype": _DTYPE_NAMES[tensors[k].dtype]} for k, d in index.items()}


def spread_writers(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Who of n ranks holding the same tensors writes each one: the largest first, each to the rank with the
    fewest elements so far (ties: the lower rank), names breaking ties between equal sizes - the same answer on
    every rank, so each tensor is written once and the ranks write about as much."""
    load = [0] * n
    out = {}
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(n), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += sizes[name]
    return out


# ---- reading ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    file: Path
    key: str
    shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None
    dtype: str

    @property
    def span(self) -> tuple[int, int]:
        """The flat range of a ZeRO fragment (an entry that has one)."""
        assert self.flat is not None, f"{self.file}: {self.key} is not a flat fragment"
        return self.flat


def read_local(path: Path) -> dict[str, torch.Tensor]:
    """The rank-local tensors of one rank file."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k[len("local/") :]: f.get_tensor(k) for k in f.keys() if k.startswith("local/")}
    except Exception as e:  # safetensors errors, named by file
        raise PieceError(f"{path}: unreadable rank file ({type(e).__name__}: {e})") from None


def _header_index(path: Path) -> dict:
    """A rank file's own description of its pieces (with their dtypes), from its header."""
    try:
        with safe_open(str(path), "pt") as f:
            index = json.loads((f.metadata() or {}).get(INDEX_KEY, "{}"))
            return {k: {**d, "dtype": str(f.get_slice(k).get_dtype())} for k, d in index.items()}
    except Exception as e:  # safetensors / JSON errors, named by file
        raise PieceError(f"{path}: unreadable rank file ({type(e).__name__}: {e})") from None


class ShardedReader:
    """All pieces of a checkpoint's rank files, by global name (headers only until something is read)."""

    def __init__(self, files: list[Path]):
        """From the rank files' headers (one open per file: a checkpoint of format 2, or any set of files)."""
        self.entries: dict[str, list[_Entry]] = defaultdict(list)
        self._listed: dict[Path, tuple[Path, dict]] = {}  # from an index: each file's pieces, checked at first read
        for path in files:
            self._add(Path(path), _header_index(Path(path)))
        self._check_all()

    @classmethod
    def from_index(cls, directory: Path, index: dict[str, dict], where: Path) -> ShardedReader:
        """From a merged index {rank file: {key: name, shape, box, flat, dtype}} (index.py): no header opened."""
        self = cls.__new__(cls)
        self.entries, self._listed = defaultdict(list), {}
        try:
            for rel, pieces in index.items():
                self._add(Path(directory) / rel, pieces)
                self._listed[Path(directory) / rel] = (Path(where), pieces)
        except (KeyError, TypeError, ValueError) as e:
            raise PieceError(f"{where}: malformed piece index ({type(e).__name__}: {e})") from None
        self._check_all()
        return self

    def _add(self, path: Path, index: dict) -> None:
        for key, d in index.items():
            e = _Entry(
                path,
                key,
                tuple(int(n) for n in d["shape"]),
                tuple(as_pair(b) for b in d["box"]),
                as_pair(d["flat"]) if d["flat"] is not None else None,
                str(d["dtype"]),
            )
            self._check(e)
            self.entries[d["name"]].append(e)

    def _check_all(self) -> None:
        for name, es in self.entries.items():
            if len({(e.shape, e.dtype) for e in es}) > 1:
                raise PieceError(
                    f"{es[0].file}: {name}: pieces disagree on shape or dtype "
                    f"({sorted({(e.shape, e.dtype) for e in es})})"
                )
            seen: dict[tuple, Path] = {}
            for e in es:
                if (e.box, e.flat) in seen:
                    raise PieceError(
                        f"{e.file}: {name}: box {e.box} flat {e.flat} written twice (also in "
                        f"{seen[(e.box, e.flat)].name})"
                    )
                seen[(e.box, e.flat)] = e.file

    @staticmethod
    def _check(e: _Entry) -> None:
        ok = len(e.box) == len(e.shape) and all(
            0 <= a < b <= n or a == b == 0 == n for (a, b), n in zip(e.box, e.shape, strict=True)
        )
        if ok and e.flat is not None:
            ok = 0 <= e.flat[0] < e.flat[1] <= math.prod(box_shape(e.box))
        if not ok:
            raise PieceError(f"{e.file}: piece {e.key}: box {e.box} flat {e.flat} outside shape {list(e.shape)}")

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.entries if n.startswith(prefix))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries(name)[0].shape

    def _entries(self, name: str) -> list[_Entry]:
        if name not in self.entries:
            raise PieceError(f"no tensor {name!r} in the checkpoint")
        return self.entries[name]

    def read(self, name: str, box: Box | None = None, flat: tuple[int, int] | None = None) -> torch.Tensor:
        """The `box` of global tensor `name` (whole when None), or the `flat` range of that box's flattening."""
        es = self._entries(name)
        box = full_box(es[0].shape) if box is None else tuple(as_pair(b) for b in box)
        n = math.prod(box_shape(box))
        want = None if flat is None or tuple(flat) == (0, n) else tuple(flat)
        for e in es:  # the same layout wrote exactly this piece
            have = None if e.flat is None or e.flat == (0, n) else e.flat
            if e.box == box and have == want:
                t = self._load(e)
                return t.reshape(-1) if flat is not None else t.reshape(box_shape(box))
        out = self._assemble(name, es, box)
        return out.reshape(-1)[flat[0] : flat[1]].clone() if flat is not None else out

    def _load(self, e: _Entry, index=None) -> torch.Tensor:
        if e.file in self._listed:  # the first read of a file the index describes: does it agree?
            where, listed = self._listed.pop(e.file)
            if _header_index(e.file) != listed:
                raise PieceError(
                    f"{e.file}: its pieces differ from the ones {where} lists for it (the file was "
                    f"replaced after the save?)"
                )
        try:
            with safe_open(str(e.file), "pt") as f:
                return f.get_tensor(e.key) if index is None else f.get_slice(e.key)[index]
        except Exception as err:  # safetensors errors, named by file
            raise PieceError(f"{e.file}: unreadable rank file ({type(err).__name__}: {err})") from None

    def _assemble(self, name: str, es: list[_Entry], box: Box) -> torch.Tensor:
        by_box: dict[Box, list[_Entry]] = defaultdict(list)
        for e in es:
            by_box[e.box].append(e)
        out = torch.empty(box_shape(box), dtype=_torch_dtype(es[0].dtype))
        covered = 0
        for stored, parts in by_box.items():
            inter = intersect(stored, box)
            if inter is None:
                continue
            if parts[0].flat is None:
                data = self._load(parts[0], _rel(inter, stored))
            else:
                data = self._join_flat(name, stored, parts)[_rel(inter, stored)]
            out[_rel(inter, box)] = data
            covered += math.prod(box_shape(inter))
        if covered != math.prod(box_shape(box)):
            files = sorted({str(e.file.name) for e in es})
            raise PieceError(
                f"{es[0].file.parent}: {name}: the pieces in {files} cover {covered} of the "
                f"{math.prod(box_shape(box))} values of box {list(map(list, box))} (shards missing "
                f"or overlapping)"
            )
        return out

    def _join_flat(self, name: str, stored: Box, parts: list[_Entry]) -> torch.Tensor:
        """A stored box from its flat fragments (the ZeRO partitions of every data-parallel rank)."""
        parts = sorted(parts, key=lambda e: e.span[0])
        pos = 0
        for e in parts:
            if e.span[0] != pos:
                raise PieceError(
                    f"{e.file}: {name}: box {stored}: fragments leave values [{pos}, {e.span[0]}) "
                    f"unwritten or overlap (a ZeRO partition file missing?)"
                )
            pos = e.span[1]
        if pos != math.prod(box_shape(stored)):
            raise PieceError(
                f"{parts[-1].file}: {name}: box {stored}: fragments end at {pos} of "
                f"{math.prod(box_shape(stored))} values (a ZeRO partition file missing?)"
            )
        return torch.cat([self._load(e) for e in parts]).view(box_shape(stored))


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}  # safetensors' names, as get_slice().get_dtype() gives them


def _torch_dtype(name: str) -> torch.dtype:
    if name in _DTYPES:
        return _DTYPES[name]
    return getattr(torch, name.replace("torch.", ""))
