"""The host buffers a rank's checkpoint snapshot is copied into, kept from one save to the next.

The copy to host memory is the part of a save the training step waits for. A fresh CPU tensor per piece and save
faults its pages in every time (glibc hands tensors above its 32 MiB mmap threshold back to the OS when they are
freed, so the next save's copies land in new pages), and from a GPU a copy into pageable memory goes through a
bounce buffer, synchronously. So each piece gets a buffer of its own that the next save reuses (same shape and
dtype; else a new one): pinned (page-locked) when the source is on a CUDA device, so the copies run by DMA,
non-blocking, with one synchronize at the end; a plain one on the CPU, where pinning buys nothing.

The cost: the buffers stay allocated between saves (host memory the size of the rank's share of a checkpoint).
A snapshot's tensors are valid until the registry's next snapshot; the store waits for the previous save's write
before it takes the next one.
"""

from __future__ import annotations

import torch


class Staging:
    def __init__(self):
        self.buffers: dict[object, torch.Tensor] = {}
        self._used: set = set()
        self._pending_cuda = False

    def copy(self, key, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` in the buffer kept under `key` (contiguous, sharing nothing with `t`)."""
        t = t.detach()
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self.buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        self._pending_cuda |= t.is_cuda
        self._used.add(key)
        return buf

    def done(self) -> None:
        """After the snapshot's copies: wait for the asynchronous ones (CUDA) and drop the buffers no piece used
        this time (memory that changed shape, a layout's pieces that are gone)."""
        if self._pending_cuda:
            torch.cuda.synchronize()
            self._pending_cuda = False
        for key in set(self.buffers) - self._used:
            del self.buffers[key]
        self._used = set()
