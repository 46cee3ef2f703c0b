"""Calibration of megamemo/plan/steptime.py's "cpu" device on this machine: one process's GEMM rate (one thread, fp32)
by the narrowest dimension of the product (alone and with the run's other ranks computing), its optimizer's time
per parameter, a layer's host overhead, fresh-page and memory fill rates, and gloo's all-reduce, all-gather and
p2p latency and bandwidth on loopback with 2 and 4 processes (the rehearsal's group sizes).

    flock /tmp/megamemo-cpu.lock python bench/calibrate_cpu.py [--d-model 2048] [--repeat 3]

GEMMs: [T, d] x [d, n] forward and its two backward products (x.grad, w.grad), the shapes of a layer's dense
projections, for T (tokens per micro-batch) and n (a rank's share of a projection's width); the rate is the
median of --repeat timings through 8 different weights (no weight stays in cache), tabulated by min(T, n); with
--concurrent also in --ranks processes at once (their ratio: how much slower a rank computes while the others
compute too; without it steptime takes ranks / cores). Collectives: the median time of all-reduce, all-gather (into a
tensor, as DeepSpeed's ZeRO gathers parameters) and send/recv between two ranks of 4 KiB to 256 MiB fp32 tensors,
fitted as latency + bytes / bandwidth (least squares) with the algorithm's factor 2 (n-1)/n on the bytes for the
all-reduce. Also (issue 25) the rate of the rehearsal layer's own projections by tp and rows (layer_gemm_rate,
LAYER_POINTS: what steptime uses for that layer instead of the width table) and DeepSpeed's ZeRO 1 work around
a step per parameter held and owned (zero_step_seconds_per_param), and its gradient reduction per parameter held
beyond the all-reduce at dp 2 and 4 (the same engine in 2 and 4 processes). The JSON line printed last is
devices.CPU_CALIBRATION's form.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamemo.runtime.dist import free_port

SIZES = [2**k for k in range(10, 25, 2)]  # fp32 elements: 4 KiB .. 64 MiB (and 256 MiB)


# the clock timings are read from: wall time here (alone on the machine); tests/plan/test_plan_measured.py reads this
# process's CPU time instead, comparable with its runs' cpu_s however busy the machine is
CLOCK = time.perf_counter


def _median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def gemm_rates(d: int, repeat: int, widths=None, layers: int = 8) -> dict[int, float]:
    """min(T, n) -> FLOP/s of a forward + backward dense projection (3 products of 2 T d n FLOPs) through `layers`
    different weights in turn (a model's weights do not stay in cache between layers: this machine's L3 is 32 MiB,
    one [2048, 4096] fp32 weight is 32 MiB); `widths`: only the shapes whose min(T, n) is one of them."""
    torch.set_num_threads(1)
    by_width: dict[int, list[float]] = {}
    for t in (32, 64, 128, 256, 512, 1024):
        for n in (128, 256, 512, 1024, 2048, 4096):
            if widths and min(t, n) not in widths:
                continue
            ws = [torch.randn(d, n) for _ in range(layers)]
            x, g = torch.randn(t, d), torch.randn(t, n)

            def step(ws=ws, x=x, g=g):  # this iteration's tensors, bound
                for w in ws:
                    x @ w
                    g @ w.T
                    x.T @ g

            s = _median_time(step, repeat)
            by_width.setdefault(min(t, n), []).append(3 * 2 * t * d * n * layers / s)
    return {w: statistics.median(r) for w, r in sorted(by_width.items())}


def layer_gemm_rate(d_model: int, heads_dim: int, d_inner: int, tp: int, rows: int, repeat: int) -> float:
    """FLOP/s of one rank's share of a layer's dense projections, forward + backward through autograd as the
    model runs them (F.linear with [out, in] weights): [Q;K;V] d -> 3 H/tp, o_net H/tp -> d, the feed-forward
    d -> F/tp -> d, over `rows` rows (tokens of a micro-batch incl. LaMemo's memory rows), one thread. The
    width table above misses what these shapes cost: its median over n is carried by narrow weights that stay
    in cache, while a layer's weights are 16-64 MiB each (this machine's L3: 32 MiB)."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    shapes = [
        (d_model, 3 * heads_dim // tp),
        (heads_dim // tp, d_model),
        (d_model, d_inner // tp),
        (d_inner // tp, d_model),
    ]
    ws = [torch.randn(o, i, requires_grad=True) for i, o in shapes]
    xs = [torch.randn(rows, i, requires_grad=True) for i, _ in shapes]
    gs = [torch.randn(rows, o) for _, o in shapes]

    def step():
        for w, x, g in zip(ws, xs, gs, strict=True):
            w.grad = x.grad = None
            F.linear(x, w).backward(g)

    return sum(3 * 2 * rows * i * o for i, o in shapes) / _median_time(step, repeat)


def _gemm_worker(rank: int, d: int, repeat: int, widths, out: dict):
    out[rank] = gemm_rates(d, repeat, widths)


def concurrent_gemm_rates(procs: int, d: int, repeat: int, widths=None) -> dict[int, float]:
    """The same table measured in `procs` processes at once (the ranks of a run share the cores and the memory
    bus): each width's median over the processes of their per-process rate."""
    out = mp.Manager().dict()
    mp.start_processes(_gemm_worker, args=(d, repeat, widths, out), nprocs=procs, join=True, start_method="spawn")
    return {w: statistics.median(out[r][w] for r in range(procs)) for w in out[0]}


def optimizer_seconds_per_param(repeat: int) -> float:
    """torch.optim.Adam's step as megamemo makes it (optim.fused, the default: torch's fused kernel) over 16 M
    fp32 parameters, per parameter."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.randn(16 * 2**20))
    p.grad = torch.randn_like(p)
    opt = torch.optim.Adam([p], lr=1e-4, fused=True)
    return _median_time(opt.step, repeat) / p.numel()


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = a + bytes / bw -> (latency a, bandwidth bw)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(s for _, s in points) / n
    slope = sum((b - mx) * (s - my) for b, s in points) / sum((b - mx) ** 2 for b, _ in points)
    return max(my - slope * mx, 0.0), 1 / slope


def _worker(rank: int, world: int, port: int, repeat: int, out: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ar, ag, p2p = [], [], []
    for n in SIZES + [2**26]:
        t = torch.ones(n)
        dist.barrier()
        s = _median_time(lambda t=t: dist.all_reduce(t), repeat)
        ar.append((2 * (world - 1) / world * 4 * n, s))
        shard, full = torch.ones(n // world), torch.empty(n // world * world)
        dist.barrier()
        s = _median_time(lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard), repeat)
        ag.append(((world - 1) / world * 4 * n, s))
        if world == 2:

            def pingpong(t=t):
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)

            dist.barrier()
            p2p.append((4 * n, _median_time(pingpong, repeat) / 2))
    if rank == 0:
        out[world] = {
            "allreduce": _fit(ar),
            "allreduce_points": ar,
            "allgather": _fit(ag),
            "allgather_points": ag,
            "p2p": _fit(p2p) if p2p else None,
        }
    dist.destroy_process_group()


def _zero_worker(rank: int, world: int, port: int, repeat: int, out: dict, weights: int = 8):
    """DeepSpeed's ZeRO 1 engine as megamemo builds it (train/engine.py: fp32, fused Adam, clipping) in `world`
    processes (dp = world), over `weights` [2048, 2048] weights (8: 33.6 M parameters, one bucket) fed 8 rows, so
    their GEMMs are small next to DeepSpeed's per-parameter work. Per parameter: `held`, what the backward at the
    accumulation boundary adds to a plain backward beyond the gradient all-reduce itself (timed here on a tensor
    of the bucket's size and subtracted: steptime counts it as dp_comm) - the gradients copied into the reduction
    bucket, averaged, at dp > 1 sliced by owning rank and flattened into a fresh tensor for the all-reduce
    (stage_1_and_2.py's average_tensor / allreduce_and_scatter), copied back into the rank's partition (fresh
    pages, faulted in); `owned`, the step at dp 1 (the partition's norm, clipping, Adam, the master copied back).
    Every phase starts behind a barrier, so the `world` processes run it at once, sharing the cores as a run's
    data-parallel ranks do."""
    import deepspeed

    from megamemo.train.config import load
    from megamemo.train.engine import Engine

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo", verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(weights)])
    plain = torch.nn.Sequential(*[torch.nn.Linear(1, 1, bias=False) for _ in range(weights)])
    for mine, theirs in zip(
        plain, model, strict=True
    ):  # the same weights' memory, leaves of their own (no engine hooks)
        mine.weight = torch.nn.Parameter(theirs.weight.detach())
    params = sum(p.numel() for p in model.parameters())
    cfg = load(None, ["model.variant=lamemo", "train.grad_accum=1", "parallel.tp=1", "parallel.pp=1"])
    engine = Engine(cfg, model, micro_batch=1, dp=world)
    x = torch.randn(8, 2048)
    bucket = torch.ones(params)
    times = {"plain": [], "backward": [], "step": [], "allreduce": []}
    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        plain(x).square().mean().backward()
        plain.zero_grad(set_to_none=True)
        plain_s = time.perf_counter() - t0
        dist.barrier()
        t1 = time.perf_counter()
        engine.backward(engine.forward(x).square().mean())
        t2 = time.perf_counter()
        engine.micro_step()
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        if world > 1:
            dist.all_reduce(bucket)
        t5 = time.perf_counter()
        if i:  # the first fills DeepSpeed's buffers
            times["plain"].append(plain_s)
            times["backward"].append(t2 - t1)
            times["step"].append(t3 - t2)
            times["allreduce"].append(t5 - t4)
    med = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        out[world] = (max(0.0, med["backward"] - med["plain"] - med["allreduce"]) / params, med["step"] / params)


def zero_step_seconds_per_param(repeat: int, world: int = 1, weights: int = 8) -> tuple[float, float]:
    """(held, owned) seconds per parameter of DeepSpeed's ZeRO 1 work around a step at dp = world, wall time of
    one of `world` processes running it at once (see _zero_worker)."""
    out = mp.Manager().dict()
    mp.start_processes(
        _zero_worker,
        args=(world, free_port(), max(repeat, 3), out, weights),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return out[world]


def layer_overhead_seconds(repeat: int) -> float:
    """Host time of one LaMemo layer's forward + backward whatever its size: a tiny model (d_model 16, one stream)
    with 6 and with 2 layers, the difference over 4 (the embedding and loss cancel)."""
    from megamemo.kernels import apply_kernels
    from megamemo.model import MemTransformerLM, ModelConfig

    torch.set_num_threads(1)
    times = {}
    for n in (2, 6):
        cfg = ModelConfig(
            variant="lamemo",
            n_token=16,
            n_layer=n,
            d_model=16,
            n_head=2,
            d_head=8,
            d_inner=32,
            dropout=0.0,
            tgt_len=32,
            mem_len=32,
        )
        model = MemTransformerLM(cfg).train()
        apply_kernels(model, "auto", "cpu")  # as `megamemo train` on this CPU
        x = torch.randint(0, 16, (32, 1))
        _, mem = model(x, x)

        def step(model=model, x=x, mem=mem):  # this iteration's model, bound
            nll, _ = model(x, x, mem)
            nll.mean().backward()

        times[n] = _median_time(step, max(repeat, 5))
    return (times[6] - times[2]) / 4


def first_touch_and_memory_rates() -> tuple[float, float]:
    """(bytes/s filling a new 1 GiB tensor, bytes/s filling it again), one thread, median of 3."""
    torch.set_num_threads(1)
    n = 2**28
    reused = torch.empty(n)
    reused.fill_(0.0)

    def fresh():
        torch.empty(n).fill_(1.0)

    return 4 * n / _median_time(fresh, 3), 4 * n / _median_time(lambda: reused.fill_(1.0), 3)


LAYER = (2048, 2048, 8192)  # the rehearsal's layer (d_model, heads x d_head, d_inner): lamemo-1.3b's
LAYER_POINTS = [(tp, rows) for tp in (1, 2, 4) for rows in (64, 128, 256)]  # its layouts on 4 ranks (rows: 64 a stream)
# the sizes ZeRO's reduction is measured at, in [2048, 2048] weights: about 1/4 and 1/2 of the rehearsal's 0.22 B
# parameters, what a rank of its TP2 and TP4/PP layouts holds (at dp 4 on 2 cores the cost per parameter grows with
# size: 8.6-10.9 ns at 54.5 M, 9.6-15.6 at 109 M). Not all of it: 4 processes of this benchmark holding 218 M
# each (5-6 GB apiece: the engine's state, the plain model's gradients, the all-reduce's own bucket) fill this
# machine's memory - the OOM killer ended one, and the three that finished gave 21.5, 32.3 and 33.0 ns, which
# predicted DP4's step 40% slow (runs/plan_vs_step_f): the figure of reclaim, not of the run. Larger sizes take
# the largest measured figure (devices.Device.reduce_rate).
ZERO_REDUCE_WEIGHTS = (13, 26)


def calibrate(d_model: int = 2048, repeat: int = 3, ranks: int = 4, concurrent: bool = False, log=print) -> dict:
    """Measure everything and return the calibration (devices.CPU_CALIBRATION's form)."""
    log(
        f"cores: {os.cpu_count()}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    rates = gemm_rates(d_model, repeat)
    log(
        "GEMM rate (one thread, fp32, fwd+bwd of [T, d] x [d, n]) by min(T, n): "
        + ", ".join(f"{w}: {r / 1e9:.1f}" for w, r in rates.items())
        + " GFLOP/s"
    )
    shared = concurrent_gemm_rates(ranks, d_model, repeat) if concurrent else {}
    if shared:
        log(
            f"the same in {ranks} processes at once, per process: "
            + ", ".join(f"{w}: {r / 1e9:.1f}" for w, r in shared.items())
            + " GFLOP/s"
        )
    layer = {f"{tp}x{rows}": layer_gemm_rate(*LAYER, tp, rows, repeat) for tp, rows in LAYER_POINTS}
    log(
        f"a {LAYER} layer's projections (fwd+bwd through autograd) by tp x rows: "
        + ", ".join(f"{k}: {r / 1e9:.1f}" for k, r in layer.items())
        + " GFLOP/s"
    )
    zero_held, zero_owned = zero_step_seconds_per_param(repeat)
    log(
        f"DeepSpeed ZeRO 1 around a step: {zero_held * 1e9:.2f} ns per parameter held (reduction copies), "
        f"{zero_owned * 1e9:.2f} ns per parameter owned (norm, clip, Adam, copy back)"
    )
    zero_reduce = {}
    for dp in (2, 4):
        for w in ZERO_REDUCE_WEIGHTS:
            try:
                zero_reduce.setdefault(dp, {})[w * 2048 * 2048] = zero_step_seconds_per_param(repeat, dp, w)[0]
            except mp.ProcessExitedException as e:  # e.g. the OOM killer: the sizes measured stand
                log(f"ZeRO's reduction at dp {dp}, {w * 2048 * 2048 / 1e6:.1f} M parameters: not measured ({e})")
    log(
        "DeepSpeed ZeRO 1's gradient reduction beyond its all-reduce, dp processes at once, by parameters held: "
        + "; ".join(
            f"dp {dp}: " + ", ".join(f"{n / 1e6:.1f} M {s * 1e9:.2f} ns" for n, s in by.items())
            for dp, by in zero_reduce.items()
        )
        + " per parameter held"
    )
    opt = optimizer_seconds_per_param(repeat)
    fresh, mem = first_touch_and_memory_rates()
    overhead = layer_overhead_seconds(repeat)
    log(f"a layer's forward + backward at d_model 16 (host overhead): {overhead * 1e3:.2f} ms")
    log(
        f"Adam step: {opt * 1e9:.2f} ns per parameter; fill of fresh pages {fresh / 1e9:.2f} GB/s, of reused "
        f"memory {mem / 1e9:.2f} GB/s"
    )
    comm = mp.Manager().dict()
    for world in (2, 4):
        mp.start_processes(
            _worker, args=(world, free_port(), repeat, comm), nprocs=world, join=True, start_method="spawn"
        )
        for op, counted in (("allreduce", "2 (n-1)/n"), ("allgather", "(n-1)/n of the gathered tensor")):
            lat, bw = comm[world][op]
            log(
                f"gloo {op}, {world} processes: latency {lat * 1e6:.0f} us, bandwidth {bw / 1e9:.2f} GB/s (bytes "
                f"counted {counted}); "
                + ", ".join(f"{b / 2**20:.3g} MiB {s * 1e3:.1f} ms" for b, s in comm[world][op + "_points"])
            )
    lat, bw = comm[2]["p2p"]
    log(f"gloo send/recv, 2 processes: latency {lat * 1e6:.0f} us, bandwidth {bw / 1e9:.2f} GB/s")
    out = {
        "gemm": {w: round(r / 1e9, 1) for w, r in rates.items()},
        "ranks": ranks,
        "cores": os.cpu_count(),
        "adam_ns": round(opt * 1e9, 2),
        "allreduce": {w: comm[w]["allreduce"] for w in (2, 4)},
        "allgather": {w: comm[w]["allgather"] for w in (2, 4)},
        "p2p": comm[2]["p2p"],
        "fresh_page_gbs": round(fresh / 1e9, 2),
        "layer_overhead_ms": round(overhead * 1e3, 3),
        "mem_gbs": round(mem / 1e9, 2),
        "layer_shape": list(LAYER),
        "layer_gemm": {k: round(r / 1e9, 1) for k, r in layer.items()},
        "zero_ns": [round(zero_held * 1e9, 2), round(zero_owned * 1e9, 2)],
        "zero_reduce_ns": {dp: {n: round(v * 1e9, 2) for n, v in by.items()} for dp, by in zero_reduce.items()},
    }
    if shared:
        out["gemm_shared"] = {w: round(r / 1e9, 1) for w, r in shared.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4, help="processes of the runs to predict")
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="also measure the GEMMs in --ranks processes at once (the contention steptime then uses "
        "instead of ranks / cores)",
    )
    args = ap.parse_args()
    print(json.dumps(calibrate(args.d_model, args.repeat, args.ranks, args.concurrent)))


if __name__ == "__main__":
    main()
