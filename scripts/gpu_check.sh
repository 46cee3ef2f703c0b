#!/usr/bin/env bash
# The device check: run this first on any machine with a GPU (README "On a GPU"). One command answers every open
# GPU question - environment, `pytest -m gpu`, the step benches, a 300-step training run with kill -9 / resume /
# convert / eval, the planner beside what was measured, the multi-GPU set - into DIR/gpu-report.md and .json.
# Each section has its own time budget (about 9 minutes in all on one GPU); one failing never stops the others.
#
#   bash scripts/gpu_check.sh --out gpu-report            # on the GPU machine, in the project's environment
#   bash scripts/gpu_check.sh --out /tmp/r --device cpu   # the same plumbing at tiny sizes (what its test runs)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${MEGAMEMO_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$here/.venv/bin/python" ]; then py="$here/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "$here/scripts/gpu_check.py" "$@"
