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
    p = argparse.ArgumentParser(prog="megamemo convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("to-single", help="committed training checkpoint (any layout) -> single-device checkpoint")
    flags.add(s, "ckpt", help=TRAINING_CHECKPOINT)
    s.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    flags.add(s, "dtype", default="fp32", help="the weights' dtype in the single-device checkpoint")
    flags.add(s, "data", help="shard directory whose tokenizer/vocabulary to record (default: the run's)")
    s.add_argument("--memory", help="streams whose memory to write: 'all' or global columns like 0-3,7")
    s.add_argument("--no-check", action="store_true", help="skip the self-check on the recorded probe")
    r = sub.add_parser(
        "relayout",
        help="copy a committed checkpoint into a new run directory (training resumes from it under any tp/pp/dp)",
    )
    flags.add(r, "ckpt", help=TRAINING_CHECKPOINT)
    r.add_argument("--out", required=True, help="new run directory")
    i = sub.add_parser(
        "import-reference", help="thu-coai/LaMemo or kimiyoung/transformer-xl weights -> single-device checkpoint"
    )
    i.add_argument("file", help=".pt with {state_dict, config} (or a bare state_dict with --config)")
    i.add_argument("--out", required=True, help="new directory for the single-device checkpoint")
    i.add_argument("--config", help="JSON file with the reference MemTransformerLM constructor arguments")
    a = p.parse_args(argv)
    from megamemo.interop.convert import relayout, to_single

    if a.cmd == "to-single":
        out = to_single(a.ckpt, a.out, a.dtype, a.data, a.memory, check=not a.no_check)
    elif a.cmd == "relayout":
        out = relayout(a.ckpt, a.out)
    else:
        from megamemo.interop.importer import import_reference_file

        out = import_reference_file(a.file, a.out, a.config)
    print(f"[convert] wrote {out}", flush=True)
    return 0
