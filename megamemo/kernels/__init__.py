"""Kernels for the plain-PyTorch model, and the switches that apply them: the CPU kernels, how dropout masks are
drawn, the attention form and compiled layers.

The model (megamemo.model) is plain PyTorch: nn.Dropout, the feed-forward's ReluDropout, masked_fill. This room
holds what makes a training step faster on the CPU, swapped into a built model by `apply_kernels`:
  dropout.py   CpuDropout: a base-256 dropout mask (a quarter of the generator's work) and ReLU+dropout in one pass
  masking.py   add_mask_bias: the attention mask added as a 0/-inf bias (masked_fill is ~5x slower on CPU)
Chosen by `train.kernels` (auto | plain | cpu): auto is cpu on a CPU device and plain elsewhere (CUDA's own
dropout and masked_fill).
And how dropout masks are drawn (train.dropout_masks: stream | keyed), swapped in by `apply_dropout_masks`:
  keyed.py     KeyedDropout: a mask that is a pure function of the element's coordinates in the single-process
               model (Philox-4x32-10, philox.py), so that every parallel layout drops the same elements
  sites.py     which dropout of a built model is which site (its coordinates' site and layer)
And the attention form (model.attention: eager | flex | fused | auto), swapped in by `apply_attention`:
  flex.py      LaMemo's two attentions through FlexAttention (one fused kernel per call, forward and backward)
  fused.py     the same through the Triton kernels of relattn_triton.py (CUDA, or the CPU in Triton's interpreter)
  form_check.py  a training run's start-up check of its forms against eager, at the run's own shapes
  compiler.py  regional torch.compile of the decoder layers (train.compile) and the TorchDynamo switch it needs
It imports only torch, megamemo.model and megamemo.util.
"""

from .apply import (
    ATTENTIONS,
    KERNELS,
    apply_attention,
    apply_kernels,
    attention_in_use,
    kernels_in_use,
    resolve_attention,
    resolve_kernels,
)
from .keyed import DropoutKey
from .sites import MODES as DROPOUT_MASKS
from .sites import apply_dropout_masks, dropout_masks_in_use

__all__ = [
    "ATTENTIONS",
    "DROPOUT_MASKS",
    "KERNELS",
    "DropoutKey",
    "apply_attention",
    "apply_dropout_masks",
    "apply_kernels",
    "attention_in_use",
    "dropout_masks_in_use",
    "kernels_in_use",
    "resolve_attention",
    "resolve_kernels",
]
