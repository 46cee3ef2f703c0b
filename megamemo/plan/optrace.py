"""The model's own op trace: every kernel one training micro-batch launches on a rank, forward and backward, with
each GEMM's FLOPs and shape and every other op's bytes read and written - what steptime.py prices a step from.

The single-device model (megamemo/model) runs once over meta tensors (torch.device("meta"): shapes and dtypes, no
data, no arithmetic, milliseconds at any width) under a TorchDispatchMode that sees each aten op the forward and
autograd's backward issue. The model is the rank's share under tensor parallelism - n_head / tp heads, d_inner / tp
and n_token / tp vocabulary rows, the replicated d_model-wide norms, residuals and dropout whole - in the run's
dtype, with a full memory (mem_len rows: training's steady state) and 2 layers: module hooks cut the op stream into
the input side (embedding, positions, masks), a layer below the top, the top layer (LaMemo's top layer skips its
memory rows' o_net and feed-forward), and the output side (projection, log-softmax, NLL), forward and backward.
A stage of k layers is then the input side (first stage), k - 1 lower layers and the top (last stage) or k lower
layers, and the output side (last stage).

What counts as a kernel follows CUDA's eager kernels, not the meta device's decompositions: dropout runs as
native_dropout (one kernel forward, one backward; the meta device would decompose it into bernoulli_, div_, mul),
and scaled_dot_product_attention (Transformer-XL's causal attention without dropout or normaliser) as the
memory-efficient attention kernel, as CUDA picks for an additive mask. Views, detach and allocations launch nothing
and move nothing. Bytes: every tensor an op reads (an expanded dimension once; an index op only the rows it
gathers; a write-only op - copy_, fill_, factories - none of its destination) and every tensor it writes.

Bytes and shapes are linear in the micro-batch (each tensor has at most one batch dimension), so a micro-batch of
B streams is interpolated from traces at 2 and 4 (op sequences checked equal; 1, 2 and 4 are traced themselves: at
one stream some of autograd's reshapes of permuted gradients are views, at more they copy); traces are cached.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import unittest.mock
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from megamemo.model import MemTransformerLM, ModelConfig, lm
from megamemo.model.attention import causal_attention, lookahead_attention
from megamemo.model.layers import RelAttention
from megamemo.model.memory import Memory, xl_update
from megamemo.plan import fused_trace

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARTS = ("input", "layer", "top", "output")  # the segments of one micro-batch, forward order
# and ("fwd", "memory"): one memory update (model/memory.py xl_update): Transformer-XL's of a layer's input, run
# once a layer; LaMemo's of the embedding FIFO, once on the first stage
FIELDS = ("gemm", "fp32", "aligned", "flops", "read", "write", "rows", "cols", "launches")  # Segment's arrays
# no kernel, no bytes: allocations and aliasing ops that are not schema views
FREE = {
    "detach",
    "_unsafe_view",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "alias",
    "_reshape_alias",
    "resize_",
    "set_",
}
# write their output without reading a destination (factories; in-place fills and copies)
WRITE_ONLY = {
    "zeros",
    "ones",
    "full",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "arange",
    "scalar_tensor",
    "fill_",
    "zero_",
    "bernoulli_",
    "uniform_",
    "normal_",
}
# read only the rows they gather: (index argument, gathered tensor argument)
GATHERS = {"embedding": (1, 0), "index_select": (2, 0), "gather": (2, 0)}
# CUDA's eager implementations that launch more than one kernel: layer norm's backward (the input's gradient, then
# the weight and bias gradients), a slice's or select's backward (zero-fill, then copy the gradient in), the
# embedding's backward (sort the indices, count, reduce by key: counted as 4)
KERNELS = {"native_layer_norm_backward": 2, "slice_backward": 2, "select_backward": 2, "embedding_dense_backward": 4}


@dataclass(frozen=True)
class Segment:
    """One part of a micro-batch, op by op (arrays of one entry per kernel-launching op, in issue order)."""

    names: tuple
    gemm: np.ndarray  # bool: a GEMM (mm, addmm, bmm, baddbmm, fused attention)
    fp32: np.ndarray  # bool: a GEMM on fp32 inputs
    aligned: np.ndarray  # bool: a GEMM whose matrices' leading dimensions and offsets are 16-byte multiples
    flops: np.ndarray  # GEMMs' FLOPs (torch.utils.flop_counter's formulas)
    read: np.ndarray  # bytes
    write: np.ndarray
    rows: np.ndarray  # GEMM output rows (per batch matrix)
    cols: np.ndarray  # GEMM output columns
    launches: np.ndarray  # kernels

    @property
    def bytes(self) -> np.ndarray:
        return self.read + self.write

    def scaled(self, other: Segment, t: float) -> Segment:
        """The line through this segment (t = 0) and `other` (t = 1), at t."""
        if self.names != other.names:
            raise ValueError("op sequences differ between the micro-batches traced")

        def f(a, c):
            return a + t * (c - a)

        return Segment(
            self.names,
            self.gemm,
            self.fp32,
            self.aligned & other.aligned,
            f(self.flops, other.flops),
            f(self.read, other.read),
            f(self.write, other.write),
            f(self.rows, other.rows),
            f(self.cols, other.cols),
            self.launches,
        )

    @staticmethod
    def concat(segs) -> Segment:
        segs = list(segs)

        def cat(k):
            return np.concatenate([getattr(s, k) for s in segs]) if segs else np.zeros(0)

        return Segment(sum((s.names for s in segs), ()), *(cat(k) for k in FIELDS))


@dataclass(frozen=True)
class Trace:
    """One micro-batch of `micro` streams on a rank: {(phase, part): Segment}, phase "fwd" / "bwd", part in PARTS;
    and the rank's parameter tensors (per lower layer, and the rest: embedding, biases, output side)."""

    micro: int
    segments: dict
    param_tensors_layer: int
    param_tensors_rest: int
    memory_per_layer: bool = False  # ("fwd", "memory") is a layer's update (Transformer-XL), else the model's

    def stage(self, layers: int, first: bool, last: bool, recompute: bool = False) -> tuple[Segment, Segment]:
        """(forward, backward) of a pipeline stage holding `layers` layers; recompute: activation checkpointing
        runs each layer's forward again ahead of its backward."""
        lower = layers - 1 if last else layers
        s = self.segments
        update = s["fwd", "memory"]
        each, once = ([update], []) if self.memory_per_layer else ([], [update])
        fwd = (
            ([s["fwd", "input"], *once] if first else [])
            + [s["fwd", "layer"], *each] * lower
            + ([s["fwd", "top"], *each, s["fwd", "output"]] if last else [])
        )

        def redo(part):
            return [s["fwd", part]] if recompute else []

        bwd = (
            ([s["bwd", "output"], *redo("top"), s["bwd", "top"]] if last else [])
            + [*redo("layer"), s["bwd", "layer"]] * lower
            + ([s["bwd", "input"]] if first else [])
        )
        return Segment.concat(fwd), Segment.concat(bwd)


