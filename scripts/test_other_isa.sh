#!/usr/bin/env bash
# The numerical tests (`-m numerics`: tolerances that depend on floating-point rounding) again, with torch's CPU
# kernels on another instruction set, as another CPU model would round them: a tolerance fit to one CPU fails here
# instead of on the next machine CI is given. Run by .ci/run after the suite; extra arguments go to pytest.
#
# Which set: on an AVX-512 machine, AVX2 for ATen's kernels and MKL's AVX2 code path (what an AMD EPYC runs:
# ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2; MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA changed no bits here). On
# an AVX2 machine, ATen's scalar kernels and MKL's compatible path (ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE).
# ATEN_CPU_CAPABILITY=default on an AVX-512 machine is not a CPU that exists: torch's bf16 matmul then stops
# ("pack_vnni2 is only supported when avx512 is supported"). Each setting changes the bits of a 257x513 @ 513x129
# fp32 matmul on the machine it is meant for (docs/contributing.md).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/env.sh"
cd "$here"
native="$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
case "$native" in
  AVX512*) isa=(ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2) ;;
  *) isa=(ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE) ;;
esac
echo "[other-isa] native $native; the numerical tests again with ${isa[*]}"
exec env "${isa[@]}" python -m pytest -q -n "${MEGAMEMO_TEST_WORKERS:-2}" --dist worksteal -m numerics "$@"
