#!/usr/bin/env bash
# Decode at long contexts, maxc against llama.cpp on the same GGUF file with the same KV cache
# type, in one run: batch-1 decode tokens/s after CTX tokens of context (default 2048 and
# 8192), with maxc/llama.cpp ratios, and the fidelity of each of maxc's KV cache types.
#
#   bash scripts/bench-context.sh [GGUF]   (default: SmolLM2 Q4_K_M, made by llama-quantize
#                                           from the Q4_1 file of scripts/fetch-smollm2.sh)
#
# Pairs: maxc f32, f16 and bf16 caches against llama.cpp's f16 (its default), maxc q8_0 against
# llama.cpp's q8_0 keys and values. llama-bench's `-d` is the context (`tg` after it); its f16
# figure is the better of flash attention on and off, q8_0 needs it on (a quantized value cache
# needs flash attention). maxc bench --context decodes after a prompt of that length prefilled
# in chunks. Medians of ROUNDS (default 2) interleaved rounds.
#
# Fidelity: the largest |logit difference| at every position of a 1024-token prompt (run in
# 512-token steps), f16, bf16 and q8_0 caches against the f32 cache on artifacts of the same
# weights.
# ISA=avx2: AVX2 kernels on both sides (see below). Not part of CI: it builds llama.cpp
# (minutes) and needs quiet cores.
set -euo pipefail
cd "$(dirname "$0")/.."
peers=.tools/peers
threads=${THREADS:-$(nproc)}
ctx=${CTX:-2048,8192}
rounds=${ROUNDS:-2}
mkdir -p "$peers"

gguf=${1:-}
# llama.cpp's tools, built once (scripts/llama-cpp.sh), tried on a file (a build that crashes
# on this CPU is swapped for one without AMX).
if [ -z "$gguf" ]; then
  base=$(bash scripts/fetch-smollm2.sh)
  bin=$(THREADS=$threads bash scripts/llama-cpp.sh "$base")
  gguf="$peers/$(basename "$base" .gguf).Q4_K_M.gguf"
  [ -f "$gguf" ] || "$bin/llama-quantize" --allow-requantize "$base" "$gguf" Q4_K_M >/dev/null 2>&1
else
  bin=$(THREADS=$threads bash scripts/llama-cpp.sh "$gguf")
fi
# ISA=avx2 compares AVX2 kernels on a machine that has AVX-512 too (as bench-peers.sh): maxc
# with MAXC_CPU_ISA=avx2 (q8_0 caches widened a page at a time, the others read in place),
# llama.cpp built for AVX2.
if [ "${ISA:-native}" = avx2 ]; then
  bin=$(THREADS=$threads LLAMA_ISA=avx2 bash scripts/llama-cpp.sh)
  export MAXC_CPU_ISA=avx2
fi

cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc
longest=$(echo "$ctx" | tr ',' '\n' | sort -n | tail -n1)
len=$((longest + 256))
scratch=$(mktemp -d)
results=$(mktemp)
trap 'rm -rf "$scratch" "$results"' EXIT
tokens=$(python3 -c "print(','.join(str((i * 7919 + 13) % 1000 + 3) for i in range(1024)))")
for d in f32 f16 bf16 q8_0; do
  "$maxc" compile "$gguf" --out "$scratch/$d.maxc" --weights keep --max-batch-size 1 \
    --max-seq-len "$len" --max-batch-input-tokens 512 --kv-cache-dtype "$d" --force --quiet
  "$maxc" run "$scratch/$d.maxc" --tokens "$tokens" --step-tokens 512 \
    --dump-logits "$scratch/$d.safetensors" >/dev/null
done

for round in $(seq "$rounds"); do
  for d in f16 q8_0; do
    for fa in 0 1; do
      [ "$d" = q8_0 ] && [ "$fa" = 0 ] && continue
      "$bin/llama-bench" -m "$gguf" -t "$threads" -p 0 -n 32 -d "$ctx" -r 2 -fa "$fa" \
        -ctk "$d" -ctv "$d" -o json 2>/dev/null |
        python3 -c "import json,sys; [print(json.dumps(['llama', '$d', r['n_depth'], r['avg_ts']])) for r in json.load(sys.stdin)]" >> "$results"
    done
  done
  for d in f32 f16 bf16 q8_0; do
    "$maxc" bench "$scratch/$d.maxc" --json --steps 32 --rounds 1 --context "$ctx" |
      python3 -c "import json,sys; [print(json.dumps(['maxc', '$d', m['context'], m['tokens_per_s']])) for m in json.load(sys.stdin)['measurements'] if 'context' in m]" >> "$results"
  done
done

python3 - "$results" "$scratch" "$(basename "$gguf")" "$rounds" <<'EOF'
import json, statistics as st, struct, sys
from array import array
from collections import defaultdict
def logits(path):
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        meta = json.loads(fh.read(n))["logits"]
        fh.seek(8 + n + meta["data_offsets"][0])
        v = array("f")
        v.frombytes(fh.read(meta["data_offsets"][1] - meta["data_offsets"][0]))
        return v
exact = logits(f"{sys.argv[2]}/f32.safetensors")
fid = {d: max(abs(a - b) for a, b in zip(logits(f"{sys.argv[2]}/{d}.safetensors"), exact))
       for d in ("f16", "bf16", "q8_0")}
fid["f32"] = 0.0
runs = defaultdict(list)
for line in open(sys.argv[1]):
    who, d, c, v = json.loads(line)
    runs[(who, d, c)].append(v)
# llama.cpp's f16: the better of flash attention on and off, per round (two entries a round).
def llama(d, c):
    v = runs[("llama", d, c)]
    if d == "f16":
        v = [max(v[i:i + 2]) for i in range(0, len(v), 2)]
    return st.median(v)
print(f"{sys.argv[3]}: decode tokens/s after the context, medians of {sys.argv[4]} rounds; "
      "fidelity: max |logit diff| against maxc's f32 cache over a 1024-token prompt")
print(f"{'context':>8} {'maxc KV':>8} {'maxc':>8} {'llama KV':>9} {'llama':>8} {'ratio':>6} {'fidelity':>9}")
for c in sorted({k[2] for k in runs}):
    for d, ld in (("f32", "f16"), ("f16", "f16"), ("bf16", "f16"), ("q8_0", "q8_0")):
        m = st.median(runs[("maxc", d, c)])
        l = llama(ld, c)
        print(f"{c:>8} {d:>8} {m:8.1f} {ld:>9} {l:8.1f} {m / l:5.2f}x {fid[d]:9.3g}")
EOF
