"""`megamemo plot`: training and validation curves of one or more runs, from their metrics.jsonl, as a PNG
(megamemo/eval/plot.py).

    megamemo plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--x steps|tokens] [--metric bpc|ppl]

Exit codes: 0 written; 2 a missing, empty or malformed metrics.jsonl (the message names the file and line).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="megamemo plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training run directories (with metrics.jsonl)")
    p.add_argument("--out", help="PNG file (default RUN_DIR/metrics.png for one run, ./metrics.png for several)")
    p.add_argument("--x", choices=("steps", "tokens"), default="steps", help="x axis (default steps)")
    p.add_argument("--metric", choices=("bpc", "ppl"), help="override the metric read from the run")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.eval.plot import default_out, load_runs, save

    a = parse_args(argv)
    runs = load_runs(a.runs, a.metric)
    save(runs, Path(a.out) if a.out else default_out(a.runs), a.x, a.metric)
    return 0
