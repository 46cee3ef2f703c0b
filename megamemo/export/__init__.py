"""Using a trained model outside megamemo: `megamemo export hf` (a Hugging Face transformers directory that needs
no megamemo, hf.py with the model's restatement in hf_code/) and lm-evaluation-harness (`megamemo harness`, the
registered model `megamemo`: harness.py, its request harness_request.py, apart so that the command's flags need no
lm-eval)."""
