"""`megamemo export hf`: a trained model as a Hugging Face transformers directory that loads without megamemo
(megamemo/export/hf.py says what the directory holds).

    megamemo export hf --ckpt CKPT --out DIR [--overwrite] [--data SHARD_DIR]
"""

from __future__ import annotations

import argparse
import sys

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megamemo export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf", help="a Hugging Face transformers directory (trust_remote_code) that needs no megamemo")
    flags.add(h, "ckpt")
    h.add_argument("--out", required=True, help="the new directory")
    h.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    flags.add(h, "data", help="shard directory whose vocabulary to use (default: the checkpoint's)")
    a = p.parse_args(argv)
    from megamemo.export.hf import export_hf

    notes: list[str] = []  # what the conversion said: shown once it succeeded, so an error is one line
    r = export_hf(a.ckpt, a.out, a.overwrite, a.data, log=notes.append)
    for m in notes:
        print(m, file=sys.stderr, flush=True)
    print(
        f"[export] wrote {r['out']}: {r['variant']}, {r['parameters']:,} parameters ({r['dtype']}), {r['tokenizer']}",
        flush=True,
    )
    return 0
