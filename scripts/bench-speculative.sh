#!/usr/bin/env bash
# Decode tokens/s with and without speculative decoding, and the drafts' acceptance, measured in
# one run (medians of REPS runs of `maxc generate`, interleaved):
#   - tiny-roles: its own draft role (random weights: next to nothing is accepted);
#   - tiny-llama with a separately compiled copy of itself as the draft (everything accepted);
#   - SmolLM2-135M (the default GGUF) with drafts made from it by scripts/make-gguf-draft.py:
#     a truncated copy (blocks DRAFT_LAYERS, default 0-21,27-29) and the full copy.
#
#   bash scripts/bench-speculative.sh            (REPS=5 TOKENS=128 DRAFT_LAYERS=0-21,27-29)
#
# Not part of CI (it wants quiet cores); it builds maxc in release and writes to .tools/spec.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${REPS:-5}
tokens=${TOKENS:-128}
layers=${DRAFT_LAYERS:-0-21,27-29}
work=.tools/spec
mkdir -p "$work"
cargo build --release --quiet -p maxc-cli
maxc=target/release/maxc
fixtures=${MAXC_FIXTURES:-golden/fixtures}
gguf=$(bash scripts/fetch-smollm2.sh)
py=$(bash scripts/install-py-test-deps.sh)

compile() { "$maxc" compile "$@" --quiet --force --max-seq-len 1024 >/dev/null; }
compile "$fixtures/tiny-roles" --out "$work/roles.maxc"
compile "$fixtures/tiny-llama" --out "$work/tiny.maxc" --num-speculative-tokens 3
compile "$gguf" --out "$work/smol.maxc" --num-speculative-tokens 4
PYTHONPATH=$py python3 scripts/make-gguf-draft.py "$gguf" "$work/draft.gguf" --layers "$layers" >/dev/null
PYTHONPATH=$py python3 scripts/make-gguf-draft.py "$gguf" "$work/copy.gguf" --layers 0-29 >/dev/null
compile "$work/draft.gguf" --out "$work/draft.maxc"
compile "$work/copy.gguf" --out "$work/copy.maxc"

tiny_prompt=1,57,300,12,999,4,81,17,200,33
chat="Write a short story about a robot learning to paint."
# name | artifact and flags
configs=(
  "tiny-roles plain|$work/roles.maxc --tokens $tiny_prompt"
  "tiny-roles draft role k=3|$work/roles.maxc --tokens $tiny_prompt --speculative"
  "tiny-llama plain|$work/tiny.maxc --tokens $tiny_prompt"
  "tiny-llama self draft k=3|$work/tiny.maxc --tokens $tiny_prompt --draft $work/tiny.maxc"
  "smollm2 plain|$work/smol.maxc --chat"
  "smollm2 truncated draft k=1|$work/smol.maxc --draft $work/draft.maxc --num-speculative-tokens 1 --chat"
  "smollm2 truncated draft k=2|$work/smol.maxc --draft $work/draft.maxc --num-speculative-tokens 2 --chat"
  "smollm2 copy draft k=3|$work/smol.maxc --draft $work/copy.maxc --num-speculative-tokens 3 --chat"
  "smollm2 copy draft k=4|$work/smol.maxc --draft $work/copy.maxc --num-speculative-tokens 4 --chat"
)
declare -A rates accept
for ((r = 0; r < reps; r++)); do
  for c in "${configs[@]}"; do
    name=${c%%|*}
    read -r -a args <<<"${c#*|}"
    if [[ ${args[-1]} == --chat ]]; then args+=("$chat"); fi
    log=$("$maxc" generate "${args[@]}" --max-new-tokens "$tokens" --ignore-eos 2>&1 >/dev/null)
    rate=$(sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p' <<<"$log")
    rates[$name]="${rates[$name]:-} $rate"
    accept[$name]=$(sed -n 's/.*accepted by position \(.*\)/\1/p' <<<"$log")
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
printf '%-32s %14s %8s  %s\n' config "decode tok/s" ratio "acceptance by position; accepted per step"
for c in "${configs[@]}"; do
  name=${c%%|*}
  m=$(median <<<"${rates[$name]}")
  base=$(median <<<"${rates[${name%% *} plain]}")
  printf '%-32s %14.1f %7.2fx  %s\n' "$name" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" "${accept[$name]:--}"
done
