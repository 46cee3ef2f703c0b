"""`megamemo plan`: per-rank memory of a run's layout before launching it, whether it fits, its predicted step
time, and the layouts that fit (megamemo/plan/: layouts.py, steptime.py, recommend.py, report.py).

    megamemo plan --config configs/lamemo-7b.yaml --nodes 4 --gpus-per-node 8 --gpu a100-80g [--tp 4 --pp 2]
    megamemo plan --config configs/rehearsal-1.3b-width.yaml --nodes 1 --gpus-per-node 4 --device cpu \\
        --host-mem-gib 24 --tp 2 --pp 2          # CPU processes sharing the node's memory
    megamemo plan --config configs/lamemo-7b.yaml --nodes 8 --gpus-per-node 8 --gpu a100-80g   # no --tp/--pp:
                                                 # also the layouts that fit, best first

--device here is the kind of ranks planned for (GPUs, or CPU processes sharing a node's memory), not a torch device.
"""
from __future__ import annotations

import argparse
import sys

from megamemo.commands import flags
from megamemo.runtime.gpus import PLANNED, unknown_kind


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megamemo plan", description=__doc__.splitlines()[0])
    flags.add(ap, "config")
    ap.add_argument("--nodes", type=int, required=True, help="nodes the job runs on")
    ap.add_argument("--gpus-per-node", type=int, required=True, help="devices (or CPU processes) per node")
    ap.add_argument("--gpu", default="a100-80g", help=f"device kind: {', '.join(PLANNED)}")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                    help="cpu: ranks are CPU processes sharing the node's --host-mem-gib")
    ap.add_argument("--host-mem-gib", type=float, help="--device cpu: a node's memory the processes share (GiB)")
    ap.add_argument("--vocab", type=int, default=32000,
                    help="the vocabulary a `model.n_token: auto` config is planned with while its data directory has "
                         "no manifest.json yet (the shipped configs' bpe:32000); once prepared, the manifest's")
    ap.add_argument("--tp", type=int, help="tensor-parallel size of the layout to price (default: recommend)")
    ap.add_argument("--pp", type=int, help="pipeline stages of the layout to price (default: recommend)")
    ap.add_argument("--recommend", action="store_true",
                    help="list the layouts that fit, best first (the default when neither --tp nor --pp is given)")
    ap.add_argument("--explain", action="store_true",
                    help="the predicted step time's breakdown of the layout (--tp/--pp, else the first ranked)")
    flags.add(ap, "set")

    def one_line(message):      # argparse's error: one line (no usage block), exit 2
        print(f"megamemo plan: {message}", file=sys.stderr)
        raise SystemExit(2)
    ap.error = one_line  # type: ignore[method-assign]  # argparse's error made one line (exit 2)
    args = ap.parse_args(argv)
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node), ("--tp", args.tp),
                    ("--pp", args.pp), ("--vocab", args.vocab)):
        if v is not None and v < 1:
            print(f"megamemo plan: {flag} must be at least 1 (got {v})", file=sys.stderr)
            return 2
    if args.device == "gpu" and args.gpu not in PLANNED:
        print(f"megamemo plan: --gpu: {unknown_kind(args.gpu, PLANNED)}", file=sys.stderr)
        return 2
    from megamemo.plan.report import Ask, report
    from megamemo.train.config import load

    return report(lambda sets: load(args.config, [*args.set, *sets], vocab_fallback=args.vocab),
                  Ask(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu, device=args.device,
                      host_mem_gib=args.host_mem_gib, tp=args.tp, pp=args.pp, recommend=args.recommend,
                      explain=args.explain))
