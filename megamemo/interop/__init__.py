"""Checkpoints between forms: any checkpoint loaded as a model (load.py: `load_model` and `open_model`, which every
consumer uses; its errors are LoadError), a sharded run written as one single-device checkpoint (convert.py,
`megamemo convert`), the vocabulary a checkpoint records (vocabulary.py), and the reference LaMemo code's format in
(reference.py, importer.py, score.py for `megamemo reference-score`)."""
