"""The `megamemo` command: a thin dispatcher. Each subcommand lives in its own module (megamemo/commands/; prepare
and verify-shards: megamemo/data/cli.py) as `main(argv: list[str]) -> int | None`, imported only when used (so
`megamemo prepare` never imports DeepSpeed).

Errors are caught here, once: a user error (megamemo.util.errors.MegamemoError: a bad config, flag, data directory,
checkpoint or file; or an OSError: a file missing, unreadable or unwritable) prints `megamemo COMMAND: error:
MESSAGE`, one line (its traceback too with MEGAMEMO_DEBUG=1), and exits 2. Any other exception is a bug: its
traceback is printed and the exit code is 1.
Training keeps its own exit codes (megamemo/train/run.py, megamemo/runtime/interruptions.py): `megamemo train`'s
exceptions are not made user errors here, so an error training does not anticipate stays a crash (exit 1) that a
launcher may retry."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from megamemo.util.errors import MegamemoError

USER_ERRORS = (MegamemoError, OSError)  # one line, exit 2 (a file missing, unreadable or unwritable: OSError)

SUBCOMMANDS = {
    "prepare": ("megamemo.data.cli:prepare_main", "build zstd webdataset shards from a raw corpus"),
    "verify-shards": ("megamemo.data.cli:verify_main", "check every shard of a directory against its manifest"),
    "reference-score": (
        "megamemo.commands.reference_score:main",
        "score a reference-format .pt file with the megamemo model",
    ),
    "train": ("megamemo.commands.train:main", "train (one process per device; see launch/)"),
    "replay": (
        "megamemo.commands.replay:main",
        "recompute a run's steps from a checkpoint and compare them with what it recorded",
    ),
    "eval": ("megamemo.commands.eval:main", "evaluate a checkpoint: bpc / perplexity"),
    "generate": ("megamemo.commands.generate:main", "sample text with memory carried"),
    "convert": ("megamemo.commands.convert:main", "convert a sharded checkpoint to single-GPU form"),
    "plan": ("megamemo.commands.plan:main", "per-rank memory and step time of a layout, and the layouts that fit"),
    "analyze": ("megamemo.commands.analyze:main", "memorizing coefficient and attention-by-distance plots"),
    "export": ("megamemo.commands.export:main", "export a checkpoint: `export hf` writes a transformers directory"),
    "harness": ("megamemo.commands.harness:main", "lm-evaluation-harness rolling loglikelihood over text files"),
    "plot": ("megamemo.commands.plot:main", "training/validation bpc or perplexity of runs (PNG), resumes marked"),
}


def _usage() -> str:
    lines = ["usage: megamemo SUBCOMMAND [ARGS...]", "", "subcommands:"]
    for name, (_, doc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<16} {doc}")
    return "\n".join(lines)


def prepare_process() -> None:
    """What every subcommand's process sets up before it imports torch, DeepSpeed or megatron-core (idempotent)."""
    # Most commands compile nothing, but DeepSpeed's ZeRO imports its Muon optimizer whatever the optimizer
    # (deepspeed/runtime/zero/utils.py is_zero_supported_optimizer), and its kernels are decorated with torch.compile,
    # which loads inductor: about 1 s of every rank's start-up. torch's own switch makes the decoration a no-op. A run
    # that compiles (train.compile, FlexAttention) lifts it again (megamemo/kernels/compiler.py enable_compiler);
    # a value the user set is kept.
    if "TORCHDYNAMO_DISABLE" not in os.environ:
        os.environ["TORCHDYNAMO_DISABLE"] = os.environ["MEGAMEMO_SET_TORCHDYNAMO_DISABLE"] = "1"
    # lazy: after TORCHDYNAMO_DISABLE above, and never for `megamemo --help`
    from megamemo.runtime.extensions import use_writable_extensions_dir

    # DeepSpeed's JIT op builds go where this user can write (containers: --user, apptainer)
    use_writable_extensions_dir()
    # lazy: after TORCHDYNAMO_DISABLE above, and never for `megamemo --help`
    from megamemo.runtime import quiet

    quiet.install()  # third-party start-up warnings off the terminal; other ranks quiet (megamemo/runtime/quiet.py)
    # lazy: after TORCHDYNAMO_DISABLE above, and never for `megamemo --help`
    from megamemo.runtime.allocator import tune_cpu_allocator

    tune_cpu_allocator()  # before any tensor exists; see megamemo/runtime/allocator.py


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"megamemo: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name == "train":  # a stop signal during start-up waits for the trainer's handler (runtime/signals.py)
        # lazy: only for train, never for `megamemo --help`
        from megamemo.runtime.signals import hold

        hold()
    prepare_process()
    target = SUBCOMMANDS[name][0]
    mod_name, func_name = target.split(":")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.startswith(e.name):
            print(f"megamemo: subcommand {name!r} is not available in this build ({e})", file=sys.stderr)
            return 2
        raise
    # training's exit codes are its own (train/run.py reports the errors it anticipates, exit 2; any other is a
    # crash, exit 1, which a launcher may retry): none of its exceptions is made a user error here
    # training keeps its own exit codes (runtime/interruptions.py)
    user_errors = () if name == "train" else USER_ERRORS
    return run_command(name, getattr(module, func_name), rest, user_errors=user_errors)


def run_command(name: str, command, argv: list[str], user_errors: tuple = USER_ERRORS) -> int:
    """`command(argv)` -> its exit code; a user error -> one line and 2; a bug -> its traceback and 1."""
    try:
        rc = command(argv)
    except user_errors as e:
        if os.environ.get("MEGAMEMO_DEBUG") == "1":
            traceback.print_exc()
        print(f"megamemo {name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
