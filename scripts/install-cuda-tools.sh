#!/usr/bin/env bash
# Installs NVRTC, the CUDA runtime headers, ptxas and NVTX from NVIDIA's Python wheels into
# .tools/cuda (git-ignored), so CUDA kernels compile and assemble for sm_90 without a GPU or a
# CUDA toolkit. Prints the environment to use (eval "$(scripts/install-cuda-tools.sh)").
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/cuda
# Exact versions: PTX bytes depend on the NVRTC build.
nvrtc=12.9.86 runtime=12.9.79 nvcc=12.9.86 nvtx=12.9.79
marker="$dest/.installed-$nvrtc-$runtime-$nvcc-$nvtx"
if [ ! -f "$marker" ]; then
  rm -rf "$dest"
  python3 -m pip install --quiet --no-deps --target "$dest" \
    "nvidia-cuda-nvrtc-cu12==$nvrtc" "nvidia-cuda-runtime-cu12==$runtime" "nvidia-cuda-nvcc-cu12==$nvcc" \
    "nvidia-nvtx-cu12==$nvtx" >&2
  touch "$marker"
fi
root=$(cd "$dest/nvidia" && pwd)
nvrtc_lib=$(dirname "$(find "$root/cuda_nvrtc" -name 'libnvrtc.so*' | head -n1)")
ptxas=$(find "$root/cuda_nvcc" -name ptxas -type f | head -n1)
# NVTX's C API (nvtxRangePushA, nvtxRangePop) in the wheel's interop library.
nvtx_lib=$(find "$root/nvtx" -name 'libnvtx3interop.so*' | head -n1)
chmod +x "$ptxas"
echo "export MAXC_CUDA_INCLUDE=$root/cuda_runtime/include"
echo "export MAXC_NVRTC_LIB_DIR=$nvrtc_lib"
echo "export MAXC_PTXAS=$ptxas"
echo "export MAXC_NVTX_LIBRARY=$nvtx_lib"
echo "export LD_LIBRARY_PATH=$nvrtc_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
