"""The model's two execution paths (megamemo/kernels/): plain PyTorch and the CPU kernels. Single-process
golden and parity tests run on both; the multi-process TP/PP parity tests run on MEGAMEMO_TEST_KERNELS (plain
unless set: the CPU path is what every CPU training run of the suite goes through; run them once with
MEGAMEMO_TEST_KERNELS=cpu by hand)."""

import os

from megamemo.kernels import apply_kernels, kernels_in_use

PATHS = ("plain", "cpu")
PARALLEL_PATH = os.environ.get("MEGAMEMO_TEST_KERNELS", "plain")


def on_path(model, path: str):
    """model with its dropouts and attention masking in `path`'s form (checked), for chaining."""
    assert apply_kernels(model, path, "cpu") == path and kernels_in_use(model) == path
    return model
