#!/usr/bin/env bash
# N local training processes on this machine: `megamemo train ARGS...` under megamemo's own launcher
# (megamemo/runtime/launcher.py: gloo on CPU, NCCL when the machine has GPUs; launch/device.sh decides,
# MEGAMEMO_DEVICE=auto|gpu|cpu overrides).
#   launch/local.sh [--max-restarts K] N --config configs/tiny-cpu.yaml [--data DIR] [--run-dir DIR] [train args...]
# Signals sent to this process (Ctrl-C, TERM, USR1, HUP) reach every worker, which finishes its step, saves and
# stops (exit 0); a second Ctrl-C kills them. The exit code is megamemo's (2: bad usage, config, data or
# checkpoint). A failure is recorded in <run_dir>/interruptions.jsonl; with --max-restarts K (torchrun's meaning),
# after a crash or a hang all workers are started again from the newest committed checkpoint, at most K times, one
# line per restart naming its cause (never after exit 2, nor a failure 3 times at the same step). Environment: OMP_NUM_THREADS (default: CPU cores / N, at least 1); MEGAMEMO_VENV (default: the repo's
# .venv); MEGAMEMO_TRAIN_CMD (default "megamemo train"); MASTER_PORT (default: a free one, so several runs can share
# a machine).
set -euo pipefail
# A signal that arrives before the launcher runs is remembered and handed to it (it passes it to the workers).
export MEGAMEMO_PENDING_SIGNALS=""
for sig in TERM INT HUP USR1; do trap "MEGAMEMO_PENDING_SIGNALS+=' $sig'" "$sig"; done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  echo "usage: launch/local.sh [--max-restarts K] N [megamemo train args...]   (N: number of processes)" >&2
  exit 2
}
restarts=()
case "${1:-}" in
  --max-restarts) [ "$#" -ge 2 ] || usage; restarts=(--max-restarts "$2"); shift 2 ;;
  --max-restarts=*) restarts=(--max-restarts "${1#*=}"); shift ;;
esac
if [ "${#restarts[@]}" -gt 0 ] && ! [[ "${restarts[1]}" =~ ^[0-9]+$ ]]; then
  echo "launch/local.sh: --max-restarts must be a number >= 0 (got '${restarts[1]}')" >&2; usage
fi
[ "$#" -ge 1 ] || usage
n="$1"; shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "launch/local.sh: N must be a positive integer (got '$n')" >&2; usage; }

# shellcheck source=../scripts/env.sh
source "$here/scripts/env.sh"      # the repo's venv on PATH
# the device (launch/device.sh): MEGAMEMO_DEVICE, else GPUs when torch sees any here (an inherited
# DS_ACCELERATOR=cpu, e.g. from scripts/env.sh on a machine whose nvidia-smi is not on PATH, does not choose)
megamemo_select_device "${MEGAMEMO_DEVICE:-auto}" || { rc=$?; [ "$rc" = 2 ] && usage; exit "$rc"; }

if ! (cd / && python -c "import megamemo.commands.launch, megamemo.runtime.launcher, megamemo.commands.train") 2>/dev/null; then
  echo "launch/local.sh: megamemo (with its train command) is not installed in $(command -v python || echo 'any python on PATH')." >&2
  echo "  Set up the environment first: bash scripts/setup.sh   (or point MEGAMEMO_VENV at one that has it)" >&2
  exit 1
fi
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  threads=$(( $(nproc) / n ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
echo "[launch/local] $n process(es) on $MEGAMEMO_DEVICE, OMP_NUM_THREADS=$OMP_NUM_THREADS${restarts[*]:+, ${restarts[*]}}: ${MEGAMEMO_TRAIN_CMD:-megamemo train} $*" >&2
exec python -m megamemo.commands.launch "${restarts[@]}" "$n" "$@"
