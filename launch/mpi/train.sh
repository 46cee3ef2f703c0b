#!/usr/bin/env bash
# `megamemo train ARGS...` as N MPI ranks under mpirun; each rank learns its rank/size from the MPI launcher
# (PMI_RANK / OMPI_COMM_WORLD_RANK, then mpi4py: megamemo/runtime/dist.py), and torch.distributed runs over gloo
# (CPU) or NCCL (GPU).
#   launch/mpi/train.sh N --config configs/tiny-cpu.yaml [--run-dir DIR] [megamemo train args...]
# Environment:
#   MPIRUN                 the mpirun to use (default: mpirun on PATH after the repo's venv: the MPICH wheel)
#   MEGAMEMO_MPI_HOSTFILE  hostfile for several machines (default: all ranks on this machine)
#   MEGAMEMO_MPIRUN_ARGS   extra mpirun options, e.g. "-ppn 8" (MPICH) or "--map-by ppr:8:node" (Open MPI)
#   MASTER_ADDR/PORT       rendezvous; default 127.0.0.1 on one machine, else rank 0's host, and a free port
#   OMP_NUM_THREADS        default: CPU cores / N on one machine (at least 1)
#   MEGAMEMO_TRAIN_CMD     the training command (default "megamemo train")
#   NCCL_*, GLOO_*, TORCH_*, PYTORCH_*, CUDA_*   reach every rank (Open MPI: named with -x, launch/forward.sh), e.g.
#                          NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, CUDA_VISIBLE_DEVICES
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

usage() { echo "usage: launch/mpi/train.sh N [megamemo train args...]   (N: number of MPI ranks)" >&2; exit 2; }
[ "$#" -ge 1 ] || usage
n="$1"; shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "launch/mpi/train.sh: N must be a positive integer (got '$n')" >&2; usage; }

# shellcheck source=../../scripts/env.sh
source "$here/scripts/env.sh"
# the device (launch/device.sh): MEGAMEMO_DEVICE, else GPUs when torch sees any here (an inherited
# DS_ACCELERATOR=cpu, e.g. from scripts/env.sh on a machine whose nvidia-smi is not on PATH, does not choose)
megamemo_select_device "${MEGAMEMO_DEVICE:-auto}" || { rc=$?; [ "$rc" = 2 ] && usage; exit "$rc"; }

train_cmd="${MEGAMEMO_TRAIN_CMD:-megamemo train}"
read -r -a cmd <<<"$train_cmd"
if [ "$train_cmd" = "megamemo train" ] && ! (cd / && python -c "import megamemo.commands.train, mpi4py") 2>/dev/null; then
  echo "launch/mpi/train.sh: megamemo (with its train command) and mpi4py are not installed in $(command -v python || echo 'any python on PATH')." >&2
  echo "  Set up the environment first: bash scripts/setup.sh   (or point MEGAMEMO_VENV at one that has them)" >&2
  exit 1
fi
mpirun="${MPIRUN:-mpirun}"
command -v "$mpirun" >/dev/null || { echo "launch/mpi/train.sh: $mpirun not found (pip install mpich, or set MPIRUN)" >&2; exit 1; }

opts=(-np "$n")
if [ -n "${MEGAMEMO_MPI_HOSTFILE:-}" ]; then
  [ -f "$MEGAMEMO_MPI_HOSTFILE" ] || { echo "launch/mpi/train.sh: hostfile $MEGAMEMO_MPI_HOSTFILE does not exist" >&2; exit 1; }
else
  export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  if [ -z "${OMP_NUM_THREADS:-}" ]; then
    threads=$(( $(nproc) / n ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
  fi
fi

if "$mpirun" --version 2>&1 | grep -q "Open MPI\|OpenRTE\|PRRTE"; then
  # Open MPI: environment variables travel only when named (launch/forward.sh: MEGAMEMO_*, MASTER_*, NCCL_*,
  # GLOO_*, TORCH_*, PYTORCH_*, CUDA_*, ..., and PATH / LD_LIBRARY_PATH here); refuses root without the flag.
  # shellcheck source=../forward.sh
  source "$here/launch/forward.sh"
  [ -n "${MEGAMEMO_MPI_HOSTFILE:-}" ] && opts+=(--hostfile "$MEGAMEMO_MPI_HOSTFILE")
  [ "$(id -u)" = 0 ] && opts+=(--allow-run-as-root)
  [ "$n" -gt "$(nproc)" ] && [ -z "${MEGAMEMO_MPI_HOSTFILE:-}" ] && opts+=(--oversubscribe)
  for v in $(megamemo_forwarded_env PATH LD_LIBRARY_PATH); do opts+=(-x "$v"); done
else
  # MPICH / Intel MPI (Hydra): the whole environment travels by default.
  [ -n "${MEGAMEMO_MPI_HOSTFILE:-}" ] && opts+=(-f "$MEGAMEMO_MPI_HOSTFILE")
fi
# shellcheck disable=SC2206
extra=(${MEGAMEMO_MPIRUN_ARGS:-})
echo "[launch/mpi] $mpirun ${opts[*]} ${extra[*]} $train_cmd $*" >&2
exec "$mpirun" "${opts[@]}" "${extra[@]}" "${cmd[@]}" "$@"
