#!/usr/bin/env bash
# maxc against llama.cpp on the same GGUF files, same threads, same prompt length, in one run:
# prefill of 128 tokens and batch-1 decode, tokens/s, with maxc/llama.cpp ratios.
#
#   bash scripts/bench-peers.sh [GGUF]      (default: the SmolLM2 Q4_1 file of scripts/fetch-smollm2.sh)
#
# llama.cpp comes from PyPI's llama-cpp-python source distribution (its vendored llama.cpp),
# built once with CMake (from PyPI too) into .tools/peers by scripts/llama-cpp.sh. The variants
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
threads=${THREADS:-$(nproc)}
mkdir -p "$peers"

gguf=${1:-}
if [ -z "$gguf" ]; then
  gguf=$(bash scripts/fetch-smollm2.sh)
fi

# llama.cpp's tools, built once (scripts/llama-cpp.sh); the first argument is a file to try them on.
bin=$(THREADS=$threads bash scripts/llama-cpp.sh "$gguf")

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
