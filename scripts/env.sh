# Sourced by the project's scripts: the environment every megamemo process runs with.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="${MEGAMEMO_VENV:-$here/.venv}/bin:$PATH"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$here/.cache/torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export PYTHONUNBUFFERED=1
