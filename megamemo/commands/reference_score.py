"""`megamemo reference-score FILE.pt --out OUT.pt`: score a reference-format file with the megamemo model
(megamemo/interop/score.py)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megamemo reference-score", description=__doc__.splitlines()[0])
    ap.add_argument("file", help="reference-format .pt file")
    ap.add_argument("--out", required=True, help="where to write {'nll': [...]}")
    args = ap.parse_args(argv)
    # lazy: the library (torch) loads only when the command runs, never for --help
    import torch

    from megamemo.interop.score import load_reference_file, score

    nll = score(load_reference_file(args.file))
    torch.save({"nll": nll}, args.out)
    total = sum(float(t.sum()) for t in nll) / sum(t.numel() for t in nll)
    print(f"scored {len(nll)} segments, mean NLL {total:.6f} nats -> {args.out}")
    return 0
