#!/usr/bin/env bash
# maxc against llama.cpp on the same GGUF files, same threads, same prompt length, in one run:
# prefill of 128 tokens and batch-1 decode, tokens/s, with maxc/llama.cpp ratios.
#
#   bash scripts/bench-peers.sh [GGUF]      (default: the SmolLM2 Q4_1 file of scripts/fetch-smollm2.sh)
#
# llama.cpp comes from PyPI's llama-cpp-python source distribution (its vendored llama.cpp),
# built once with CMake (from PyPI too) into .tools/peers (git-ignored, cached). The variants
# (Q8_0, BF16, F32, and Q4_K_M: the mix most downloads are) are made from GGUF with llama.cpp's
# own llama-quantize, so both engines read the very same files. llama-bench reports prefill
# (pp128) and decode (tg64) means over 3 repetitions; maxc bench the median of its prefill_128
# and decode_b1 steps (decode after a 16-token prompt), and decode again with `--activations q8`
# (8-bit activations, as llama.cpp computes). Not part of CI: it builds llama.cpp
# (minutes) and needs quiet cores.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
peers=.tools/peers
version=0.3.36
threads=${THREADS:-$(nproc)}
mkdir -p "$peers"

gguf=${1:-}
if [ -z "$gguf" ]; then
  gguf=$(bash scripts/fetch-smollm2.sh)
fi

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
build_llama "$src/build"
bin="$src/build/bin"
# Some virtual machines advertise AMX in CPUID but trap its instructions (llama.cpp's native build
# then dies of SIGILL in its AMX matmul); there llama.cpp is built a second time without AMX, its
# best on such a machine (maxc does not use AMX either).
if ! "$bin/llama-bench" -m "$gguf" -t "$threads" -p 32 -n 0 -r 1 >/dev/null 2>&1; then
  echo "llama.cpp's native build fails here (AMX advertised but trapped?): using a build without AMX" >&2
  # (GCC keeps explicit -mno-* flags over -march=native's, which GGML_NATIVE adds.)
  build_llama "$src/build-noamx" "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  bin="$src/build-noamx/bin"
fi

# The variants, made by llama-quantize from the given file.
base=$(basename "$gguf" .gguf)
files=("$gguf")
for t in Q8_0 BF16 F32 Q4_K_M; do
  out="$peers/$base.$t.gguf"
  if [ ! -f "$out" ]; then
    "$bin/llama-quantize" --allow-requantize "$gguf" "$out" "$t" >/dev/null 2>&1
  fi
  files+=("$out")
done

cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc

# ROUNDS (default 3) interleaved rounds over the files; each figure is the median of its rounds,
# and each ratio the median of the rounds' ratios (this machine's neighbours make single runs
# noisy).
rounds=${ROUNDS:-3}
results=$(mktemp)
for f in "${files[@]}"; do
  art="$peers/$(basename "$f" .gguf).maxc"
  "$maxc" compile "$f" --out "$art" --weights keep --max-batch-size 1 --max-seq-len 512 \
    --max-batch-input-tokens 512 --force --quiet
done
for round in $(seq "$rounds"); do
  for f in "${files[@]}"; do
    art="$peers/$(basename "$f" .gguf).maxc"
    llama=$("$bin/llama-bench" -m "$f" -t "$threads" -p 128 -n 64 -r 3 -o json 2>/dev/null)
    ours=$("$maxc" bench "$art" --json --steps 64 --rounds 1)
    # 8-bit activations, as llama.cpp's (decode of block formats; the same kernels otherwise).
    ours8=$("$maxc" bench "$art" --json --steps 64 --rounds 1 --activations q8)
    python3 - "$f" "$llama" "$ours" "$ours8" >> "$results" <<'EOF2'
import json, os, sys
name, llama, ours, ours8 = os.path.basename(sys.argv[1]), *map(json.loads, sys.argv[2:5])
pp = next(r["avg_ts"] for r in llama if r["n_prompt"] == 128 and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in llama if r["n_gen"] == 64 and r["n_prompt"] == 0)
m = {r["name"]: r for r in ours["measurements"]}
m8 = {r["name"]: r for r in ours8["measurements"]}
print(json.dumps([name, pp, m["prefill_128"]["tokens_per_s"], tg, m["decode_b1"]["tokens_per_s"],
                  m8["decode_b1"]["tokens_per_s"]]))
EOF2
  done
done
python3 - "$results" "$rounds" <<'EOF2'
import json, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    name, *v = json.loads(line)
    rows.setdefault(name, []).append(v)
print(f"medians of {sys.argv[2]} interleaved rounds (tokens/s)")
print(f"{'file':<34} {'llama pp128':>12} {'maxc pp128':>12} {'ratio':>7} {'llama tg':>12} {'maxc tg':>12} {'ratio':>7} {'maxc tg q8':>12} {'ratio':>7}")
for name, rs in rows.items():
    med = lambda i: st.median(r[i] for r in rs)
    pr = st.median(r[1] / r[0] for r in rs)
    tr = st.median(r[3] / r[2] for r in rs)
    tr8 = st.median(r[4] / r[2] for r in rs)
    print(f"{name:<34} {med(0):12.1f} {med(1):12.1f} {pr:6.2f}x {med(2):12.1f} {med(3):12.1f} {tr:6.2f}x {med(4):12.1f} {tr8:6.2f}x")
EOF2
rm -f "$results"