def local_config(m, tp: int):
    """The model a tensor-parallel rank computes: its heads, feed-forward columns and vocabulary rows; 2 layers."""
    return dataclasses.replace(
        m, n_layer=2, n_head=m.n_head // tp, d_inner=m.d_inner // tp, n_token=m.n_token // tp, n_vocab=None
    )  # its rows (padding costs as any row)


def trace(m, micro: int, tp: int = 1, dtype: str = "bf16") -> Trace:
    """The op trace of one micro-batch of `micro` streams of model config m on a rank of tp, in dtype."""
    key = json.dumps(dataclasses.asdict(m), sort_keys=True)
    if micro in (1, 2, 4):
        return _traced(key, micro, tp, dtype)
    two, four = _traced(key, 2, tp, dtype), _traced(key, 4, tp, dtype)
    segs = {k: two.segments[k].scaled(four.segments[k], (micro - 2) / 2) for k in two.segments}
    return dataclasses.replace(two, micro=micro, segments=segs)


@functools.lru_cache(maxsize=64)
def _traced(key: str, micro: int, tp: int, dtype: str) -> Trace:
    return _run(local_config(ModelConfig.from_dict(json.loads(key)), tp), micro, DTYPES[dtype])


class _CudaKernels(TorchFunctionMode):
    """Dropout and scaled_dot_product_attention as CUDA runs them (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p, training = kwargs.get("p", 0.5), kwargs.get("training", True)
            if p == 0 or not training:
                return args[0]
            return torch.ops.aten.native_dropout(args[0], p, True)[0]
        if func is F.scaled_dot_product_attention and not kwargs.get("is_causal") and not kwargs.get("dropout_p"):
            q, k, v = args[:3]
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, kwargs.get("attn_mask"), True, 0.0, False, scale=kwargs.get("scale")
            )[0]
        return func(*args, **kwargs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a kernel reads of t (an expanded, stride-0 dimension once)."""
    return math.prod(n for n, s in zip(t.shape, t.stride(), strict=True) if s != 0) * t.element_size()


