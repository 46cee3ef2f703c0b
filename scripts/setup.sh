#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment (.venv), for one target:
#
#   bash scripts/setup.sh                         cpu (default): torch==2.13.0 as pip's own sources give it (the
#                                                 CPU wheel on the development machines)
#   MEGAMEMO_TARGET=v100 bash scripts/setup.sh    V100 nodes: torch 2.13.0+cu126 (the last CUDA line with sm_70
#                                                 kernels; any driver that runs CUDA 12)
#   MEGAMEMO_TARGET=a100 bash scripts/setup.sh    A100 / H100 nodes: the same cu126 build (sm_80, sm_90)
#   MEGAMEMO_TARGET=cu130 bash scripts/setup.sh   A100 / H100 with a driver >= 580: torch 2.13.0+cu130 (no V100)
#   MEGAMEMO_TARGET=preinstalled ...              keep the torch already in the venv (a site build)
# MEGAMEMO_TORCH_INDEX=URL replaces the target's wheel index (e.g. https://download.pytorch.org/whl/cpu for the
# CPU wheel on a machine where plain pip would take PyPI's CUDA build).
#
# torch goes in first; then megamemo and its dependencies with torch held at exactly the installed build by a
# constraints file, so that no requirement (megatron-core's torch>=2.6, deepspeed's) can swap it for another;
# afterwards the torch build is checked again and the script fails, naming both, if it changed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAMEMO_VENV:-$here/.venv}"
target="${MEGAMEMO_TARGET:-cpu}"
torch_version=2.13.0
stamp="$venv/.megamemo-installed"
constraints="$venv/.megamemo-constraints.txt"
die() { echo "[setup] error: $*" >&2; exit 2; }

[ -z "${MEGAMEMO_TORCH_SPEC:-}" ] \
  || die "MEGAMEMO_TORCH_SPEC is gone: pip could replace a bare spec; use MEGAMEMO_TARGET=cpu|v100|a100|cu130|preinstalled"
case "$target" in
  cpu) index="" ; cuda="" ;;
  v100|a100) index=https://download.pytorch.org/whl/cu126 ; cuda=12.6 ;;
  cu130) index=https://download.pytorch.org/whl/cu130 ; cuda=13.0 ;;
  preinstalled) index="" ; cuda="" ;;
  *) die "MEGAMEMO_TARGET must be cpu, v100, a100, cu130 or preinstalled (got '$target')" ;;
esac
index="${MEGAMEMO_TORCH_INDEX:-$index}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
torch_build() { "$py" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null || echo "none none"; }

want="$(sha256sum "$here/pyproject.toml" | cut -c1-16) $target ${index:-pip}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] environment up to date ($venv: $target, torch $(torch_build))"
else
  if [ "$target" != preinstalled ]; then
    echo "[setup] installing torch==$torch_version for $target${index:+ from $index}"
    "$py" -m pip install -q "torch==$torch_version" ${index:+--index-url "$index"}
  fi
  read -r have have_cuda <<<"$(torch_build)"
  [ "$have" != none ] || die "no torch in $venv (MEGAMEMO_TARGET=preinstalled needs one installed first)"
  if [ -n "$cuda" ] && [ "$have_cuda" != "$cuda" ]; then
    die "MEGAMEMO_TARGET=$target wants a CUDA $cuda build of torch, $venv has $have (CUDA $have_cuda)"
  fi
  if [ "$target" = cpu ] && [ "$have_cuda" != None ]; then
    echo "[setup] note: torch $have is a CUDA build; for the CPU wheel set MEGAMEMO_TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
  fi
  echo "torch==$have" > "$constraints"
  echo "[setup] installing megamemo and its dependencies (torch held at $have)"
  "$py" -m pip install -q -c "$constraints" -e "$here[dev,parquet,eval,s3,gcs,docs]"
  read -r after after_cuda <<<"$(torch_build)"
  [ "$after" = "$have" ] \
    || die "installing the dependencies changed torch from $have (CUDA $have_cuda) to $after (CUDA $after_cuda)"
  # lm-eval 0.4.x has no plugin discovery: a .pth hook registers the model `megamemo` for the lm_eval command
  "$py" -m megamemo.export.lm_eval_plugin install
  echo "$want" > "$stamp"
  echo "[setup] ready: $venv ($target, torch $have, CUDA $have_cuda)"
fi
# DeepSpeed JIT-builds ops on first use: keep the builds in a cache that survives between runs.
mkdir -p "$here/.cache/torch_extensions"
