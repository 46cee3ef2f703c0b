#!/bin/bash
# One training task of launch/slurm/train.sbatch (srun starts one per GPU / per node): runs `megamemo train ARGS`
# on the host or in MEGAMEMO_CONTAINER. Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, which
# megamemo's rank discovery (megamemo/train/dist.py) maps itself; MASTER_ADDR/MASTER_PORT come from the batch
# script. The command is exec'd, so signals from Slurm (USR1, TERM) reach the training process directly.
set -euo pipefail

train_cmd="${MEGAMEMO_TRAIN_CMD:-megamemo train}"
read -r -a cmd <<<"$train_cmd"
runtime="${MEGAMEMO_CONTAINER_RUNTIME:-apptainer}"
image="${MEGAMEMO_CONTAINER:-}"

if [ -z "$image" ] || [ "$runtime" = pyxis ]; then
  exec "${cmd[@]}" "$@"        # on the host, or already inside the pyxis container srun started
fi

mounts="$MEGAMEMO_ROOT:$MEGAMEMO_ROOT,$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR${MEGAMEMO_CONTAINER_MOUNTS:+,$MEGAMEMO_CONTAINER_MOUNTS}"
case "$runtime" in
  apptainer|singularity)
    gpu_flag=()
    [ "${DS_ACCELERATOR:-}" = cpu ] || gpu_flag=(--nv)
    exec "$runtime" exec "${gpu_flag[@]}" --bind "$mounts" --pwd "$PWD" "$image" "${cmd[@]}" "$@"
    ;;
  docker|podman)
    opts=(--rm --init --network=host --ipc=host --user "$(id -u):$(id -g)" --workdir "$PWD")
    [ "${DS_ACCELERATOR:-}" = cpu ] || opts+=(--gpus all)
    IFS=, read -r -a ms <<<"$mounts"
    for m in "${ms[@]}"; do opts+=(--volume "$m"); done
    # Pass the job's and the launcher's variables through by name.
    for name in $(compgen -e); do
      case "$name" in
        SLURM_*|MASTER_*|MEGAMEMO_*|NCCL_*|TORCH_*|OMP_NUM_THREADS|DS_ACCELERATOR|CUDA_VISIBLE_DEVICES|PYTHONUNBUFFERED)
          opts+=(--env "$name") ;;
      esac
    done
    exec "$runtime" run "${opts[@]}" "$image" "${cmd[@]}" "$@"
    ;;
  *)
    echo "task.sh: MEGAMEMO_CONTAINER_RUNTIME must be apptainer, singularity, pyxis, docker or podman (got $runtime)" >&2
    exit 2
    ;;
esac
