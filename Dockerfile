# megamemo training image: CUDA, PyTorch, DeepSpeed, megatron-core, MPI (Open MPI + mpi4py), the megamemo package.
#   docker build -t megamemo:latest .
#   docker build --build-arg DS_BUILD_OPS=1 --build-arg TORCH_CUDA_ARCH_LIST="7.0;8.0" -t megamemo:ops .
#     (DS_ACCELERATOR=cuda during the op build: a build host has no GPU, and DeepSpeed would pick its CPU ops)
#   apptainer build megamemo.sif docker-daemon://megamemo:latest
# Slurm: MEGAMEMO_CONTAINER=megamemo.sif (apptainer), or an enroot image with MEGAMEMO_CONTAINER_RUNTIME=pyxis,
# in the environment of `sbatch launch/slurm/train.sbatch ...` (see the settings at the top of that script).
#
# One CUDA everywhere: torch 2.13.0+cu126 from PyTorch's cu126 index (kernels for sm_50-sm_90: V100, A100, H100;
# a driver that runs CUDA 12) on a CUDA 12.6 base image, whose nvcc is the CUDA torch was built with, as DeepSpeed's
# op build requires (op_builder/builder.py, assert_no_cuda_mismatch). PyPI's torch 2.13.0 is a CUDA 13.0 build:
# no sm_70 kernels, a driver >= 580. For A100/H100 nodes with such a driver:
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 --build-arg TORCH_CUDA_ARCH_LIST="8.0;9.0" .
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# Pinned versions (the CPU development environment uses the same ones; torch's Linux wheel brings its CUDA
# libraries, the base image brings nvcc for DeepSpeed's op build). Besides the package's dependencies the image holds
# its extras s3 and gcs (shard directories on s3:// and gs://: fsspec, s3fs, gcsfs, aiohttp for https://), eval
# (transformers, lm-eval, accelerate: `megamemo export hf`, `megamemo harness`) and parquet (pyarrow).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG DEEPSPEED_VERSION=0.19.8
ARG MEGATRON_CORE_VERSION=0.16.1
ARG MPI4PY_VERSION=4.1.2
ARG WEBDATASET_VERSION=1.0.2
ARG ZSTANDARD_VERSION=0.25.0
ARG NUMPY_VERSION=2.4.6
# 1: compile DeepSpeed's CUDA/C++ ops into the image (slow build, no JIT at job start); 0: JIT on first use.
ARG DS_BUILD_OPS=0
# GPU architectures for the op build: V100 7.0, A100 8.0, H100 9.0.
ARG TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0"
ARG USER_UID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Distribution packages follow the base image's release; their versions are not pinned on purpose.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev build-essential ninja-build git ca-certificates \
       openmpi-bin libopenmpi-dev libpmix2 openssh-client procps tini \
    && rm -rf /var/lib/apt/lists/*

# torch first, from its CUDA index; everything after it is installed with torch held at that build (constraints),
# and the build's CUDA must be the base image's nvcc.
RUN python3 -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
    && python -c "import torch; print('torch==' + torch.__version__)" > /opt/venv/torch-constraint.txt \
    && torch_cuda="$(python -c 'import torch; print(torch.version.cuda)')" \
    && nvcc_cuda="$(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')" \
    && if [ "${torch_cuda}" != "${nvcc_cuda}" ]; then \
         echo "torch is built for CUDA ${torch_cuda}, the base image has nvcc ${nvcc_cuda}" >&2; exit 1; \
       fi \
    && pip install -c /opt/venv/torch-constraint.txt \
       "mpi4py==${MPI4PY_VERSION}" "webdataset==${WEBDATASET_VERSION}" \
       "zstandard==${ZSTANDARD_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}" \
       "numpy==${NUMPY_VERSION}" "pyyaml==6.0.3" "pydantic==2.14.4" "safetensors==0.8.0" "tensorboard==2.21.0" \
       "matplotlib==3.11.2" "ninja==1.13.2" "tokenizers==0.23.3" "sentencepiece==0.2.3" "pyarrow==26.0.1" \
       "fsspec==2026.9.0" "aiohttp==3.14.5" "s3fs==2026.9.0" "gcsfs==2026.10.1" \
       "transformers==5.24.0" "lm-eval==0.4.13" "accelerate==1.15.0" \
    && if [ "${DS_BUILD_OPS}" = "1" ]; then \
         DS_ACCELERATOR=cuda DS_BUILD_OPS=1 DS_BUILD_SPARSE_ATTN=0 DS_BUILD_EVOFORMER_ATTN=0 DS_BUILD_GDS=0 \
           pip install -c /opt/venv/torch-constraint.txt --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"; \
       else \
         pip install -c /opt/venv/torch-constraint.txt "deepspeed==${DEEPSPEED_VERSION}"; \
       fi \
    && pip check \
    && python -c "import torch, deepspeed, megatron.core, mpi4py, webdataset, zstandard, tokenizers, pyarrow" \
    && python -c "import triton; print('triton', triton.__version__, '(the CUDA build of torch pins its own)')" \
    && python -c "import s3fs, gcsfs, transformers, lm_eval, accelerate" \
    && python -c "import torch, sys; held = open('/opt/venv/torch-constraint.txt').read().split('==')[1].strip(); \
sys.exit(0 if torch.__version__ == held else f'torch changed from {held} to {torch.__version__}')"

COPY pyproject.toml /opt/megamemo/
COPY megamemo /opt/megamemo/megamemo
COPY configs /opt/megamemo/configs
COPY launch /opt/megamemo/launch
COPY scripts /opt/megamemo/scripts
# Dependencies are already in place with the pinned versions: install only the package itself.
RUN pip install --no-deps /opt/megamemo && megamemo --help

RUN useradd --create-home --uid "${USER_UID}" --shell /bin/bash megamemo
USER ${USER_UID}
WORKDIR /home/megamemo
# TORCH_EXTENSIONS_DIR (DeepSpeed's JIT op builds, DS_BUILD_OPS=0) is not baked in: a path of this user's home is not
# writable for `docker run --user UID` (launch/slurm/task.sh) nor in apptainer's read-only image. torch's default is
# the running user's ~/.cache/torch_extensions, and `megamemo` moves it to /tmp/torch_extensions-<uid> at start
# where that is not writable either (megamemo/runtime/extensions.py).
# PID 1 is tini: it reaps every orphan that ends (a worker killed with -9 would otherwise stay a zombie, and a
# zombie still in /proc looked like a live holder of the run directory's lock) and passes signals on to the command.
# -s: the same as a subreaper where something else is PID 1 (`docker run --init`, as launch/slurm/task.sh runs it).
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["megamemo", "--help"]
