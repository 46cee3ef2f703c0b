#!/usr/bin/env bash
# The static checks (configured in pyproject.toml: [tool.ruff], [tool.mypy]); scripts/test.sh runs them before
# pytest, so the README's test command and CI (.ci/run) do too:
#   ruff check            pycodestyle, pyflakes, import order, bugbear, pyupgrade, line length 120, complexity 15
#   ruff format --check   the formatter's layout
#   mypy                  megamemo/ at the strictness stated in pyproject.toml
# Every tool runs; the exit status is 1 when any of them found something, and the last line names which.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/env.sh"
cd "$here"
paths=(megamemo tests scripts bench)
failed=()
echo "[lint] ruff check ${paths[*]}"
ruff check "${paths[@]}" || failed+=("ruff check")
echo "[lint] ruff format --check ${paths[*]}"
ruff format --check "${paths[@]}" || failed+=("ruff format --check")
echo "[lint] mypy (megamemo/)"
mypy || failed+=("mypy")
if [ ${#failed[@]} -gt 0 ]; then
  printf -v names '%s; ' "${failed[@]}"
  echo "[lint] FAILED: ${names%; }" >&2
  exit 1
fi
echo "[lint] clean"
