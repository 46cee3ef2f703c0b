"""The run's typed, validated configuration (run.py: one YAML per run, `--set` overrides, the presets' checks). Above
model and parallel, whose own configs and support checks it composes; below everything that runs."""
