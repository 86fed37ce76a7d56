#!/usr/bin/env bash
# Time to the first token from a cold process, maxc against llama.cpp on the same GGUF files:
# the wall time of `maxc generate ARTIFACT --prompt P --max-new-tokens 1` (the artifact compiled
# beforehand, as maxc is meant to run) against llama.cpp's `llama-completion -m FILE -p P -n 1`,
# both processes started afresh, files in the page cache (each is read once before timing), same
# threads. Rounds interleave the two engines and the files; each figure is the median, each
# ratio the median of the rounds' ratios.
#
#   bash scripts/bench-load.sh [GGUF]   (default: the SmolLM2 Q4_1 file of scripts/fetch-smollm2.sh)
#
# The F32, BF16 and Q4_K_M variants are made by llama.cpp's llama-quantize (as bench-peers.sh
# makes them). ROUNDS (default 5). Not part of CI: it builds llama.cpp (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
peers=.tools/peers
threads=${THREADS:-$(nproc)}
rounds=${ROUNDS:-5}
gguf=${1:-}
if [ -z "$gguf" ]; then
  gguf=$(bash scripts/fetch-smollm2.sh)
fi
bin=$(THREADS=$threads bash scripts/llama-cpp.sh "$gguf")
# llama-completion (the non-interactive llama-cli) from the same build, once.
if [ ! -x "$bin/llama-completion" ]; then
  # (scripts/llama-cpp.sh put CMake from PyPI there where the machine has none.)
  command -v cmake >/dev/null || export PATH="$(pwd)/$peers/cmake/bin:$PATH"
  build=$(dirname "$bin")
  cmake --build "$build" --target llama-completion -j "$threads" >&2
fi
base=$(basename "$gguf" .gguf)
files=()
for t in ${VARIANTS-F32 BF16 Q4_K_M}; do
  out="$peers/$base.$t.gguf"
  if [ ! -f "$out" ]; then
    "$bin/llama-quantize" --allow-requantize "$gguf" "$out" "$t" >/dev/null 2>&1
  fi
  files+=("$out")
done
cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc
for f in "${files[@]}"; do
  "$maxc" compile "$f" --out "$peers/$(basename "$f" .gguf).load.maxc" --weights keep \
    --max-batch-size 1 --max-seq-len 512 --max-batch-input-tokens 512 --force --quiet
done
python3 - "$maxc" "$bin/llama-completion" "$threads" "$rounds" "$peers" "${files[@]}" <<'EOF'
import os, statistics as st, subprocess, sys, time
maxc, llama, threads, rounds, peers, *files = sys.argv[1:]
prompt = "The capital of France is"
def art(f):
    return os.path.join(peers, os.path.basename(f)[:-5] + ".load.maxc")
def timed(cmd):
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    s = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} failed: {r.stderr.decode()[-2000:]}")
    return s
def ours(f):
    return [maxc, "generate", art(f), "--prompt", prompt, "--max-new-tokens", "1", "--threads", threads]
def theirs(f):
    return [llama, "-m", f, "-p", prompt, "-n", "1", "-t", threads, "--no-warmup", "-no-cnv",
            "--temp", "0", "--simple-io"]
# Into the page cache, and a first run of each that is not timed.
for f in files:
    for p in [f] + [os.path.join(d, n) for d, _, ns in os.walk(art(f)) for n in ns]:
        with open(p, "rb") as fh:
            while fh.read(1 << 24):
                pass
    timed(ours(f)); timed(theirs(f))
res = {f: [] for f in files}
for _ in range(int(rounds)):
    for f in files:
        a, b = timed(ours(f)), timed(theirs(f))
        res[f].append((a, b))
print(f"start to first token (s), medians of {rounds} interleaved rounds, {threads} threads, files cached")
print(f"{'file':<40} {'llama.cpp':>10} {'maxc':>8} {'maxc / llama.cpp':>17}")
for f, rs in res.items():
    print(f"{os.path.basename(f):<40} {st.median(b for _, b in rs):10.3f} "
          f"{st.median(a for a, _ in rs):8.3f} {st.median(a / b for a, b in rs):16.2f}x")
EOF
