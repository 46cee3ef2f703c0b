"""`megamemo harness`: one lm-eval rolling-loglikelihood task over the given files (one document per file, no hub,
no download), reporting lm-eval's word_perplexity, byte_perplexity and bits_per_byte (megamemo/export/harness.py).

    megamemo harness --ckpt CKPT --text FILE... [--json OUT] [--device D] [--mem-len N]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megamemo.commands import flags


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.export.harness_request import Request
    from megamemo.util.files import write_text_atomic

    p = argparse.ArgumentParser(prog="megamemo harness", description=__doc__.split("\n\n")[0])
    flags.add(p, "ckpt")
    p.add_argument("--json", help="write the results here")
    flags.add_fields(p, Request, shared={"device": {}, "mem_len": {}})
    a = p.parse_args(argv)
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # before lm-eval is imported (megamemo[eval])
        os.environ.setdefault(var, "1")
    # lazy: lm-eval only after the HF_*_OFFLINE defaults above, and only when the command runs
    from megamemo.export.harness import run_harness

    r = run_harness(a.ckpt, flags.request(a, Request))
    print(
        f"{r['ckpt']}: {len(r['files'])} file(s), {r['bytes']:,} bytes | word_perplexity "
        f"{r['word_perplexity']:.4f} byte_perplexity {r['byte_perplexity']:.4f} bits_per_byte "
        f"{r['bits_per_byte']:.4f} | lm-eval {r['lm_eval']}",
        flush=True,
    )
    if a.json:
        write_text_atomic(Path(a.json), json.dumps(r, indent=1) + "\n", durable=False)
    return 0
