#!/usr/bin/env bash
# Installs NVRTC, the CUDA runtime headers and ptxas from NVIDIA's Python wheels into
# .tools/cuda (git-ignored), so CUDA kernels compile and assemble for sm_90 without a GPU or a
# CUDA toolkit. Prints the environment to use (eval "$(scripts/install-cuda-tools.sh)").
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/cuda
version=12.9.*
if [ ! -f "$dest/.installed" ]; then
  rm -rf "$dest"
  python3 -m pip install --quiet --no-deps --target "$dest" \
    "nvidia-cuda-nvrtc-cu12==$version" "nvidia-cuda-runtime-cu12==$version" "nvidia-cuda-nvcc-cu12==$version" >&2
  touch "$dest/.installed"
fi
root=$(cd "$dest/nvidia" && pwd)
nvrtc_lib=$(dirname "$(find "$root/cuda_nvrtc" -name 'libnvrtc.so*' | head -n1)")
ptxas=$(find "$root/cuda_nvcc" -name ptxas -type f | head -n1)
chmod +x "$ptxas"
echo "export MAXC_CUDA_INCLUDE=$root/cuda_runtime/include"
echo "export MAXC_NVRTC_LIB_DIR=$nvrtc_lib"
echo "export MAXC_PTXAS=$ptxas"
echo "export LD_LIBRARY_PATH=$nvrtc_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
