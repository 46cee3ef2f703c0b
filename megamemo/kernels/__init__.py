"""CPU kernels for the plain-PyTorch model, and the one switch that applies them.

The model (megamemo.model) is plain PyTorch: nn.Dropout, the feed-forward's ReluDropout, masked_fill. This room
holds what makes a training step faster on the CPU, swapped into a built model by `apply_kernels`:
  dropout.py   CpuDropout: a base-256 dropout mask (a quarter of the generator's work) and ReLU+dropout in one pass
  masking.py   add_mask_bias: the attention mask added as a 0/-inf bias (masked_fill is ~5x slower on CPU)
Chosen by `train.kernels` (auto | plain | cpu): auto is cpu on a CPU device and plain elsewhere (CUDA's own
dropout and masked_fill). It imports only torch and megamemo.model.
"""
from .apply import (ATTENTIONS, KERNELS, apply_attention, apply_kernels, attention_in_use, kernels_in_use,
                    resolve_attention, resolve_kernels)

__all__ = ["ATTENTIONS", "KERNELS", "apply_attention", "apply_kernels", "attention_in_use", "kernels_in_use",
           "resolve_attention", "resolve_kernels"]
