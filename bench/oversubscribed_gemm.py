"""What 4 ranks on 2 cores cost a rank's GEMMs beyond time-sharing (issue 25): the rehearsal layer's projections
(bench/calibrate_cpu.py's layer_gemm_rate shapes) in 1, 2 and 4 processes at once, one thread each; per process
the FLOP rate over wall time and over its own CPU time. If time-sharing cost only the core (no cache thrash,
no memory-bus contention), the CPU-time rate stays the one-process rate while the wall rate halves at 4 processes
on 2 cores: steptime's ranks / cores charge. A CPU-time rate below the alone rate would be a term to add.

    flock /tmp/megamemo-cpu.lock python bench/oversubscribed_gemm.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_cpu import LAYER

POINTS = ((1, 64), (2, 128), (4, 256))  # (tp, rows) of DP4/PP4, TP2 x PP2/DP2, TP4 at the rehearsal


def _work(tp: int, rows: int, reps: int, q) -> None:
    torch.set_num_threads(1)
    d, heads, inner = LAYER
    shapes = [(d, 3 * heads // tp), (heads // tp, d), (d, inner // tp), (inner // tp, d)]
    ws = [torch.randn(o, i, requires_grad=True) for i, o in shapes]
    xs = [torch.randn(rows, i, requires_grad=True) for i, _ in shapes]

    def step():
        for w, x in zip(ws, xs, strict=True):
            w.grad = x.grad = None
            F.linear(x, w).sum().backward()

    step()
    flops = reps * sum(3 * 2 * rows * i * o for i, o in shapes)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        step()
    q.put((flops / (time.perf_counter() - t0), flops / (time.process_time() - c0)))


def main() -> None:
    ctx = mp.get_context("spawn")
    for tp, rows in POINTS:
        for n in (1, 2, 4):
            q = ctx.Queue()
            procs = [ctx.Process(target=_work, args=(tp, rows, 6, q)) for _ in range(n)]
            for p in procs:
                p.start()
            got = [q.get() for _ in procs]
            for p in procs:
                p.join()
            print(
                f"tp {tp}, {rows} rows, {n} process(es): GFLOP/s per process over wall "
                + " ".join(f"{w / 1e9:.1f}" for w, _ in got)
                + "; over its CPU time "
                + " ".join(f"{c / 1e9:.1f}" for _, c in got),
                flush=True,
            )


if __name__ == "__main__":
    main()
