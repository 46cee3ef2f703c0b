"""Training: the `megamemo train` command (cli.py), its data streams (data.py), the DeepSpeed engine (engine.py),
the step loop (loop.py), validation (validate.py), metrics, the resumable state handed to the checkpointer
(resumable.py) and the conversion probe each checkpoint records (probe_record.py)."""
