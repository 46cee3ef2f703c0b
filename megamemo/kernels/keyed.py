"""Keyed dropout masks (train.dropout_masks: keyed): a mask element is a pure function of where it sits in the
single-process model, so every layout (DP, TP, PP, gradient accumulation, recomputation, a resume under another
layout) drops exactly what one process drops.

The coordinates of an element, and how they enter Philox-4x32-10 (megamemo/kernels/philox.py):
    key      k0 = the run seed (train.seed, < 2^32)      k1 = the optimizer step (applied steps before this one)
    counter  c0 = feature group: global feature index // 16 (attention: key position // 16)
             c1 = row: position in the site's tensor (LaMemo's memory rows first, then the segment's;
                  attention: the query row)
             c2 = the global stream (column) index: the micro-batch's first global column + its own column
                  (the position table, shared by every stream, has none: 0)
             c3 = digit level (2 bits) | site (4 bits) | layer (10 bits) | global head index (16 bits)
The element's byte at digit level d is byte (global feature index % 16) of the 16 bytes of Philox's output for
that counter at level d (byte j = bits 8(j%4) .. 8(j%4)+7 of output word j//4). Its 32-bit uniform number is
    U = byte@0 * 2^24 + byte@1 * 2^16 + byte@2 * 2^8 + byte@3,
and the element is kept when U >= T = round(p * 2^32): today's CPU kernel's test (kernels/dropout.py), exact to
2^-32. Two ways to compute the same mask:
  * `keep_bytes` (CPU, eager): the CPU kernel's byte-digit trick - level 0 for every element (one Philox output
    serves 16 elements), levels 1-3 only where the first digit ties with T's (1/256 of them);
  * `keep_full` (any device, traceable: torch.compile fuses it): all four levels, U built and compared: one
    32-bit number per element, no data-dependent shapes.
Under tensor parallelism a rank's features (the feed-forward's inner activation) or heads (attention) are a slice
of the global ones: the global index makes its slice of the mask the single device's. Every TP rank computes the
same mask for a replicated activation. Under data parallelism and gradient accumulation the global column does
it; under pipelining each stage computes its own layers' masks; a recomputed layer recomputes its masks.

`DropoutKey` is what the masks read of the run: the seed, the step and the micro-batch being computed (its first
global column). The trainer sets the step and micro-batch (megamemo/train/loop.py), a pipeline stage the
micro-batch of each pipe layer it runs (megamemo/parallel/pipeline.py); the model knows nothing of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import _KeepScale, _ReluKeepScale, _ties
from .philox import philox, philox_words32

# site -> (id, layout). layouts: "rows" [row, column, feature], "table" [row, feature] (no column: shared by every
# stream), "heads" [head, column, query row, key]
SITES = {
    "emb": (0, "rows"),
    "pos": (1, "table"),
    "out": (2, "rows"),
    "attn_out": (3, "rows"),
    "ff_inner": (4, "rows"),
    "ff_out": (5, "rows"),
    "att": (6, "heads"),
    "att_ahead": (7, "heads"),
}
SPLIT = ("ff_inner", "att", "att_ahead")  # sites whose features (heads) are split across TP ranks
GROUP = 16  # features per Philox output (16 bytes)
LEVEL_SHIFT, SITE_SHIFT, LAYER_SHIFT = 30, 26, 16
MAX_LAYERS, MAX_HEADS = 1 << 10, 1 << 16


def threshold(p: float) -> int:
    """T = round(p * 2^32): an element is dropped when its U < T."""
    return round(p * 2**32)


def digits(T: int) -> tuple[int, ...]:
    """T's base-256 digits, most significant first, without trailing zeros (U >= T is decided by the digits up
    to T's last nonzero one, the last compared with >=)."""
    d = [(T >> s) & 255 for s in (24, 16, 8, 0)]
    while len(d) > 1 and d[-1] == 0:
        d.pop()
    return tuple(d)


def site_word(site: str, layer: int) -> int:
    """c3 without the level and head: site and layer bits."""
    if site not in SITES:
        raise ValueError(f"keyed dropout: unknown site {site!r} (known: {', '.join(SITES)})")
    if not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"keyed dropout: layer {layer} outside [0, {MAX_LAYERS})")
    return (SITES[site][0] << SITE_SHIFT) | (layer << LAYER_SHIFT)


