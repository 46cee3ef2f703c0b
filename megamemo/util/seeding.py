"""Seeding a process's default random streams: Python's `random`, NumPy's global generator and torch's default
generators (CPU, and every CUDA device's through torch.manual_seed). The one place that does it; what seed each
rank's streams get is decided above (parallel/groups.py dropout_seeds for training, the config's seed for the
initial weights)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_default_streams(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
