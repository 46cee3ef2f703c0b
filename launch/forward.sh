# Sourced by launch/mpi/train.sh and launch/slurm/task.sh: which environment variables a training process needs
# when what starts it does not pass the whole environment on - Open MPI's mpirun (`-x NAME`, for ranks on other
# machines) and docker/podman (`--env NAME`). srun (--export=ALL), apptainer, pyxis, MPICH's and Intel MPI's Hydra
# pass everything.
#
#   megamemo_forwarded_env [PATTERN...]   prints, one a line, the names of the exported variables that match
#       MEGAMEMO_*, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS, DS_ACCELERATOR, PYTHONUNBUFFERED,
#       NCCL_*    (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, NCCL_ALGO, ...: which network NCCL uses),
#       GLOO_*    (GLOO_SOCKET_IFNAME: the interface of the gloo group the checkpoint commit uses; without it gloo
#                  takes the address the hostname resolves to, which may be a loopback or management one),
#       TORCH_*   (TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCH_EXTENSIONS_DIR, TORCH_DISTRIBUTED_DEBUG, ...),
#       PYTORCH_* (PYTORCH_CUDA_ALLOC_CONF), CUDA_* (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_MAX_CONNECTIONS), CUBLAS_*,
#       or one of the caller's PATTERNs (shell globs, quoted).

megamemo_forwarded_env() {
  local name pat
  for name in $(compgen -e); do
    for pat in 'MEGAMEMO_*' MASTER_ADDR MASTER_PORT OMP_NUM_THREADS DS_ACCELERATOR PYTHONUNBUFFERED 'NCCL_*' 'GLOO_*' \
               'TORCH_*' 'PYTORCH_*' 'CUDA_*' 'CUBLAS_*' "$@"; do
      # shellcheck disable=SC2053  # the pattern is a glob on purpose
      if [[ "$name" == $pat ]]; then echo "$name"; break; fi
    done
  done
}
