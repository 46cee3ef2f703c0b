"""What a checkpoint keeps of the replica check of its step (train/numerics.py ReplicaCheck makes it; every
rank_<r>.json holds it as "replicas"): each rank's fingerprints, in the JSON form checkpoints have always held."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankFingerprints:
    """One rank's fingerprints: Adam's step, the LR and the loss scale (scalars), and either its weights of each
    ZeRO 1/2 partition (partitions) or, under ZeRO 0, its weights and Adam's moments (state)."""

    node: str  # the host the rank ran on
    scalars: int
    partitions: tuple[int, ...] | None = None
    state: int | None = None

    @classmethod
    def from_record(cls, record: dict) -> RankFingerprints:
        parts = record.get("partitions")
        return cls(record["node"], record["scalars"], None if parts is None else tuple(parts), record.get("state"))

    def record(self) -> dict:
        """{"node", "scalars", "partitions" or "state"}: what is None is left out."""
        out: dict = {"node": self.node, "scalars": self.scalars}
        if self.partitions is not None:
            out["partitions"] = list(self.partitions)
        if self.state is not None:
            out["state"] = self.state
        return out


@dataclass(frozen=True)
class ReplicaRecord:
    """The replicas agreed after `step` (a disagreement raises, so a record is of an agreement): every rank's
    fingerprints, by global rank, and the check's time."""

    step: int
    seconds: float
    ranks: tuple[tuple[int, RankFingerprints], ...]  # (global rank, its fingerprints), by rank

    @classmethod
    def from_record(cls, record: dict) -> ReplicaRecord:
        """A rank file's "replicas"."""
        ranks = sorted((int(r), RankFingerprints.from_record(fp)) for r, fp in record["ranks"].items())
        return cls(record["step"], record["seconds"], tuple(ranks))

    def record(self) -> dict:
        """The rank file's JSON form: {"step", "agreed": true, "seconds", "ranks": {"<rank>": fingerprints}}."""
        ranks = {str(r): fp.record() for r, fp in self.ranks}
        return {"step": self.step, "agreed": True, "seconds": self.seconds, "ranks": ranks}
