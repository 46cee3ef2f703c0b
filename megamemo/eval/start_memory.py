"""The memory an evaluation or a generation starts from (`megamemo eval --memory FILE`, `megamemo generate
--memory FILE`): the streams' memory that `megamemo convert to-single --memory COLUMNS` wrote (memory.safetensors,
Memory.state_dict() form), read back and checked against the model and the run before anything is scored.

Every check names the file in one line: its tensors must be the model's memory (names, per-row shapes), it must
hold as many streams as the run has columns (eval --batch-size; generate: one), and no more rows than the memory
length the run keeps (a longer memory would be attended to whole on the first segment, then cut). The tensors are
moved to the model's device and dtype (LaMemo's log-normalisers `lse.*` stay fp32, as in training).
"""

from __future__ import annotations

import torch

from megamemo.checkpoint.single import load_memory
from megamemo.model import Memory
from megamemo.util.errors import UsageError


def row_shape(model, name: str) -> tuple[int, ...]:
    """The shape of one memory row of tensor `name` for this (single-device) model: [M, B, *row_shape]."""
    c = model.cfg
    return {"emb": (c.d_model,), "hid": (c.d_model,), "ctx": (c.n_head, c.d_head), "lse": (c.n_head,)}[
        name.split(".")[0]
    ]


def load_start_memory(path, model, streams: int, mem_len: int, what: str = "--batch-size") -> Memory:
    """-> the memory in `path`, checked against `model`, `streams` columns (named by `what` in the error) and
    `mem_len`, on the model's device. ValueError naming the file when it does not fit."""
    mem = load_memory(path)
    if mem is None:
        raise UsageError(f"{path}: holds no memory.safetensors (convert with --memory)")
    c, names = model.cfg, model.memory_names()
    if not names:
        raise UsageError(f"{path}: the model ({c.variant}) has no memory to start from")
    if sorted(mem.tensors) != sorted(names):
        raise UsageError(
            f"{path}: memory tensors {sorted(mem.tensors)} are not this model's ({c.variant}, "
            f"{c.n_layer} layers: {names})"
        )
    for k, t in mem.tensors.items():
        if tuple(t.shape[2:]) != row_shape(model, k):
            raise UsageError(
                f"{path}: memory tensor {k!r} has shape {list(t.shape)}, the model's rows are "
                f"{list(row_shape(model, k))} (d_model {c.d_model}, n_head {c.n_head}, d_head "
                f"{c.d_head})"
            )
    if mem.batch_size != streams:
        raise UsageError(f"{path}: memory of {mem.batch_size} streams, the run has {streams} ({what})")
    if mem.length > mem_len:
        raise UsageError(f"{path}: memory of {mem.length} rows is longer than the run's mem_len {mem_len}")
    param = next(model.parameters())
    return Memory(
        {k: t.to(param.device, torch.float32 if k.startswith("lse.") else param.dtype) for k, t in mem.tensors.items()},
        batch_size=mem.batch_size,
    )
