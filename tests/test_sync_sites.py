"""The host-sync test's attribution (tests/sync_sites.py, used by tests/test_gpu.py on a GPU), replayed on the
CPU with stacks as traceback.extract_stack() gives them: a sync whose innermost frame is in megamemo's package is
megamemo's own, named by its path below the package whatever the checkout's folder is called; a library's sync
(DeepSpeed, torch, a site-packages inside the checkout) is "outside megamemo", with the megamemo frame it came
from."""
from __future__ import annotations

import traceback

from sync_sites import attribute, package_root


def frame(path, name):
    return traceback.FrameSummary(path, 1, name)


def test_attribution_by_the_innermost_frame():
    root = "/x/megamemo/megamemo/"                          # a checkout folder named like the package
    own = [frame("/x/run.py", "<module>"), frame(root + "train/loop.py", "train_step")]
    assert attribute(own, root) == ("train/loop.py:train_step", None)
    lib = own[:1] + [frame(root + "train/engine.py", "micro_step"),
                     frame("/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", "step")]
    assert attribute(lib, root) == ("outside megamemo", "train/engine.py:micro_step")
    vendored = own[:1] + [frame(root + "site-packages/torch/x.py", "f")]
    assert attribute(vendored, root) == ("outside megamemo", None)
    assert attribute([], root) == ("outside megamemo", None)


def test_the_package_root_is_this_checkouts():
    import megamemo.train.loop as loop

    root = package_root()
    assert attribute([frame(loop.__file__, "train_step")], root) == ("train/loop.py:train_step", None)
