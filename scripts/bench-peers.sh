#!/usr/bin/env bash
# maxc against llama.cpp on the same GGUF files, same threads, same prompt length, in one run:
# prefill of 128 tokens and batch-1 decode, tokens/s, with maxc/llama.cpp ratios, and the
# fidelity of maxc's decode activations.
#
#   bash scripts/bench-peers.sh [GGUF]      (default: the SmolLM2 Q4_1 file of scripts/fetch-smollm2.sh)
#   VARIANTS= bash scripts/bench-peers.sh "$(bash scripts/fetch-gemma3.sh)"   (Gemma 3 270M Q4_K_M alone)
#
# llama.cpp comes from PyPI's llama-cpp-python source distribution (its vendored llama.cpp),
# built once with CMake (from PyPI too) into .tools/peers by scripts/llama-cpp.sh. The variants
# (Q8_0, BF16, F32, and the K-quant mixes most downloads are: Q4_K_M, Q5_K_M, Q6_K, and Q5_0)
# are made from GGUF with llama.cpp's own llama-quantize, so both engines read the very same
# files. llama-bench reports prefill (pp128) and decode (tg64) means over 3 repetitions; maxc
# bench the median of its prefill_128 and decode_b1 steps (decode after a 16-token prompt) with
# its default activations (f32, exact), and decode again with `--activations i16` (16-bit
# integer activations) and `q8` (8-bit, as llama.cpp computes).
#
# Fidelity: the largest |logit difference| over a 16-token prompt run as decode steps, of i16
# and q8 against the default f32 activations on the same artifact (the exact product of the
# stored weights: within 2e-3 of the dequantized reference, see cli/tests/quantized.rs).
#
# ISA=avx2 compares AVX2 kernels on a machine that has AVX-512 too: maxc with MAXC_CPU_ISA=avx2,
# llama.cpp built for AVX2 (LLAMA_ISA=avx2 of scripts/llama-cpp.sh). Not part of CI: it builds
# llama.cpp (minutes) and needs quiet cores.
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
# The quantizer of the native build, whichever build is compared.
quantize="$bin/llama-quantize"
if [ "${ISA:-native}" = avx2 ]; then
  bin=$(THREADS=$threads LLAMA_ISA=avx2 bash scripts/llama-cpp.sh)
  export MAXC_CPU_ISA=avx2
fi

# The variants, made by llama-quantize from the given file.
base=$(basename "$gguf" .gguf)
files=("$gguf")
# VARIANTS (space-separated llama-quantize types; empty: the given file alone).
for t in ${VARIANTS-Q8_0 BF16 F32 Q4_K_M Q5_K_M Q6_K Q5_0}; do
  out="$peers/$base.$t.gguf"
  if [ ! -f "$out" ]; then
    "$quantize" --allow-requantize "$gguf" "$out" "$t" >/dev/null 2>&1
  fi
  files+=("$out")
done

cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc

# ROUNDS (default 3) interleaved rounds over the files; each figure is the median of its rounds,
# and each ratio the median of the rounds' ratios (this machine's neighbours make single runs
# noisy).
rounds=${ROUNDS:-3}
# PP: the prompt of the prefill measurement, 128 or 512 tokens.
pp=${PP:-128}
results=$(mktemp)
fidelity=$(mktemp)
scratch=$(mktemp -d)
trap 'rm -rf "$results" "$fidelity" "$scratch"' EXIT
for f in "${files[@]}"; do
  art="$peers/$(basename "$f" .gguf).maxc"
  "$maxc" compile "$f" --out "$art" --weights keep --max-batch-size 1 --max-seq-len 512 \
    --max-batch-input-tokens 512 --force --quiet
  # The fidelity of each activation format against f32 activations (deterministic: once).
  for a in f32 i16 q8; do
    "$maxc" run "$art" --tokens 1,504,3458,282,253,5458,30,378,314,1345,17,216,2123,28,563,4071 \
      --step-tokens 1 --activations "$a" --dump-logits "$scratch/$a.safetensors" >/dev/null
  done
  python3 - "$(basename "$f")" "$scratch" >> "$fidelity" <<'EOF2'
