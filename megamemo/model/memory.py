"""Recurrent memory as a value: passed into `forward`, returned from it, held by the caller.

Every tensor is time-major [M, B, ...] (batch on dim 1), so selecting or concatenating streams is the same
operation for every kind of memory:
  * Transformer-XL: `hid.{l}` [M, B, d] = the input of layer l at previous segments;
  * LaMemo: `emb` [M, B, d] the embedding FIFO, `ctx.{l}` [M, B, n, dh] the per-head context caches and
    `lse.{l}` [M, B, n] their log-normalisers, always fp32;
  * Transformer+RPE: nothing.
`ctx.*`/`lse.*` are per head: tensor parallelism shards them on dim 2 with the heads.
"""

from __future__ import annotations

import torch


def xl_update(old: torch.Tensor | None, new: torch.Tensor, mem_len: int) -> torch.Tensor:
    """The Transformer-XL memory update, the one place it is written: [old; new] along time (dim 0), of which the
    last mem_len rows are kept, detached. The new rows take the old memory's dtype (a memory stays in the dtype it
    was made or loaded in); without an old memory they are kept as they come. Used for XL's per-layer hidden states
    and LaMemo's embedding FIFO, by the single-device model (lm.py) and the pipeline stages (parallel/pipeline.py);
    TRAMS runs the model's own forward, so it uses it too."""
    cat = new if old is None else torch.cat([old, new.detach().to(old.dtype)], 0)
    return cat[max(0, cat.size(0) - mem_len) :].detach()


class Memory:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, batch_size: int | None = None):
        self.tensors = dict(tensors or {})
        sizes = {(t.size(0), t.size(1)) for t in self.tensors.values()}
        if len(sizes) > 1:
            raise ValueError(
                f"memory tensors disagree on [M, B]: { {k: tuple(t.shape) for k, t in self.tensors.items()} }"
            )
        self._mb = sizes.pop() if sizes else (0, batch_size)

    # ---- shape -------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._mb[0]

    @property
    def batch_size(self) -> int | None:
        return self._mb[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str):
        return self.tensors.get(name)

    def __repr__(self):
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Memory(M={self.length}, B={self.batch_size}, {shapes})"

    # ---- streams -----------------------------------------------------------------------------------------
    def select_batch(self, index) -> Memory:
        """The memory of some streams (batch columns): index is a slice or a LongTensor of columns."""
        if isinstance(index, slice):
            out = {k: t[:, index] for k, t in self.tensors.items()}
            bs = len(range(*index.indices(self.batch_size or 0)))
        else:
            index = torch.as_tensor(index, dtype=torch.long)
            out = {k: t.index_select(1, index.to(t.device)) for k, t in self.tensors.items()}
            bs = int(index.numel())
        return Memory(out, batch_size=bs)

    def detach(self) -> Memory:
        return Memory({k: t.detach() for k, t in self.tensors.items()}, batch_size=self.batch_size)

    def to(self, *args, **kwargs) -> Memory:
        return Memory({k: t.to(*args, **kwargs) for k, t in self.tensors.items()}, batch_size=self.batch_size)

    # ---- serialisation -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        d = {k: t.detach().clone() for k, t in self.tensors.items()}
        d["__batch_size__"] = torch.tensor(-1 if self.batch_size is None else self.batch_size)
        return d

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> Memory:
        d = dict(d)
        bs = int(d.pop("__batch_size__", torch.tensor(-1)))
        return cls(d, batch_size=None if bs < 0 else bs)

    def equal(self, other: Memory) -> bool:
        return (
            self.tensors.keys() == other.tensors.keys()
            and self.batch_size == other.batch_size
            and all(torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors)
        )
