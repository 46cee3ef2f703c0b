"""CPU kernel: dropout with a cheaper mask (megamemo.kernels swaps it in for the model's nn.Dropout on a CPU).

torch's CPU dropout draws its mask with `bernoulli_` (one 32-bit generator call and a float compare per element,
then two multiplications through a bool tensor), which made it 12-18% of a training step. Here an element is
dropped when a uniform 32-bit number U from the default generator is below T = round(p * 2^32): the law is exact
to 2^-32 (finer than torch.rand's 2^-24). U is compared with T digit by digit in base 256 and a digit is drawn
only when the digits above it tie with T's: one random byte per element, a second byte for the 1/256 that tie,
and so on; a quarter of the generator's work of drawing all 32 bits, which dominated the old mask's cost. The
0/1 mask is built in the input's dtype by comparisons that write it directly; the 1/(1-p) scale rides in the one
multiplication each way (addcmul). With relu=True a preceding ReLU shares that pass and saves nothing of its
own: the backward reads the output, which the next layer keeps anyway. Same distribution as `F.dropout`, not
the same masks. Off the CPU (CUDA's fused kernel) it is `F.dropout` itself, so a model moved to a GPU after the
swap still runs torch's own dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_DIRECT_TIES = 1 << 14  # below this many bytes, find ties with one nonzero over all of them


def random_bytes(n: int, device=None) -> torch.Tensor:
    """n uniform random bytes (uint8) from the default generator, as the head of a buffer of whole 64-bit draws."""
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=device).random_(-(2**63), None)
    return words.view(torch.uint8)[:n]


def _ties(b: torch.Tensor, t: int) -> torch.Tensor:
    """Positions (int64, ascending) where the bytes b equal t. Past a few thousand bytes the equality is first
    tested eight bytes at a time (as int64 words), so only the ~3% of words holding a tie are searched."""
    n = b.numel()
    if n < _DIRECT_TIES:
        return (b == t).nonzero().view(-1)
    eq = torch.empty(-(-n // 8) * 8, dtype=torch.uint8, device=b.device)
    eq[n:].zero_()
    torch.eq(b, t, out=eq[:n])
    words = (eq.view(torch.int64) != 0).nonzero().view(-1)
    row, col = eq.view(-1, 8)[words].nonzero().unbind(1)
    return words[row] * 8 + col


def _fill_keep(out: torch.Tensor, digits: tuple[int, ...]) -> torch.Tensor:
    """Fill out (1-D, any dtype) with 1 where a fresh uniform number U >= T (keep) and 0 where U < T (drop), T
    given by its base-256 digits, most significant first. U's digits are drawn level by level (random_bytes):
    first one per element, then one per element that tied, in ascending order, and so on."""
    b = random_bytes(out.numel(), out.device)
    if len(digits) == 1:
        return torch.ge(b, digits[0], out=out)
    torch.gt(b, digits[0], out=out)
    idx = _ties(b, digits[0])
    if idx.numel():
        out[idx] = _fill_keep(torch.empty(idx.numel(), dtype=out.dtype, device=out.device), digits[1:])
    return out


def keep_mask(shape, p: float, device=None, dtype=torch.bool) -> torch.Tensor:
    """1 (True) with probability 1 - round(p * 2^32) / 2^32, else 0, from the default generator."""
    out = torch.empty(shape, dtype=dtype, device=device)
    T = round(p * 2**32)
    if T <= 0 or T >= 2**32:
        return out.fill_(T <= 0)
    _fill_keep(out.view(-1), tuple((T >> s) & 255 for s in (24, 16, 8, 0)))
    return out


_ZERO = torch.zeros(())


class _KeepScale(torch.autograd.Function):
    """x * keep * scale (keep a 0/1 mask, saved) in one pass each way."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(_ZERO.to(x.dtype), x, keep, value=scale)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return torch.addcmul(_ZERO.to(g.dtype), g, keep, value=ctx.scale), None, None


class _ReluKeepScale(torch.autograd.Function):
    """relu(x) * keep * scale. Nothing of its own is saved: the output y (which the next layer keeps anyway) is
    nonzero exactly where both x > 0 and keep, so the gradient is scale * g where y > 0."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        y = torch.addcmul(_ZERO.to(x.dtype), x, keep, value=scale).relu_()
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(g, y, 0).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool = True, relu: bool = False) -> torch.Tensor:
    """F.dropout(F.relu(x) if relu else x, p, training). On the CPU the ReLU costs no pass of its own in the
    backward (it shares the dropout's)."""
    if not training or p == 0:
        return F.relu(x) if relu else x
    if x.device.type != "cpu" or p >= 1 or not x.is_floating_point():
        return F.dropout(F.relu(x) if relu else x, p, training)
    keep = keep_mask(x.shape, p, x.device, x.dtype)
    return (_ReluKeepScale if relu else _KeepScale).apply(x, keep, 1.0 / (1.0 - p))


class CpuDropout(nn.Dropout):
    """nn.Dropout (same p, same state_dict) with the cheaper CPU mask of this module; relu=True applies a ReLU
    first (in the same pass): the stand-in for the model's ReluDropout."""

    def __init__(self, p: float = 0.5, relu: bool = False):
        super().__init__(p)
        self.relu = relu

    def forward(self, x):
        return dropout(x, self.p, self.training, self.relu)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu=True" if self.relu else "")