import json, struct, sys
from array import array
def logits(path):
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        meta = json.loads(fh.read(n))["logits"]
        fh.seek(8 + n + meta["data_offsets"][0])
        v = array("f")
        v.frombytes(fh.read(meta["data_offsets"][1] - meta["data_offsets"][0]))
        return v
exact = logits(f"{sys.argv[2]}/f32.safetensors")
diff = lambda a: max(abs(x - y) for x, y in zip(logits(f"{sys.argv[2]}/{a}.safetensors"), exact))
print(json.dumps([sys.argv[1], diff("i16"), diff("q8")]))
EOF2
done
for round in $(seq "$rounds"); do
  for f in "${files[@]}"; do
    art="$peers/$(basename "$f" .gguf).maxc"
    llama=$("$bin/llama-bench" -m "$f" -t "$threads" -p "$pp" -n 64 -r 3 -o json 2>/dev/null)
    ours=$("$maxc" bench "$art" --json --steps 64 --rounds 1)
    ours16=$("$maxc" bench "$art" --json --steps 64 --rounds 1 --activations i16)
    # 8-bit activations, as llama.cpp's (decode of block formats; the same kernels otherwise).
    ours8=$("$maxc" bench "$art" --json --steps 64 --rounds 1 --activations q8)
    python3 - "$f" "$llama" "$ours" "$ours16" "$ours8" "$pp" >> "$results" <<'EOF2'
import json, os, sys
name, llama, ours, ours16, ours8 = os.path.basename(sys.argv[1]), *map(json.loads, sys.argv[2:6])
n = int(sys.argv[6])
pp = next(r["avg_ts"] for r in llama if r["n_prompt"] == n and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in llama if r["n_gen"] == 64 and r["n_prompt"] == 0)
m = {r["name"]: r for r in ours["measurements"]}
m16 = {r["name"]: r for r in ours16["measurements"]}
m8 = {r["name"]: r for r in ours8["measurements"]}
print(json.dumps([name, pp, m[f"prefill_{n}"]["tokens_per_s"], tg, m["decode_b1"]["tokens_per_s"],
                  m16["decode_b1"]["tokens_per_s"], m8["decode_b1"]["tokens_per_s"]]))
EOF2
  done
done
echo "maxc: $("$maxc" bench "$peers/$(basename "${files[0]}" .gguf).maxc" --steps 1 --rounds 1 | head -n1)"
python3 - "$results" "$rounds" "$fidelity" "$pp" <<'EOF2'
import json, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    name, *v = json.loads(line)
    rows.setdefault(name, []).append(v)
fid = {l[0]: l[1:] for l in map(json.loads, open(sys.argv[3]))}
print(f"medians of {sys.argv[2]} interleaved rounds (tokens/s); ratios against llama.cpp; "
      "fidelity: max |logit diff| against f32 activations (the default)")
print(f"{'file':<38} {'llama pp' + sys.argv[4]:>11} {'maxc pp' + sys.argv[4]:>10} {'ratio':>6} {'llama tg':>9} "
      f"{'maxc tg':>8} {'ratio':>6} {'tg i16':>7} {'ratio':>6} {'fidelity':>9} "
      f"{'tg q8':>7} {'ratio':>6} {'fidelity':>9}")
for name, rs in rows.items():
    med = lambda i: st.median(r[i] for r in rs)
    ratio = lambda i, j: st.median(r[i] / r[j] for r in rs)
    fi, f8 = fid[name]
    print(f"{name:<38} {med(0):11.1f} {med(1):10.1f} {ratio(1, 0):5.2f}x {med(2):9.1f} "
          f"{med(3):8.1f} {ratio(3, 2):5.2f}x {med(4):7.1f} {ratio(4, 2):5.2f}x {fi:9.2g} "
          f"{med(5):7.1f} {ratio(5, 2):5.2f}x {f8:9.2g}")
EOF2
