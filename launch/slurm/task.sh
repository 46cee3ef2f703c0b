#!/bin/bash
# One training task of launch/slurm/train.sbatch (srun starts one per GPU / per node): runs `megamemo train ARGS`
# on the host or in MEGAMEMO_CONTAINER. Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, which
# megamemo's rank discovery (megamemo/runtime/dist.py) maps itself; MASTER_ADDR/MASTER_PORT come from the batch
# script.
#
# Signals. USR1 means "finish the step, save, exit 0". Python's default action for USR1 is to die, so a USR1
# that arrives before megamemo has installed its handler (imports take seconds) would kill the rank and the job
# could not requeue; one that arrives while the interpreter shuts down would too. So on the host (and inside a
# pyxis container) the training starts with USR1 ignored, and this wrapper holds a USR1 it receives until the
# training has a handler for it (SigCgt in /proc), then delivers it once. TERM is passed on and waited for.
set -uo pipefail
trap '' USR1                  # ignored until the handler below is set (and inherited by the training)

train_cmd="${MEGAMEMO_TRAIN_CMD:-megamemo train}"
read -r -a cmd <<<"$train_cmd"
runtime="${MEGAMEMO_CONTAINER_RUNTIME:-apptainer}"
image="${MEGAMEMO_CONTAINER:-}"

ready() { [ -n "${MEGAMEMO_TASKS_READY:-}" ] && touch "$MEGAMEMO_TASKS_READY/${SLURM_PROCID:-0}" 2>/dev/null || true; }
# How the training ended, for the batch script's failure handling (launch/slurm/failure.sh): "CODE NODE TIME" in
# $MEGAMEMO_TASK_EXITS/<rank> (128 + N for signal N), written as soon as it ended: the first failure is the cause.
ended() {
  [ -n "${MEGAMEMO_TASK_EXITS:-}" ] || return 0
  echo "$1 ${SLURMD_NODENAME:-$(hostname)} $(date +%s.%N)" >"$MEGAMEMO_TASK_EXITS/${SLURM_PROCID:-0}" 2>/dev/null || true
}

# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME where unset: the interface of this node's route to MASTER_ADDR, printed
# to this rank's log (launch/slurm/node_env.sh); decided on the host, before any container starts.
# shellcheck source=node_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/node_env.sh"
megamemo_socket_ifnames

if [ -n "$image" ] && [ "$runtime" != pyxis ]; then
  # The container runtime (apptainer's starter, docker's CLI) catches and relays signals to the container itself.
  trap - USR1
  ready
  mounts="$MEGAMEMO_ROOT:$MEGAMEMO_ROOT,$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR${MEGAMEMO_CONTAINER_MOUNTS:+,$MEGAMEMO_CONTAINER_MOUNTS}"
  case "$runtime" in
    apptainer|singularity)
      gpu_flag=()
      [ "${MEGAMEMO_DEVICE:-}" = gpu ] && gpu_flag=(--nv)        # decided by train.sbatch (launch/device.sh)
      exec "$runtime" exec "${gpu_flag[@]}" --bind "$mounts" --pwd "$PWD" "$image" "${cmd[@]}" "$@"
      ;;
    docker|podman)
      opts=(--rm --init --network=host --ipc=host --user "$(id -u):$(id -g)" --workdir "$PWD")
      [ "${MEGAMEMO_DEVICE:-}" = gpu ] && opts+=(--gpus all)
      IFS=, read -r -a ms <<<"$mounts"
      for m in "${ms[@]}"; do opts+=(--volume "$m"); done
      # Pass the job's and the launcher's variables through by name (launch/forward.sh: NCCL_*, GLOO_*, ...).
      # shellcheck source=../forward.sh
      source "$(dirname "${BASH_SOURCE[0]}")/../forward.sh"
      for name in $(megamemo_forwarded_env 'SLURM_*'); do opts+=(--env "$name"); done
      exec "$runtime" run "${opts[@]}" "$image" "${cmd[@]}" "$@"
      ;;
    *)
      echo "task.sh: MEGAMEMO_CONTAINER_RUNTIME must be apptainer, singularity, pyxis, docker or podman (got $runtime)" >&2
      exit 2
      ;;
  esac
fi

# On the host, or already inside the pyxis container srun started.
"${cmd[@]}" "$@" &            # inherits the ignored USR1; megamemo's own handler replaces it
child=$!
pending_usr1=0
on_usr1() { pending_usr1=1; }
on_term() { kill -TERM "$child" 2>/dev/null || true; }
trap on_usr1 USR1
trap on_term TERM
ready

handles_usr1() {              # bit 9 (signal 10) of the caught-signals mask
  local mask
  mask="$(awk '/^SigCgt:/ {print $2}' "/proc/$child/status" 2>/dev/null)" || return 1
  [ -n "$mask" ] && (( (16#$mask >> 9) & 1 ))
}

while kill -0 "$child" 2>/dev/null; do
  if [ "$pending_usr1" = 1 ]; then
    if handles_usr1; then
      kill -USR1 "$child" 2>/dev/null || true
      pending_usr1=0
    else
      sleep 0.2
    fi
  else
    wait "$child"             # returns early when a trapped signal arrives
  fi
done
wait "$child"
rc=$?
ended "$rc"
exit "$rc"
