"""Where a rank sits in its run's layout (RankLayout, built once at start-up by train/build.py) and the run-wide
part of it a checkpoint's marker records (RunLayout). Both are frozen records; the checkpoint files keep the JSON
they always held (the marker's "layout": RunLayout.record(); rank_<r>.json's "layout": RankLayout.record()), and
RunLayout.from_record reads a marker of any version (a key it lacks is None)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

Columns = tuple[int, int]


@dataclass(frozen=True)
class RunLayout:
    """The run-wide layout a checkpoint was written under (its marker's "layout"): a resume under another one
    reshards on load, and another global batch (batch_size) restarts every stream's memory."""

    world_size: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    batch_size: int | None = None  # the global batch, in streams
    grad_accum: int | None = None
    zero_stage: int | None = None

    @classmethod
    def from_record(cls, record: dict | None) -> RunLayout:
        record = record or {}
        return cls(**{f.name: record.get(f.name) for f in fields(cls)})

    def record(self) -> dict:
        """The marker's JSON form (the keys this run sets)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        return (
            f"tp={self.tp or 1} pp={self.pp or 1} dp={self.dp} ({self.world_size} ranks, "
            f"grad_accum {self.grad_accum or 1}, batch {self.batch_size}, ZeRO {self.zero_stage})"
        )


@dataclass(frozen=True)
class RankLayout:
    """This rank's coordinates in the TP x PP x DP grid and the global columns (streams) of each of its
    micro-batches, with the run-wide layout (`run`). `single` is one process's."""

    micro_batches: tuple[Columns, ...]  # global [first, end) columns of each micro-batch of this rank
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp: int = 1
    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    batch_size: int | None = None
    zero_stage: int | None = None

    @classmethod
    def single(cls, micro_batch: int, n_micro: int) -> RankLayout:
        """One process holding every stream: micro-batch k is columns [k b, (k + 1) b)."""
        return cls(tuple((k * micro_batch, (k + 1) * micro_batch) for k in range(n_micro)))

    @property
    def columns(self) -> Columns:
        """This rank's global columns, all its micro-batches together."""
        return self.micro_batches[0][0], self.micro_batches[-1][1]

    @property
    def micro_batch(self) -> int:
        """Streams per micro-batch."""
        return self.micro_batches[0][1] - self.micro_batches[0][0]

    @property
    def grad_accum(self) -> int:
        return len(self.micro_batches)

    @property
    def run(self) -> RunLayout:
        return RunLayout(self.world_size, self.dp, self.tp, self.pp, self.batch_size, self.grad_accum, self.zero_stage)

    @property
    def writes_probe(self) -> bool:
        """The rank that writes the conversion probe: dp 0, tp 0, the last stage."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == self.pp - 1

    def record(self) -> dict:
        """rank_<r>.json's "layout" (the form checkpoints have always held)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "dp_rank": self.dp_rank,
            "dp": self.dp,
            "tp_rank": self.tp_rank,
            "tp": self.tp,
            "pp_rank": self.pp_rank,
            "pp": self.pp,
            "columns": list(self.columns),
            "micro_batches": [list(c) for c in self.micro_batches],
        }


@dataclass(frozen=True)
class RunMeta:
    """What a run records in every checkpoint's marker and checks on resume: its model config (ModelConfig.to_dict)
    and fingerprint, its layout, precision and dropout masks (train.dropout_masks)."""

    model: dict
    model_fingerprint: str | None = None
    layout: RunLayout = RunLayout()
    precision: str | None = None
    dropout_masks: str | None = None  # None: not recorded (a checkpoint from before the key existed)

    @classmethod
    def from_record(cls, record: dict) -> RunMeta:
        """A marker's fields (of any version: what it lacks is None)."""
        return cls(
            record.get("model") or {},
            record.get("model_fingerprint"),
            RunLayout.from_record(record.get("layout")),
            record.get("precision"),
            record.get("dropout_masks"),
        )

    @property
    def masks(self) -> str:
        """How the run draws its dropout masks: a checkpoint that does not say drew them from the streams."""
        return self.dropout_masks or "stream"

    def record(self) -> dict:
        """The marker's fields (what is None is left out, as the writers of older checkpoints did)."""
        out = {
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "layout": self.layout.record(),
            "precision": self.precision,
            "dropout_masks": self.dropout_masks,
        }
        return {k: v for k, v in out.items() if v is not None}


class Compatibility(NamedTuple):
    """CheckpointStore.check_compatible's answer: the checkpoint's marker (the file as read), whether it was saved
    under this run's layout, and a line saying what changed ("" when nothing did)."""

    marker: dict
    same_layout: bool
    note: str

    @property
    def step(self) -> int:
        return int(self.marker["step"])
