"""The single-device model: plain PyTorch, no parallel code. See lm.py for the entry point; scoring.py is the one loop
that scores a model over segments with memory carried (validation, eval, probes, analyze)."""

from .config import VARIANTS, ModelConfig
from .lm import MemTransformerLM
from .memory import Memory

__all__ = ["ModelConfig", "MemTransformerLM", "Memory", "VARIANTS"]
