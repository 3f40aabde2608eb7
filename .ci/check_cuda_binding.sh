#!/usr/bin/env bash
# Compiles (without linking) the CUDA registration layer of the extension
# against torch's headers and the CUDA toolkit. On a machine whose torch has
# no CUDA this is the only check that csrc/torch/*_cuda.cpp still builds; the
# torch-free kernels themselves are built and linked by CMake.
set -euo pipefail
PY=${PY:-.venv/bin/python}
CUDA_INC=${CUDA_HOME:-/usr/local/cuda}/include
read -r -a TORCH_INC < <("$PY" -c "
from torch.utils.cpp_extension import include_paths
import sysconfig
print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
# A CPU build of torch ships the c10/cuda headers but not the one its CUDA
# build generates at configure time; stand in for it when it is missing.
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$SHIM/c10/cuda/impl/cuda_cmake_macros.h"
CXX_STD=$("$PY" -c "import json; print(json.load(open('csrc/build.json'))['cxx_standard'])")
for src in csrc/torch/*_cuda.cpp; do
  echo "compile check: $src"
  g++ -std=c++"$CXX_STD" -fsyntax-only -DFLASHSPARK_WITH_CUDA=1 -Icsrc/include "${TORCH_INC[@]}" -I"$CUDA_INC" \
    -idirafter "$SHIM" "$src"
done