class DropoutKey:
    """The run's part of every mask's coordinates: seed, optimizer step, and the micro-batch being computed.
    columns[k]: the first global column of this rank's micro-batch k. `words` holds (seed, step, first column)
    as an int64 tensor on the model's device for the traced form (changed in place: no recompilation)."""

    def __init__(self, seed: int, columns=(0,), device="cpu"):
        if not 0 <= seed < 2**32:
            raise ValueError(f"train.seed: keyed dropout masks take a seed in [0, 2^32) (got {seed})")
        self.seed, self.columns = int(seed), [int(c) for c in columns]
        self.step, self.micro_batch = 0, 0
        self.words = torch.tensor([self.seed, 0, self.columns[0]], dtype=torch.int64, device=device)

    @property
    def first_column(self) -> int:
        if not 0 <= self.micro_batch < len(self.columns):
            raise ValueError(
                f"keyed dropout: micro-batch {self.micro_batch} is not one of this rank's {len(self.columns)}"
            )
        return self.columns[self.micro_batch]

    def set(self, step: int | None = None, micro_batch: int | None = None) -> DropoutKey:
        """The step (applied optimizer steps so far) and/or the micro-batch (index into columns) masks are drawn
        for from now on."""
        if step is not None and step != self.step:
            if not 0 <= step < 2**32:
                raise ValueError(f"keyed dropout: step {step} outside [0, 2^32)")
            self.step = int(step)
            self.words[1].fill_(self.step)  # a scalar fill: no host-to-device copy, no sync
        if micro_batch is not None and micro_batch != self.micro_batch:
            self.micro_batch = int(micro_batch)
            if self.micro_batch < len(self.columns):
                self.words[2].fill_(self.columns[self.micro_batch])
        return self

    def to(self, device) -> DropoutKey:
        self.words = self.words.to(device)
        return self


def coordinates(layout: str | None, shape, column, split: int, device):
    """(row, column, head, feature offset) of a site's tensor of `shape`: int64 tensors broadcastable to
    shape[:-1] (or ints), and the global index of its first feature. column: the micro-batch's first global
    column (int or 0-d tensor); split: this rank's TP rank for a split site, else 0."""
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    if layout == "rows":
        T, B, Fl = shape
        return ar(T).view(T, 1), ar(B).view(1, B) + column, 0, split * Fl
    if layout == "table":
        return ar(shape[0]), 0, 0, 0
    if layout == "heads":
        n, B, Q, _ = shape
        return ar(Q).view(1, 1, Q), (ar(B) + column).view(1, B, 1), (ar(n) + split * n).view(n, 1, 1), 0
    raise ValueError(f"keyed dropout: unknown layout {layout!r}")


def _groups(f0: int, Fl: int) -> tuple[int, int, int]:
    """(first group, number of groups, offset of feature f0 in the first group's bytes)."""
    g0 = f0 // GROUP
    return g0, (f0 + Fl - 1) // GROUP - g0 + 1, f0 - g0 * GROUP


def _last(t):
    return t.unsqueeze(-1) if isinstance(t, torch.Tensor) else t


def keep_full(shape, p: float, base, row, column, head, f0: int, k0, k1, device) -> torch.Tensor:
    """The keep mask (bool, `shape`) from all four digit levels: U per element, U >= T. base: site_word (int or
    0-d tensor); row, column, head from `coordinates`; k0, k1 the key (ints or 0-d tensors). Traceable."""
    *lead, Fl = shape
    g0, G, s = _groups(f0, Fl)
    c0 = torch.arange(g0, g0 + G, device=device)
    shifts = 8 * torch.arange(4, device=device)
    u = None
    for level in range(4):  # level by level: a few bytes per element held at a time
        words = philox(c0, _last(row), _last(column), _last(head) | base | (level << LEVEL_SHIFT), k0, k1)
        w = torch.stack(torch.broadcast_tensors(*words), -1)  # [*lead, G, 4 words]
        b = ((w.unsqueeze(-1) >> shifts) & 255).flatten(-3)[..., s : s + Fl]  # [*lead, Fl]: byte j of its group
        u = b if u is None else (u << 8) | b
    assert u is not None
    return u >= threshold(p)


def _tie_keep(dtype, T: int, c0, c1, c2, c3, j, k0: int, k1: int) -> torch.Tensor:
    """Keep values (dtype) of elements whose first digit ties with T's: their digits at levels 1-3 (one Philox
    call for the three levels; counters c0..c3 1-D, c3 without the level; j the byte in the group) against T's."""
    levels = (torch.arange(1, 4) << LEVEL_SHIFT).view(3, 1)
    words = philox_words32(c0, c1, c2, c3 | levels, k0, k1)
    w = torch.stack(torch.broadcast_tensors(*words), -1).view(torch.uint8)  # [3, k, 16]
    b = w.gather(2, j.view(1, -1, 1).expand(3, -1, 1)).squeeze(2).to(torch.int32)  # [3, k]
    rest = (b[0] << 16) | (b[1] << 8) | b[2]
    return torch.ge(rest, T & 0xFFFFFF, out=torch.empty(rest.shape, dtype=dtype))


