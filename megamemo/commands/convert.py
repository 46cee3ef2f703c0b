"""`megamemo convert`: a training checkpoint of any layout -> a single-device checkpoint; a copy of one that
training resumes from under any layout; reference checkpoints -> a single-device checkpoint (megamemo/interop/:
convert.py, importer.py).

    megamemo convert to-single --ckpt RUN_DIR | CHECKPOINTS_DIR | STEP_DIR --out DIR [--dtype fp32|bf16|fp16]
                               [--memory all | COLUMNS] [--data SHARD_DIR] [--no-check]
    megamemo convert relayout --ckpt RUN_DIR | STEP_DIR --out NEW_RUN_DIR
    megamemo convert import-reference FILE.pt --out DIR [--config CONSTRUCTOR.json]
"""

from __future__ import annotations

import argparse

from megamemo.commands import flags

TRAINING_CHECKPOINT = "run directory, its checkpoints/ directory, or a step_* directory"


def main(argv: list[str]) -> int:
    # lazy: the library (torch) loads only when the command runs, never for --help
    from megamemo.interop.convert import Relayout, ToSingle, relayout, to_single
    from megamemo.interop.importer import ImportReference, import_reference_file

    p = argparse.ArgumentParser(prog="megamemo convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("to-single", help="committed training checkpoint (any layout) -> single-device checkpoint")
    flags.add(s, "ckpt", help=TRAINING_CHECKPOINT)
    flags.add_fields(s, ToSingle, shared={"dtype": {}, "data": {}})
    r = sub.add_parser(
        "relayout",
        help="copy a committed checkpoint into a new run directory (training resumes from it under any tp/pp/dp)",
    )
    flags.add(r, "ckpt", help=TRAINING_CHECKPOINT)
    flags.add_fields(r, Relayout)
    i = sub.add_parser(
        "import-reference", help="thu-coai/LaMemo or kimiyoung/transformer-xl weights -> single-device checkpoint"
    )
    i.add_argument("file", help=".pt with {state_dict, config} (or a bare state_dict with --config)")
    flags.add_fields(i, ImportReference)
    a = p.parse_args(argv)
    if a.cmd == "to-single":
        out = to_single(a.ckpt, flags.request(a, ToSingle))
    elif a.cmd == "relayout":
        out = relayout(a.ckpt, flags.request(a, Relayout))
    else:
        out = import_reference_file(a.file, flags.request(a, ImportReference))
    print(f"[convert] wrote {out}", flush=True)
    return 0
