"""megamemo: memory-recurrent language models (LaMemo, Transformer-XL, Transformer+RPE) trained at scale."""

__version__ = "0.1.0"
