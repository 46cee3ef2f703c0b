"""A checkpoint written before the typed seams of issue #49 (tests/fixtures/checkpoint_v3: tiny lamemo, 1 process,
grad_accum 2, stream dropout, saved at step 4 by the code of b354491) resumes under today's code exactly: continuing
it 4 steps gives the losses the old code gave (stored as float hex in continuation.json).

Bit for bit where the machine is the fixture's (torch version, CPU capability, threads): a CPU's kernels sum in an
order that depends on its instruction set, so elsewhere the same continuation differs in the last bits however right
the resume is. There the test checks what it can derive: step 5, computed from the checkpoint's own weights, memory,
data position and dropout stream, within two orders of the forward pass's fp32 sums (tests/helpers/bounds.py) at the
loss's size; a wrong resume moves it by more than 1e-3. The later steps also carry the updates' rounding; the
moments' resume is bit for bit on the fixture's machine, and under every layout in the resume tests
(tests/train/test_train_runs.py, tests/train/test_train_parallel.py). The checkpoint today's code writes at
the end keeps the old JSON (marker and rank file: the same fields, the same layout records), on any machine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.bounds import forward_bound
from helpers.fixture_data import FIXTURES
from helpers.runs_cache import losses, run

from megamemo.train.config import load

pytestmark = [pytest.mark.multiproc, pytest.mark.numerics]  # a training process; rounding at another ISA

FIXTURE = FIXTURES / "checkpoint_v3"


def same_machine(made: dict) -> bool:
    return (
        made["torch"] == torch.__version__
        and made["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        and made["threads"] == 1
    )  # runs_cache.launch starts ranks with OMP_NUM_THREADS=1


def test_old_checkpoint_resumes_to_the_old_codes_losses(shards, tmp_path):
    expected = json.loads((FIXTURE / "continuation.json").read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(FIXTURE / "checkpoints", run_dir / "checkpoints")
    run(1, FIXTURE / "config.yaml", shards, run_dir, "--max-steps", "8", "--set", "checkpoint.save_every=0")
    got = losses(run_dir)
    want = {int(s): float.fromhex(h) for s, h in expected["losses"].items()}
    assert sorted(got) == [5, 6, 7, 8], got  # resumed at step 4, not a fresh start
    if same_machine(expected["machine"]):
        assert got == want, {s: (got[s].hex(), want[s].hex()) for s in want}
    else:
        tol = forward_bound(load(FIXTURE / "config.yaml").model, abs(want[5]))
        assert abs(got[5] - want[5]) <= tol, (got[5], want[5], tol, expected["machine"])
    assert_written_as_the_old_code_wrote(run_dir / "checkpoints" / "step_00000008")


def assert_written_as_the_old_code_wrote(step_dir):
    """Today's writer keeps the old files' JSON: the marker's fields and its layout, and the rank file's fields and its
    layout (the same run: the same values), so older readers (interop/load.py, other tools) read new checkpoints."""
    old_dir = FIXTURE / "checkpoints" / "step_00000004"
    new_marker, old_marker = (json.loads((d / "COMMITTED").read_text()) for d in (step_dir, old_dir))
    assert sorted(new_marker) == sorted(old_marker)
    assert {k: new_marker[k] for k in ("layout", "model", "model_fingerprint", "precision", "dropout_masks")} == {
        k: old_marker[k] for k in ("layout", "model", "model_fingerprint", "precision", "dropout_masks")
    }
    new_rank, old_rank = (json.loads((d / "rank_00000.json").read_text()) for d in (step_dir, old_dir))
    assert sorted(new_rank) == sorted(old_rank) and new_rank["layout"] == old_rank["layout"]
    assert sorted(new_rank["replicas"]) == sorted(old_rank["replicas"])
