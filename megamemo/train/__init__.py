"""Training: what `megamemo train` runs (run.py; its flags: megamemo/commands/train.py), the run's config (config.py)
and vocabulary (vocab.py), everything built in order on every rank (build.py), its data streams (data.py), the
DeepSpeed engine (engine.py), how its layers compute (speedups.py, forms.py), the step loop (loop.py), numerics
checks and spike rollbacks (numerics.py, rollback.py), validation (validate.py), metrics (metrics.py), the resumable
state handed to the checkpointer (resumable.py), the conversion probe each checkpoint records (probe_record.py) and
`megamemo replay` (replay.py)."""
