#!/usr/bin/env bash
# The device check: run this first on any machine with a GPU (README "On a GPU"). One command answers every open
# GPU question - versions, the attention kernel bench (first), lamemo-1.3b's full-depth step in every form auto
# would time, a 60-step training run with kill -9 / resume / convert / eval, the planner beside what was measured,
# `pytest -m gpu`, the multi-GPU set - into DIR/gpu-report.md and .json (scripts/gpu_check.py says how).
# Each section has its own time budget (530 s in all on one GPU); one failing never stops the others, and every
# section's rows are written as they come, so a kill keeps what ran.
#
#   bash scripts/gpu_check.sh --plan                      # the budgets, without running anything
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
