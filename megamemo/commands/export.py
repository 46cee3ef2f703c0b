"""`megamemo export hf`: a trained model as a Hugging Face transformers directory that loads without megamemo
(megamemo/export/hf.py says what the directory holds).

    megamemo export hf --ckpt CKPT --out DIR [--overwrite] [--data SHARD_DIR]
"""

from __future__ import annotations

import argparse
import sys

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.export.hf import Request, export_hf

    p = argparse.ArgumentParser(prog="megamemo export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf", help="a Hugging Face transformers directory (trust_remote_code) that needs no megamemo")
    flags.add(h, "ckpt")
    flags.add_fields(h, Request, shared={"data": {}})
    a = p.parse_args(argv)
    notes: list[str] = []  # what the conversion said: shown once it succeeded, so an error is one line
    r = export_hf(a.ckpt, flags.request(a, Request), log=notes.append)
    for m in notes:
        print(m, file=sys.stderr, flush=True)
    print(
        f"[export] wrote {r['out']}: {r['variant']}, {r['parameters']:,} parameters ({r['dtype']}), {r['tokenizer']}",
        flush=True,
    )
    return 0