def _aligned(t: torch.Tensor) -> bool:
    """Whether a matrix (or batch of them) is laid out as cuBLAS's fast kernels need: its offset and every stride
    but the unit one 16-byte multiples (NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background",
    Tensor Core requirements)."""
    step = 16 // t.element_size()
    return t.storage_offset() % step == 0 and all(
        s % step == 0 for s, n in zip(t.stride(), t.shape, strict=True) if s != 1 and n > 1
    )


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.part, self.ops = ("fwd", "input"), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in FREE or not all(t.is_meta for t in _tensors((args, out))):
            return out  # ops on or from the host: the positions' frequencies, computed and copied once a process
        written = list(_tensors(out)) or list(_tensors(kwargs.get("out")))
        write = sum(t.numel() * t.element_size() for t in written)
        inputs = [a for a in args] + [v for k, v in kwargs.items() if k != "out"]
        if name in WRITE_ONLY:
            read = 0
        elif name == "copy_":
            read = _nbytes(args[1])
        elif name in GATHERS:
            idx, _ = GATHERS[name]
            read = _nbytes(args[idx]) + write
        else:
            read = sum(_nbytes(t) for t in _tensors(inputs))
        gemm = func.overloadpacket in flop_registry
        flops, rows, cols, fp32, aligned = 0, 0, 0, False, True
        if gemm:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            o = written[0]
            rows, cols = o.shape[-2], o.shape[-1]
            fp32 = next(_tensors(inputs)).dtype == torch.float32
            if "attention" not in name:  # the fused attention kernels pad what they load themselves
                aligned = all(_aligned(t) for t in [*_tensors(inputs), o] if t.dim() >= 2)
        self.ops.setdefault(self.part, []).append(
            (name, gemm, fp32, aligned, flops, read, write, rows, cols, KERNELS.get(name, 1))
        )
        return out


def _segment(ops: list) -> Segment:
    cols = list(zip(*ops, strict=True)) if ops else [()] * (len(FIELDS) + 1)
    return Segment(
        tuple(cols[0]),
        *(
            np.array(c, dtype=bool if f in ("gemm", "fp32", "aligned") else float)
            for f, c in zip(FIELDS, cols[1:], strict=True)
        ),
    )


def record(fn) -> Segment:
    """The kernels fn() issues (forward and any backward it runs) over meta tensors, counted as the model's are."""
    rec = _Recorder()
    with _CudaKernels(), rec:
        fn()
    return _segment(rec.ops.get(rec.part, []))