def keep_bytes(
    shape, p: float, base: int, row, column, head, f0: int, k0: int, k1: int, dtype=torch.bool
) -> torch.Tensor:
    """keep_full's mask on the CPU in eager mode, written in `dtype` (1 keep, 0 drop), by the byte-digit trick.
    The integer work runs in inference mode (no autograd bookkeeping per operation) into an ordinary tensor, which
    a backward may then save."""
    out = torch.empty(shape, dtype=dtype)
    with torch.inference_mode():
        return _fill_bytes(out, p, base, row, column, head, f0, k0, k1)


def _fill_bytes(out, p: float, base: int, row, column, head, f0: int, k0: int, k1: int) -> torch.Tensor:
    *lead, Fl = out.shape
    dtype = out.dtype
    T = threshold(p)
    if T <= 0 or T >= 2**32:
        return out.fill_(T <= 0)
    dig = digits(T)
    g0, G, s = _groups(f0, Fl)
    c0 = torch.arange(g0, g0 + G)
    words = philox_words32(c0, _last(row), _last(column), _last(head) | base, k0, k1)
    b = torch.stack(torch.broadcast_tensors(*words), -1).view(torch.uint8).flatten(-2)[..., s : s + Fl]
    if len(dig) == 1:
        return torch.ge(b, dig[0], out=out)
    torch.gt(b, dig[0], out=out)
    idx = _ties(b.reshape(-1), dig[0])
    if idx.numel():
        f, li = idx % Fl + f0, idx // Fl
        flat = [torch.as_tensor(t).expand(*lead).reshape(-1)[li] for t in (row, column, head)]
        out.view(-1)[idx] = _tie_keep(dtype, T, f // GROUP, flat[0], flat[1], flat[2] | base, f % GROUP, k0, k1)
    return out


class KeyedDropout(nn.Dropout):
    """nn.Dropout (same p, same state_dict) whose mask is keyed by the element's coordinates (module docstring):
    `site` and `layer` say where it sits, `split` this rank's TP rank for a site split across ranks (else 0),
    `key` the run's DropoutKey; relu=True applies a ReLU first (the feed-forward's ReluDropout). On the CPU in
    eager mode the byte-digit form and the CPU kernel's one-pass scale (kernels/dropout.py); elsewhere, and
    under torch.compile, the traceable form."""

    keyed = True

    def __init__(self, p: float, key: DropoutKey, site: str, layer: int = 0, relu: bool = False, split: int = 0):
        super().__init__(p)
        self.key, self.site, self.layer, self.relu, self.split = key, site, layer, relu, split
        self.layout = SITES[site][1] if site in SITES else None
        self.base = site_word(site, layer)
        # the same as a tensor for the traced form: a buffer, so that compiled layers share one graph (an int
        # attribute would be a constant of each layer's); not persistent (no state_dict entry)
        self.register_buffer("base_word", torch.tensor(self.base, dtype=torch.int64), persistent=False)

    def forward(self, x):
        if not self.training or self.p == 0:
            return F.relu(x) if self.relu else x
        scale = 1.0 / (1.0 - self.p)
        if x.device.type == "cpu" and not torch.compiler.is_compiling() and x.is_floating_point():
            k = self.key
            row, col, head, f0 = coordinates(self.layout, x.shape, k.first_column, self.split, x.device)
            keep = keep_bytes(x.shape, self.p, self.base, row, col, head, f0, k.seed, k.step, x.dtype)
            return (_ReluKeepScale if self.relu else _KeepScale).apply(x, keep, scale)
        w = self.key.words
        row, col, head, f0 = coordinates(self.layout, x.shape, w[2], self.split, x.device)
        keep = keep_full(x.shape, self.p, self.base_word, row, col, head, f0, w[0], w[1], x.device)
        y = F.relu(x) if self.relu else x
        return y * keep.to(y.dtype) * scale

    def extra_repr(self) -> str:
        return (
            f"p={self.p}, site={self.site}, layer={self.layer}"
            + (f", split={self.split}" if self.split else "")
            + (", relu=True" if self.relu else "")
        )
