"""A run's configuration, composed (run.py): one YAML file per run, `--set` overrides, declared sections (fields.py:
pydantic dataclasses with their types, choices and bounds) and each
section's checks. The sections belong to the packages that use them (the model's, the data's, the parallel
layout's, training's); this package imports none of them: it sits right above util, below everything else."""
