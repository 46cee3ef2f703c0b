"""The host-sync test's attribution (tests/helpers/sync_sites.py, used by tests/gpu/test_gpu.py on a GPU), replayed
on the CPU with stacks as traceback.extract_stack() gives them: a sync whose innermost frame is in megamemo's package is
megamemo's own, named by its path below the package whatever the checkout's folder is called; a library's sync
(DeepSpeed, torch, a site-packages inside the checkout) is "outside megamemo", with the megamemo frame it came
from. A real warnings.warn from inside megamemo is megamemo's (the warnings module's own frames skipped), and the
check refuses a sync NEEDED_SYNCS does not name; tiny-cpu's step runs under the GPU test's script on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import warnings

import pytest
from helpers.fixture_data import REPO
from helpers.sync_sites import NEEDED_SYNCS, SYNC_SETS, attribute, package_root, recording, unneeded

from megamemo.runtime.dist import free_port


def frame(path, name):
    return traceback.FrameSummary(path, 1, name)


def test_attribution_by_the_innermost_frame():
    root = "/x/megamemo/megamemo/"  # a checkout folder named like the package
    own = [frame("/x/run.py", "<module>"), frame(root + "train/loop.py", "train_step")]
    assert attribute(own, root) == ("train/loop.py:train_step", None)
    lib = own[:1] + [
        frame(root + "train/engine.py", "micro_step"),
        frame("/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", "step"),
    ]
    assert attribute(lib, root) == ("outside megamemo", "train/engine.py:micro_step")
    vendored = own[:1] + [frame(root + "site-packages/torch/x.py", "f")]
    assert attribute(vendored, root) == ("outside megamemo", None)
    assert attribute([], root) == ("outside megamemo", None)
    shown = own + [frame(warnings.__file__, "_showwarnmsg")]  # how a warning reaches a replaced showwarning
    assert attribute(shown, root) == ("train/loop.py:train_step", None)


def test_the_package_root_is_this_checkouts():
    import megamemo.train.loop as loop

    root = package_root()
    assert attribute([frame(loop.__file__, "train_step")], root) == ("train/loop.py:train_step", None)


def test_a_warning_raised_inside_megamemo_is_megamemos_not_the_warnings_modules():
    """A real warnings.warn (C, as torch's sync warning: no Python frame of its own) called from a megamemo frame -
    train/loop.py's _eagerly calls what it is given - reaches the replaced showwarning through warnings.py's
    _showwarnmsg: it is megamemo's own sync, named, and not a needed one; one raised here is outside megamemo."""
    from megamemo.train.loop import _eagerly

    with recording() as sites:
        _eagerly(warnings.warn, "called a synchronizing CUDA operation")
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)  # not a sync: not recorded
    assert sites == ["train/loop.py:_eagerly", "outside megamemo"], sites
    assert unneeded(sites) == ["an unneeded host sync at train/loop.py:_eagerly"]


def test_the_needed_syncs_pass_and_too_many_fail():
    assert unneeded(["train/loop.py:all_reduced", "train/engine.py:micro_step", "outside megamemo (from x)"]) == []
    too_many = ["train/loop.py:all_reduced"] * 3
    assert unneeded(too_many) == [f"3 host syncs of megamemo's own in one step (at most 2): {too_many}"]


def test_the_needed_syncs_are_functions_that_exist():
    """Each name in NEEDED_SYNCS is a function of that file: a rename would otherwise leave a dead entry and fail
    the GPU test with a sync the list seems to allow."""
    import ast

    root = package_root()
    for site in NEEDED_SYNCS:
        path, name = site.split(":")
        tree = ast.parse(open(os.path.join(root, path)).read())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, site


@pytest.mark.multiproc  # starts a training process
def test_a_cpu_step_under_the_recorder_reports_no_sync(shards, tmp_path):
    """The GPU test's own script (tests/helpers/sync_sites.py) runs one tiny-cpu step after a warm-up on the CPU, where
    torch reports no sync: no SYNC line, so a planted one (bench/mutants.py sync-planted-in-the-micro-steps) is
    what it reports and the check refuses."""
    env = dict(
        os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/helpers/sync_sites.py"),
            str(REPO / "configs/tiny-cpu.yaml"),
            *SYNC_SETS,
            f"data.dir={shards}",
            f"train.run_dir={tmp_path}/r",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    sites = [line[5:] for line in r.stdout.splitlines() if line.startswith("SYNC ")]
    assert unneeded(sites) == [] and sites == [], sites
