#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment (.venv) on a fresh machine.
#  - CPU machines (like the development ones): torch==2.13.0 is installed FIRST, so pip takes the CPU wheel
#    and never pulls a multi-GB CUDA build when deepspeed/megatron-core ask for torch.
#  - GPU clusters: set MEGAMEMO_TORCH_SPEC to the CUDA torch you want (e.g. "torch==2.5.1"), or install torch
#    into the environment yourself beforehand and set MEGAMEMO_TORCH_SPEC=skip.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAMEMO_VENV:-$here/.venv}"
torch_spec="${MEGAMEMO_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.megamemo-installed"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
want="$(sha256sum "$here/pyproject.toml" | cut -c1-16) $torch_spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] environment up to date ($venv)"
else
  if [ "$torch_spec" != "skip" ]; then
    echo "[setup] installing $torch_spec first"
    "$py" -m pip install -q "$torch_spec"
  fi
  echo "[setup] installing megamemo and its dependencies"
  "$py" -m pip install -q -e "$here[dev]"
  echo "$want" > "$stamp"
fi
# DeepSpeed JIT-builds a shared-memory comm op on first init (~2 min): keep the build in a cache that
# survives between runs.
mkdir -p "$here/.cache/torch_extensions"
