#!/usr/bin/env bash
# llama.cpp's tools (llama-bench, llama-quantize, llama-server), the peer maxc is measured and
# checked against, built from the llama.cpp that PyPI's llama-cpp-python sdist vendors (sha256
# checked) with CMake (from PyPI where the machine has none), once, into .tools/peers
# (git-ignored, cached). Prints the folder holding the binaries.
#
#   bash scripts/llama-cpp.sh [GGUF]   (GGUF: a file to try the native build on; see below)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
peers=.tools/peers
version=0.3.36
threads=${THREADS:-$(nproc)}
gguf=${1:-}
mkdir -p "$peers"

# CMake from PyPI where the machine has none.
if ! command -v cmake >/dev/null; then
  if [ ! -x "$peers/cmake/bin/cmake" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$peers/cmake-py" cmake==4.4.5 >&2
    mkdir -p "$peers/cmake/bin"
    printf '#!/usr/bin/env bash\nPYTHONPATH=%s exec python3 -m cmake "$@"\n' "$root/$peers/cmake-py" > "$peers/cmake/bin/cmake"
    chmod +x "$peers/cmake/bin/cmake"
  fi
  export PATH="$root/$peers/cmake/bin:$PATH"
fi

# llama.cpp's sources from the llama-cpp-python sdist.
src="$peers/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
  # The sdist file itself, from PyPI's simple index (JSON), its sha256 checked. (`pip download
  # --no-binary :all:` would build the sdist's build tools, CMake included, from source first.)
  sdist="$peers/sdist/llama_cpp_python-$version.tar.gz"
  mkdir -p "$peers/sdist"
  read -r url sha < <(curl -sfL -H "Accept: application/vnd.pypi.simple.v1+json" \
    https://pypi.org/simple/llama-cpp-python/ | python3 -c "
import json, sys
f = [f for f in json.load(sys.stdin)['files'] if f['filename'] == 'llama_cpp_python-$version.tar.gz'][0]
print(f['url'], f['hashes']['sha256'])")
  curl -sfL -o "$sdist" "$url"
  echo "$sha  $sdist" | sha256sum -c --quiet >&2
  tar -xzf "$sdist" -C "$peers"
fi
# build_llama DIR [CMAKE FLAGS...]: llama-bench, llama-quantize and llama-server (for
# `scripts/load-test.sh --llama-server`) into DIR/bin, once.
build_llama() {
  local dir=$1
  shift
  if [ ! -x "$dir/bin/llama-bench" ] || [ ! -x "$dir/bin/llama-quantize" ] || [ ! -x "$dir/bin/llama-server" ]; then
    cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "$@" >&2
    cmake --build "$dir" --target llama-bench llama-quantize llama-server -j "$threads" >&2
  fi
}
# LLAMA_ISA=avx2: a build for AVX2 + FMA + F16C CPUs (no AVX-512), to compare maxc's AVX2
# kernels (MAXC_CPU_ISA=avx2) with llama.cpp's on a machine that has AVX-512 too.
if [ "${LLAMA_ISA:-native}" = avx2 ]; then
  build_llama "$src/build-avx2" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF
  echo "$root/$src/build-avx2/bin"
  exit 0
fi
build_llama "$src/build"
bin="$src/build/bin"
# Some virtual machines advertise AMX in CPUID but trap its instructions (llama.cpp's native build
# then dies of SIGILL in its AMX matmul); there llama.cpp is built a second time without AMX, its
# best on such a machine (maxc does not use AMX either).
if [ -n "$gguf" ] && ! "$bin/llama-bench" -m "$gguf" -t "$threads" -p 32 -n 0 -r 1 >/dev/null 2>&1; then
  echo "llama.cpp's native build fails here (AMX advertised but trapped?): using a build without AMX" >&2
  # (GCC keeps explicit -mno-* flags over -march=native's, which GGML_NATIVE adds.)
  build_llama "$src/build-noamx" "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  bin="$src/build-noamx/bin"
fi

echo "$root/$bin"
