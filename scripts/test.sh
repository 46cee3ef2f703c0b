#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest (one session, as given).
# Without arguments: the single-process tests first, spread over the cores (pytest-xdist, -n 2), then the tests
# that start worker processes (`multiproc`), one at a time since each uses the cores itself. Both parts always run;
# the exit status fails if either does. MEGAMEMO_TEST_SERIAL=1 runs everything in one serial session instead.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh"
source "$here/scripts/env.sh"
cd "$here"
if [ "$#" -gt 0 ] || [ "${MEGAMEMO_TEST_SERIAL:-0}" = 1 ]; then
  exec python -m pytest -q "$@"
fi
workers="${MEGAMEMO_TEST_WORKERS:-2}"
rc_fast=0 rc_multi=0
echo "[test] single-process tests, $workers workers (pytest -m 'not multiproc' -n $workers)"
python -m pytest -q -m "not multiproc" -n "$workers" || rc_fast=$?
echo "[test] multi-process tests, one at a time (pytest -m multiproc)"
python -m pytest -q -m multiproc || rc_multi=$?
if [ "$rc_fast" -ne 0 ] || [ "$rc_multi" -ne 0 ]; then
  echo "[test] FAILED: single-process part exit $rc_fast, multi-process part exit $rc_multi" >&2
  exit 1
fi
echo "[test] both parts passed"
