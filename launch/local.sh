#!/usr/bin/env bash
# N local training processes on this machine: `megamemo train ARGS...` under torchrun (gloo on CPU, NCCL when
# the machine has GPUs; launch/device.sh decides, MEGAMEMO_DEVICE=auto|gpu|cpu overrides).
#   launch/local.sh N --config configs/tiny-cpu.yaml [--data DIR] [--run-dir DIR] [megamemo train args...]
# Environment: OMP_NUM_THREADS (default: CPU cores / N, at least 1); MEGAMEMO_VENV (default: the repo's .venv);
# MEGAMEMO_TRAIN_CMD (default "megamemo train"). torchrun picks a free rendezvous port, so several runs can
# share a machine.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { echo "usage: launch/local.sh N [megamemo train args...]   (N: number of processes)" >&2; exit 2; }
[ "$#" -ge 1 ] || usage
n="$1"; shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "launch/local.sh: N must be a positive integer (got '$n')" >&2; usage; }

# shellcheck source=../scripts/env.sh
source "$here/scripts/env.sh"      # the repo's venv on PATH
# the device: MEGAMEMO_DEVICE, else a DS_ACCELERATOR the caller set, else GPUs when nvidia-smi lists any
megamemo_select_device "${MEGAMEMO_DEVICE:-${DS_ACCELERATOR:-auto}}" || usage

train_cmd="${MEGAMEMO_TRAIN_CMD:-megamemo train}"
read -r -a cmd <<<"$train_cmd"
if [ "$train_cmd" = "megamemo train" ]; then
  if ! command -v torchrun >/dev/null || ! (cd / && python -c "import megamemo.train.cli") 2>/dev/null; then
    echo "launch/local.sh: megamemo (with its train command) is not installed in $(command -v python || echo 'any python on PATH')." >&2
    echo "  Set up the environment first: bash scripts/setup.sh   (or point MEGAMEMO_VENV at one that has it)" >&2
    exit 1
  fi
  cmd=(-m megamemo train)
else
  command -v torchrun >/dev/null || { echo "launch/local.sh: torchrun not found (install torch: bash scripts/setup.sh)" >&2; exit 1; }
  cmd=(--no-python "${cmd[@]}")
fi

if [ -z "${OMP_NUM_THREADS:-}" ]; then
  threads=$(( $(nproc) / n ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
echo "[launch/local] $n process(es) on $MEGAMEMO_DEVICE, OMP_NUM_THREADS=$OMP_NUM_THREADS: $train_cmd $*" >&2
exec torchrun --standalone --nnodes=1 --nproc-per-node="$n" "${cmd[@]}" "$@"
