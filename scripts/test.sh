#!/usr/bin/env bash
# Set up (idempotent), run the static checks (scripts/lint.sh: ruff and mypy; a finding fails the run before any
# test starts) and run the whole test suite. Extra arguments go to pytest (after ours: `-n 0` runs in one
# process). Two pytest-xdist workers by default (MEGAMEMO_TEST_WORKERS): one worker leaves the 2 cores of CI about
# half idle (a multi-process test's ranks wait on each other, on gloo, on files and on their children), two keep
# them busy. The multi-process tests go first (tests/conftest.py) and share one cache of reference runs; a worker
# that runs out of tests takes half of the other's queue (--dist worksteal), so both end within one test.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh"
source "$here/scripts/env.sh"
cd "$here"
bash "$here/scripts/lint.sh"
exec python -m pytest -q -n "${MEGAMEMO_TEST_WORKERS:-2}" --dist worksteal "$@"