def _memory(cfg, B: int, dtype) -> Memory:
    """A full memory (mem_len rows) of meta tensors in the model's layout and dtypes (LaMemo's lse fp32)."""
    M, d, n, dh = cfg.mem_len, cfg.d_model, cfg.n_head, cfg.d_head
    if not cfg.has_memory:
        return Memory({}, batch_size=B)

    def empty(*shape, dt=dtype):
        return torch.empty(*shape, device="meta", dtype=dt)

    if cfg.lamemo:
        t = {"emb": empty(M, B, d)}
        for li in range(cfg.n_layer):
            t[f"ctx.{li}"], t[f"lse.{li}"] = empty(M, B, n, dh), empty(M, B, n, dt=torch.float32)
    else:
        t = {f"hid.{li}": empty(M, B, d) for li in range(cfg.n_layer)}
    return Memory(t, batch_size=B)


class _NoInit(TorchFunctionMode):
    """Builds a model without drawing its initial weights (torch.nn.init's functions return their tensor)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=8)
def _model(key: str, dtype):
    with torch.device("meta"), _NoInit():
        model = MemTransformerLM(ModelConfig.from_dict(json.loads(key))).to(dtype).train()
    model.check_inputs = False  # token-range checks read values: none on meta
    return model


def _run(cfg, B: int, dtype) -> Trace:
    model = _model(json.dumps(dataclasses.asdict(cfg), sort_keys=True), dtype)
    rec = _Recorder()
    top = cfg.n_layer - 1

    def mark(part):
        def hook(*_):
            rec.part = part

        return hook

    def before(module, args, li):
        rec.part = ("fwd", "top" if li == top else "layer")
        if li == 0 and args[0].requires_grad:  # its input's gradient done: the input side's backward follows
            args[0].register_hook(mark(("bwd", "input")))

    def after(module, args, out, li):
        rec.part = ("fwd", "output") if li == top else rec.part
        h = out[0] if isinstance(out, tuple) else out
        h.register_hook(mark(("bwd", "top" if li == top else "layer")))

    handles = [
        h
        for li, layer in enumerate(model.layers)
        for h in (
            layer.register_forward_pre_hook(functools.partial(before, li=li)),
            layer.register_forward_hook(functools.partial(after, li=li)),
        )
    ]

    def update(*args):
        was, rec.part = rec.part, ("fwd", "memory")
        updates.append(len(rec.ops.get(rec.part, [])))
        out = xl_update(*args)
        rec.part = was
        return out

    if cfg.attention == "fused":  # the Triton kernels cannot run on meta tensors: their stand-ins record them

        def emit(name, flops, read, write, rows, cols, launches):
            rec.ops.setdefault(rec.part, []).append(
                (name, flops > 0, dtype == torch.float32, True, flops, read, write, rows, cols, launches)
            )

        causal, lookahead = fused_trace.stand_ins(emit)
        for module in model.modules():
            if isinstance(module, RelAttention):
                module.causal, module.lookahead = causal, lookahead
    updates: list[int] = []  # the count of memory-update ops recorded as each update starts
    x = torch.empty(cfg.tgt_len, B, dtype=torch.long, device="meta")
    try:
        with _CudaKernels(), rec, unittest.mock.patch.object(lm, "xl_update", update):
            nll, _ = model(x, x, _memory(cfg, B, dtype))
            loss = nll.mean()
            rec.part = ("bwd", "output")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for module in model.modules():
            if isinstance(module, RelAttention):
                module.causal, module.lookahead = causal_attention, lookahead_attention
        model.zero_grad(set_to_none=True)
    segs = {(phase, part): _segment(rec.ops.get((phase, part), [])) for phase in ("fwd", "bwd") for part in PARTS}
    per_layer = cfg.has_memory and not cfg.lamemo
    one_update = rec.ops.get(("fwd", "memory"), [])[: updates[1] if per_layer else None]  # XL: layer 0's
    segs["fwd", "memory"] = _segment(one_update)
    tensors = len(list(model.layers[0].parameters()))
    rest = len(list(model.parameters())) - cfg.n_layer * tensors
    return Trace(B, segs, tensors, rest, per_layer)
