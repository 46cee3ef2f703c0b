"""Where a host sync of a CUDA step comes from (tests/gpu/test_gpu.py's host-sync test; replayed on the CPU by
tests/gpu/test_sync_sites.py): the innermost Python frame of the call that synchronised, below the warnings module's own
frames (a replaced `warnings.showwarning` is called from warnings.py's _showwarnmsg, so the stack always ends
there). Inside megamemo's package (resolved against megamemo.__file__, whatever the checkout's folder is called) it
is megamemo's own sync, named `<path below the package>:<function>`; anywhere else (DeepSpeed, torch,
site-packages) it is a library's, named "outside megamemo" with the megamemo call site it came from.

    python helpers/sync_sites.py CONFIG [KEY=VALUE ...]     # one step after a warm-up: a `SYNC <site>` line a sync
(needs the RANK / WORLD_SIZE / MASTER_* environment of one process; on a machine without CUDA nothing is reported
by torch, only what a planted `warnings.warn` says)."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings

# Every host sync of megamemo's own that a step may make, and why it is needed (anything else fails the test, named)
NEEDED_SYNCS = {
    "train/loop.py:all_reduced",  # StepSignals: the step's NLL sum, tokens, stop and save-failed flags
    # (all-reduced over the ranks), read by one .tolist() a step
    "train/engine.py:micro_step",  # float() of the grad norm DeepSpeed reports, once a step
    "train/engine.py:pipeline_step",  # the same for a pipeline step, and the loss train_batch returns
    "parallel/pipeline.py:meta_ints",  # a stage's (micro-batch, M, L), once per stage and micro-batch
}
MAX_OWN = 2  # a step without a pipeline: the signals and the grad norm
# the step both tests run (with data.dir and train.run_dir): bf16, nothing but the step
SYNC_SETS = [
    "precision.dtype=bf16",
    "eval.every=0",
    "checkpoint.save_every=0",
    "checkpoint.save_at_end=false",
    "checkpoint.probe=false",
    "log.tensorboard=false",
]


def package_root() -> str:
    import megamemo

    return os.path.dirname(os.path.realpath(megamemo.__file__)) + os.sep


def _warnings_files() -> set[str]:
    files = {os.path.realpath(warnings.__file__)}
    with contextlib.suppress(ImportError):  # Python 3.14 moved the module's code there
        import _py_warnings

        files.add(os.path.realpath(_py_warnings.__file__))
    return files


def attribute(stack, root: str) -> tuple[str, str | None]:
    """(site, caller) of a sync whose Python stack (traceback.extract_stack(), innermost last) is `stack`: site is
    megamemo's own `path:function` or "outside megamemo"; caller is the innermost megamemo frame of a library's
    sync (None for megamemo's own or when no megamemo frame is on the stack). The warnings module's frames at the
    innermost end (how a warning reaches a replaced showwarning) are not the sync's."""

    def own(frame) -> str | None:
        path = os.path.realpath(frame.filename)
        if not path.startswith(root) or f"{os.sep}site-packages{os.sep}" in os.sep + path[len(root) :]:
            return None
        return f"{os.path.relpath(path, root)}:{frame.name}"

    skip = _warnings_files()
    stack = list(stack)
    while stack and os.path.realpath(stack[-1].filename) in skip:
        stack.pop()
    if not stack:
        return "outside megamemo", None
    site = own(stack[-1])
    if site is not None:
        return site, None
    callers = [s for s in map(own, stack) if s is not None]
    return "outside megamemo", (callers[-1] if callers else None)


@contextlib.contextmanager
def recording(root: str | None = None):
    """A list that collects the site of every "synchronizing" warning raised inside the block (torch's
    set_sync_debug_mode("warn") says "called a synchronizing CUDA operation"): `site` or `site (from caller)`."""
    root, sites = root or package_root(), []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            site, caller = attribute(traceback.extract_stack()[:-1], root)
            sites.append(site if caller is None else f"{site} (from {caller})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield sites


def unneeded(sites: list[str]) -> list[str]:
    """What is wrong with a step's syncs: megamemo's own that NEEDED_SYNCS does not name, or more than MAX_OWN."""
    own = [s for s in sites if not s.startswith("outside megamemo")]
    out = [f"an unneeded host sync at {s}" for s in sorted(set(own) - NEEDED_SYNCS)]
    if len(own) > MAX_OWN:
        out.append(f"{len(own)} host syncs of megamemo's own in one step (at most {MAX_OWN}): {own}")
    return out


def main(argv: list[str]) -> None:
    import torch

    from megamemo.train.build import build
    from megamemo.train.config import load

    trainer, _ = build(load(argv[0], argv[1:]))
    trainer.train_step()  # warm-up: allocations, lazy inits
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with recording() as sites:
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    for s in sites:
        print("SYNC", s)


if __name__ == "__main__":
    main(sys.argv[1:])
