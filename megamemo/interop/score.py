"""What `megamemo reference-score FILE.pt --out OUT.pt` does (megamemo/commands/reference_score.py): score a
reference-format file with the megamemo model.

The file holds `state_dict`, `config`, `inputs`, `targets` (see ../shared/reference/README.md). The model is built
through the importer and the segments run in order, in eval mode, with memory carried. Output:
{"nll": [float32 tensor [L, B] per segment, in position order]}.
"""

from __future__ import annotations

import torch

from megamemo.model.scoring import score_segments

from .reference import ReferenceFormatError, import_reference, load_weights_only

KNOWN_KEYS = {
    "name",
    "reference",
    "model_class",
    "config",
    "seed",
    "init",
    "state_dict",
    "param_names",
    "stream",
    "data_matrix",
    "inputs",
    "targets",
    "nll",
    "nll_keep_order",
    "mems",
    "layer_outputs",
    "analysis",
    "train",
    "torch_version",
}
REQUIRED = ("state_dict", "config", "inputs", "targets")


def load_reference_file(path: str) -> dict:
    g = load_weights_only(path)
    if not isinstance(g, dict):
        raise ReferenceFormatError(f"{path}: expected a dict, got {type(g).__name__}")
    unknown = sorted(set(g) - KNOWN_KEYS)
    if unknown:
        raise ReferenceFormatError(f"{path}: unknown keys {unknown}")
    missing = [k for k in REQUIRED if k not in g]
    if missing:
        raise ReferenceFormatError(f"{path}: missing keys {missing}")
    if len(g["inputs"]) != len(g["targets"]):
        raise ReferenceFormatError(f"{path}: {len(g['inputs'])} input segments but {len(g['targets'])} target segments")
    return g


def score(g: dict) -> list[torch.Tensor]:
    model = import_reference(g["config"], g["state_dict"]).eval()
    out = []
    score_segments(
        model, zip(g["inputs"], g["targets"], strict=True), on_segment=lambda s, x, y, nll: out.append(nll.float())
    )
    return out
