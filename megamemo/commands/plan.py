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
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.plan.report import Ask

    ap = argparse.ArgumentParser(prog="megamemo plan", description=__doc__.splitlines()[0])
    flags.add(ap, "config")
    ap.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="the vocabulary a `model.n_token: auto` config is planned with while its data directory has "
        "no manifest.json yet (the shipped configs' bpe:32000); once prepared, the manifest's",
    )
    flags.add_fields(ap, Ask, device={"choices": ("gpu", "cpu")})
    flags.add(ap, "set")

    def one_line(message):  # argparse's error: one line (no usage block), exit 2
        print(f"megamemo plan: {message}", file=sys.stderr)
        raise SystemExit(2)

    ap.error = one_line  # type: ignore[method-assign]  # argparse's error made one line (exit 2)
    args = ap.parse_args(argv)
    for flag, v in (
        ("--nodes", args.nodes),
        ("--gpus-per-node", args.gpus_per_node),
        ("--tp", args.tp),
        ("--pp", args.pp),
        ("--vocab", args.vocab),
    ):
        if v is not None and v < 1:
            print(f"megamemo plan: {flag} must be at least 1 (got {v})", file=sys.stderr)
            return 2
    if args.device == "gpu" and args.gpu not in PLANNED:
        print(f"megamemo plan: --gpu: {unknown_kind(args.gpu, PLANNED)}", file=sys.stderr)
        return 2
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.plan.report import report
    from megamemo.train.config import load

    return report(
        lambda sets: load(args.config, [*args.set, *sets], vocab_fallback=args.vocab),
        flags.request(args, Ask),
    )
