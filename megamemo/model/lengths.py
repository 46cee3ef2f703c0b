"""The lengths a model runs a segment at (Lengths): the segment (tgt), the memory it keeps (mem), the relative
positions' clamp (clamp) and whether every query sees as many keys (same_length). None means the model's own
value (its ModelConfig's); `resolve` is the one place that says so."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class Lengths:
    tgt: int | None = None
    mem: int | None = None
    clamp: int | None = None
    same_length: bool | None = None

    def resolve(self, cfg: ModelConfig) -> Lengths:
        """Every None replaced by the model's value (a model without memory keeps none whatever mem says: lm.py)."""
        return Lengths(
            cfg.tgt_len if self.tgt is None else self.tgt,
            cfg.mem_len if self.mem is None else self.mem,
            cfg.clamp_len if self.clamp is None else self.clamp,
            cfg.same_length if self.same_length is None else self.same_length,
        )

    def record(self) -> dict:
        """The metrics' form (an evaluation record's tgt_len, mem_len, clamp_len, same_length)."""
        return {"tgt_len": self.tgt, "mem_len": self.mem, "clamp_len": self.clamp, "same_length": self.same_length}
