# Sourced by the project's scripts: the environment every megamemo process runs with.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="${MEGAMEMO_VENV:-$here/.venv}/bin:$PATH"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$here/.cache/torch_extensions}"
# DeepSpeed's CPU accelerator only where this machine has no NVIDIA GPU (DeepSpeed finds CUDA by itself): neither
# nvidia-smi nor the GPU device files nor Slurm say there is one (launch/device.sh megamemo_node_gpu_evidence). A
# Slurm job decides again on its own node (launch/slurm/train.sbatch), whatever this exported on a login node.
# shellcheck source=../launch/device.sh
source "$here/launch/device.sh"
if [ -z "${DS_ACCELERATOR:-}" ] && [ -z "$(megamemo_node_gpu_evidence)" ]; then
  export DS_ACCELERATOR=cpu
fi
export PYTHONUNBUFFERED=1
