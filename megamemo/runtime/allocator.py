"""Keep freed host memory for reuse instead of returning it to the kernel (glibc malloc settings).

By default glibc serves large blocks with mmap and returns them with munmap, adapting its threshold to the sizes
it has seen freed. A LaMemo training step on the CPU allocates activations of several sizes (its layers run on
[memory; current] rows), so blocks kept falling back to fresh mmaps: 4k-22k page faults per step (the first
touch of every page), 5-10% of the step, where Transformer-XL's steady state had none. Fixing the mmap
threshold at its maximum (32 MiB on 64-bit) and never trimming the heap keeps freed blocks for the next step:
no faults. The cost is that a process holds its peak heap, as a training process does anyway.

Applied once by the `megamemo` command and the benchmarks; MEGAMEMO_TUNE_MALLOC=0 turns it off. It changes no
number the model computes. Other allocators (jemalloc, tcmalloc via LD_PRELOAD) make it a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)

_applied: bool | None = None


def tune_cpu_allocator() -> bool:
    """Apply the settings above (idempotent). True when glibc took them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("MEGAMEMO_TUNE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied
