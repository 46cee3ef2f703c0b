# Sourced by megamemo's launchers (launch/slurm/train.sbatch, launch/local.sh) and scripts/env.sh: the device
# decision, made from what this machine has, written into the environment every training process inherits.
#
#   megamemo_gpu_count            NVIDIA GPUs that `nvidia-smi -L` lists here (0 without nvidia-smi)
#   megamemo_select_device WANT   WANT = auto | gpu | cpu (cuda means gpu). auto: gpu when megamemo_gpu_count > 0.
#       Exports MEGAMEMO_DEVICE=gpu|cpu and DS_ACCELERATOR=cuda|cpu to match, replacing what was inherited (a
#       login node's DS_ACCELERATOR=cpu from scripts/env.sh included), and MEGAMEMO_GPUS=<count>. For gpu also,
#       unless already set: CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core's TP layers overlap their all-reduce
#       with the weight-gradient GEMM by kernel order on one hardware queue) and TORCH_NCCL_ASYNC_ERROR_HANDLING=3
#       (torch's default: a failed or timed-out collective ends the process; NCCL_ASYNC_ERROR_HANDLING is the old
#       name). `megamemo train` reads MEGAMEMO_DEVICE: gpu without a usable CUDA device is an error, not a CPU run.
#       Returns 2 (and says why) on an unknown WANT.

megamemo_gpu_count() {
  local n
  n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" || true
  echo "${n:-0}"
}

megamemo_select_device() {
  local want="${1:-auto}"
  MEGAMEMO_GPUS="$(megamemo_gpu_count)"
  export MEGAMEMO_GPUS
  case "$want" in
    auto) if [ "$MEGAMEMO_GPUS" -gt 0 ]; then want=gpu; else want=cpu; fi ;;
    gpu|cuda) want=gpu ;;
    cpu) ;;
    *) echo "MEGAMEMO_DEVICE must be auto, gpu or cpu (got '$want')" >&2; return 2 ;;
  esac
  if [ "$want" = gpu ]; then
    export MEGAMEMO_DEVICE=gpu DS_ACCELERATOR=cuda
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
  else
    export MEGAMEMO_DEVICE=cpu DS_ACCELERATOR=cpu
  fi
}
