# Sourced by megamemo's launchers (launch/slurm/train.sbatch, launch/local.sh, launch/mpi/train.sh) and
# scripts/env.sh: the device decision, made from what this machine has, written into the environment every training
# process inherits.
#
#   megamemo_gpu_count            NVIDIA GPUs that `nvidia-smi -L` lists here (0 without nvidia-smi); cheap, for
#                                 scripts/env.sh on every shell
#   megamemo_torch_gpu_count      CUDA devices torch sees here (`python -c ...torch.cuda.device_count()` with the
#                                 python on PATH), falling back to megamemo_gpu_count where that python has no
#                                 torch (e.g. a container job's bare host). MEGAMEMO_GPU_PROBE, if set, is the
#                                 command run instead of that python one-liner (it prints the count): tests fake
#                                 torch's view with it; a site may point it at its container's python.
#   megamemo_node_gpu_evidence    why this node has NVIDIA GPUs whatever torch sees, or nothing: Slurm gave the job
#                                 GPUs here (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS), `nvidia-smi -L` lists some, or a
#                                 GPU device file exists (MEGAMEMO_NVIDIA_DEVICES: space-separated globs, default
#                                 /dev/nvidia[0-9]*; tests point it elsewhere)
#   megamemo_select_device WANT   WANT = auto | gpu | cpu (cuda means gpu). auto: gpu when torch sees a GPU, cpu
#       when it sees none and the node has no NVIDIA GPU (megamemo_node_gpu_evidence); a node with GPUs that torch
#       cannot use is an error (returns 3, one line naming the evidence): a GPU job never trains on the CPU quietly.
#       Where the python on PATH has no torch to ask, nvidia-smi's count stands for torch's view.
#       Exports MEGAMEMO_DEVICE=gpu|cpu and DS_ACCELERATOR=cuda|cpu to match, replacing what was inherited (a
#       login node's DS_ACCELERATOR=cpu from scripts/env.sh included: only MEGAMEMO_DEVICE chooses, and an
#       inherited DS_ACCELERATOR=cpu where GPUs are seen is reported and ignored), and MEGAMEMO_GPUS=<count>.
#       For gpu also, unless already set: CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core's TP layers overlap their
#       all-reduce with the weight-gradient GEMM by kernel order on one hardware queue) and
#       TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default: a failed or timed-out collective ends the process;
#       NCCL_ASYNC_ERROR_HANDLING is the old name). gpu where torch sees none is an error (returns 3, one line
#       saying so): a GPU job never trains on the CPU. `megamemo train` reads MEGAMEMO_DEVICE too. Returns 2
#       (and says why) on an unknown WANT.

megamemo_gpu_count() {
  local n
  n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" || true
  echo "${n:-0}"
}

megamemo_torch_probe() {         # the count torch sees, or nothing where the probe cannot tell
  local n probe="${MEGAMEMO_GPU_PROBE:-python -c 'import torch; print(torch.cuda.device_count())'}"
  n="$(bash -c "$probe" 2>/dev/null | tail -n 1)" || true
  if [[ "$n" =~ ^[0-9]+$ ]]; then echo "$n"; fi
}

megamemo_torch_gpu_count() {
  local n
  n="$(megamemo_torch_probe)"
  if [ -n "$n" ]; then echo "$n"; else megamemo_gpu_count; fi
}

megamemo_node_gpu_evidence() {
  local n f
  if [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[1-9][0-9]*$ ]]; then echo "SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE"; return; fi
  if [ -n "${SLURM_JOB_GPUS:-}" ]; then echo "SLURM_JOB_GPUS=$SLURM_JOB_GPUS"; return; fi
  n="$(megamemo_gpu_count)"
  if [ "$n" -gt 0 ]; then echo "nvidia-smi lists $n GPU(s)"; return; fi
  # shellcheck disable=SC2086  # the globs are meant to expand
  for f in ${MEGAMEMO_NVIDIA_DEVICES:-/dev/nvidia[0-9]*}; do
    if [ -e "$f" ]; then echo "$f exists"; return; fi
  done
}

megamemo_select_device() {
  local want="${1:-auto}" seen evidence
  seen="$(megamemo_torch_probe)"
  MEGAMEMO_GPUS="${seen:-$(megamemo_gpu_count)}"
  export MEGAMEMO_GPUS
  case "$want" in
    auto)
      if [ "$MEGAMEMO_GPUS" -gt 0 ]; then
        want=gpu
      else
        evidence="$(megamemo_node_gpu_evidence)"
        if [ -n "$evidence" ] && [ -n "$seen" ]; then
          echo "MEGAMEMO_DEVICE=auto on a node with NVIDIA GPUs ($evidence) but torch sees no CUDA device on" \
               "$(hostname) (torch without CUDA, a driver too old for it, or a container without GPUs): not" \
               "training on the CPU; MEGAMEMO_DEVICE=cpu trains on the CPU" >&2
          return 3
        elif [ -n "$evidence" ]; then
          echo "MEGAMEMO_DEVICE=auto on a node with NVIDIA GPUs ($evidence) but the python on PATH has no torch to" \
               "ask how many it can use: not training on the CPU; set MEGAMEMO_GPU_PROBE (a command printing" \
               "torch's GPU count, e.g. in the job's container) or MEGAMEMO_DEVICE=cpu" >&2
          return 3
        fi
        want=cpu
      fi ;;
    gpu|cuda) want=gpu ;;
    cpu) ;;
    *) echo "MEGAMEMO_DEVICE must be auto, gpu or cpu (got '$want')" >&2; return 2 ;;
  esac
  if [ "$want" = gpu ] && [ "$MEGAMEMO_GPUS" -eq 0 ]; then
    echo "MEGAMEMO_DEVICE=gpu but torch sees no CUDA device on $(hostname) (torch without CUDA, no driver, or a" \
         "job without GPUs): not starting; MEGAMEMO_DEVICE=cpu trains on the CPU" >&2
    return 3
  fi
  if [ "$want" = gpu ] && [ "${DS_ACCELERATOR:-}" = cpu ]; then
    echo "note: ignoring the inherited DS_ACCELERATOR=cpu: $MEGAMEMO_GPUS GPU(s) here (MEGAMEMO_DEVICE=cpu forces" \
         "the CPU)" >&2
  fi
  if [ "$want" = gpu ]; then
    export MEGAMEMO_DEVICE=gpu DS_ACCELERATOR=cuda
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
  else
    export MEGAMEMO_DEVICE=cpu DS_ACCELERATOR=cpu
  fi
}
