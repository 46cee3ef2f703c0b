"""Checkpoints between forms: a sharded run to one single-device checkpoint (convert.py, `megamemo convert`, and
`load_model`, which every consumer uses), and the reference LaMemo code's format in (reference.py, importer.py,
score.py for `megamemo reference-score`)."""
