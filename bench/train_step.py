"""Training throughput of a config, side by side in one run:

  1. a plain PyTorch loop (same model, reader, memory handling, Adam, clipping, schedule; no DeepSpeed),
  2. `megamemo train` in one process (DeepSpeed engine, ZeRO, metrics, per-step all-reduce of the loss),
  3. `megamemo train` with two data-parallel processes (gloo on CPU), same global batch,

each timed over the same steps after a warm-up (interleaved repetitions, best of each, since the machine may be
shared), with the engine's overhead as a ratio to the plain loop.

With ZeRO >= 1 DeepSpeed keeps the fp32 parameters, gradients and Adam state as one flat buffer, so clipping and
Adam are one kernel instead of one per tensor: on a tiny model, where per-tensor overhead dominates, the engine
can come out faster than the plain loop (compare `--set parallel.zero_stage=0`, which keeps per-tensor Adam).

    python bench/train_step.py                                  # configs/tiny-cpu.yaml on the enwik8 prefix
    python bench/train_step.py --config configs/tiny-cpu.yaml --data DIR --steps 80 --warmup 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megamemo.runtime.dist import free_port

REPO = Path(__file__).resolve().parents[1]


def plain_loop(config: str, data: str, steps: int, warmup: int, sets: list[str]) -> None:
    """Worker: the same training step without DeepSpeed; prints tokens/s over steps warmup+1..steps."""
    import torch

    from megamemo.data import StreamReader
    from megamemo.kernels import apply_kernels
    from megamemo.model import MemTransformerLM
    from megamemo.train.config import load
    from megamemo.train.engine import make_optimizer, schedule

    cfg = load(config, [f"data.dir={data}", *sets])
    torch.manual_seed(cfg.train.seed)
    model = MemTransformerLM(cfg.model)
    apply_kernels(model, cfg.train.kernels, "cpu")  # as `megamemo train` on this CPU (megamemo/kernels/)
    opt = make_optimizer(cfg, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
    reader = StreamReader(
        data,
        cfg.data.split,
        cfg.data.batch_size,
        cfg.model.tgt_len,
        roll=cfg.data.roll,
        seed=cfg.data.seed,
        epochs=None,
    )
    n_micro, b = cfg.train.grad_accum, cfg.data.batch_size // cfg.train.grad_accum
    mems = [None] * n_micro
    tokens, t0 = 0, None
    for i, (inp, tgt) in enumerate(reader):
        new = []
        for k in range(n_micro):
            nll, m = model(inp[:, k * b : (k + 1) * b], tgt[:, k * b : (k + 1) * b], mems[k])
            (nll.float().mean() / n_micro).backward()
            new.append(m)
        if cfg.optim.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mems = new
        if i + 1 == warmup:
            t0 = time.perf_counter()  # the clock starts when step `warmup` is done, as for megamemo
        elif i + 1 > warmup:
            tokens += tgt.numel()
        if i + 1 == steps:
            break
    print("RESULT " + json.dumps({"tokens_per_s": tokens / (time.perf_counter() - t0)}), flush=True)


def run_megamemo(
    n: int, threads: int, config: str, data: str, steps: int, warmup: int, sets: list[str], work: Path
) -> float:
    """tokens/s of `megamemo train` with n processes, from its metrics.jsonl (steps after the warm-up)."""
    run_dir = work / f"dp{n}"
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "megamemo",
        "train",
        "--config",
        config,
        "--data",
        data,
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        "--save-every",
        "0",
        "--resume",
        "never",
        "--set",
        "checkpoint.save_at_end=false",
        "--set",
        "eval.every=0",
        "--set",
        "log.tensorboard=false",
        "--set",
        f"log.every={steps}",
    ]
    for s in sets:
        args += ["--set", s]
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            DS_ACCELERATOR="cpu",
        )
        procs.append(
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        )
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"megamemo train with {n} process(es) failed:\n" + outs[0][-3000:])
    # metrics.jsonl has one record per step with its wall-clock time: time the steps after the warm-up
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == steps, f"expected {steps} steps, got {len(train)}"
    tokens = sum(r["tokens"] for r in train[warmup:])
    return tokens / (train[-1]["time"] - train[warmup - 1]["time"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--data", help="shard directory (default: the enwik8 prefix from ../shared, prepared here)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP threads per process (default 1: on a shared or small machine more threads per "
        "process oversubscribe the cores and measure the contention, not the engine)",
    )
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; the best of each is shown")
    p.add_argument("--set", action="append", default=[], help="config override, as for megamemo train")
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.plain_worker:
        plain_loop(a.config, a.data, a.steps, a.warmup, a.set)
        return
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = a.data
        if data is None:
            from megamemo.data.cli import prepare_main

            data = str(work / "enwik8")
            raw = REPO.parent / "shared" / "data" / "enwik8" / "enwik8_prefix"
            if prepare_main(["enwik8", "--raw", str(raw), "--out", data, "--quiet"]):
                raise SystemExit(f"could not prepare {raw}")
        from megamemo.train.config import load

        cfg = load(a.config, [f"data.dir={data}", *a.set])
        print(
            f"config {a.config}: {cfg.model.variant} {cfg.model.n_layer}L/{cfg.model.d_model}d, global batch "
            f"{cfg.data.batch_size} x tgt_len {cfg.model.tgt_len}, {cfg.precision.dtype}, ZeRO "
            f"{cfg.parallel.zero_stage}; {a.steps} steps, timed after {a.warmup}; {cores} CPU cores"
        )
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        plain_cmd = [
            sys.executable,
            __file__,
            "--plain-worker",
            "--config",
            a.config,
            "--data",
            data,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            *[x for s in a.set for x in ("--set", s)],
        ]
        results = {"plain": [], "one": [], "two": []}
        for _rep in range(a.repeat):  # interleaved, best of: the machine is shared and noisy
            out = subprocess.run(plain_cmd, env=env, capture_output=True, text=True, cwd=REPO)
            if out.returncode:
                raise SystemExit("plain loop failed:\n" + out.stderr[-3000:])
            results["plain"].append(json.loads(out.stdout.split("RESULT ", 1)[1])["tokens_per_s"])
            results["one"].append(run_megamemo(1, a.threads, a.config, data, a.steps, a.warmup, a.set, work))
            results["two"].append(run_megamemo(2, a.threads, a.config, data, a.steps, a.warmup, a.set, work))
        plain, one, two = (max(results[k]) for k in ("plain", "one", "two"))
    rows = [
        ("plain PyTorch loop (no DeepSpeed)", 1, a.threads, plain),
        ("megamemo train, DeepSpeed, 1 process", 1, a.threads, one),
        ("megamemo train, DeepSpeed, DP=2", 2, a.threads, two),
    ]
    print(f"{'':40} {'procs':>5} {'threads':>8} {'tokens/s':>10} {'vs plain':>9}   all runs")
    for (name, n, t, v), key in zip(rows, ("plain", "one", "two"), strict=True):
        spread = " ".join(f"{x:,.0f}" for x in results[key])
        print(f"{name:40} {n:>5} {t:>8} {v:>10,.0f} {v / plain:>8.2f}x   {spread}")
    print(
        f"engine overhead (plain / DeepSpeed, 1 process): {plain / one:.2f}x; "
        f"DP=2 / 1 process: {two / one:.2f}x (on {cores} cores, shared with whatever else runs)"
    )


if __name__ == "__main__":
    main()
