#!/usr/bin/env bash
# Multi-head latent attention, absorbed against decompressed (issue 30), on a DeepSeek-V3-shaped
# random checkpoint (scripts/make-random-deepseek.py: V3's per-head sizes, 16 heads, 4 layers,
# bf16): one artifact per form (`maxc compile --mla-attention`), then for prompts of each
# CONTEXTS length (default "256 512") RUNS runs (default 3) of `maxc generate`, 64 greedy
# tokens: decode tokens/s and the prompt's time to the first token, medians, and the ratio
# absorbed / decompressed. With LLAMA=1, llama.cpp (scripts/llama-cpp.sh builds it) on the same
# checkpoint written as GGUF (graph/tests/gguf_py/hf_to_gguf.py: `deepseek2`, bf16, a
# placeholder vocabulary), llama-bench's decode tokens/s at the same depths, and maxc on that
# GGUF file beside it. A benchmark, not a test: it prints, it asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
contexts=${CONTEXTS:-256 512}
cargo build --release --locked --quiet -p maxc-cli
ckpt=${CKPT:-.tools/random-deepseek}
if [ ! -f "$ckpt/model.safetensors" ]; then
  py=$(bash scripts/install-py-test-deps.sh)
  PYTHONPATH=$py python3 scripts/make-random-deepseek.py "$ckpt" >/dev/null
fi
for form in absorbed decompressed; do
  target/release/maxc compile "$ckpt" --out ".tools/bench-mla-$form.maxc" --force --quiet \
    --weights bf16 --max-seq-len 1024 --max-batch-size 1 --page-size 16 --mla-attention "$form"
done
llama=""
if [ "${LLAMA:-0}" = 1 ]; then
  llama="$(bash scripts/llama-cpp.sh)/llama-bench"
  gguf=$ckpt.gguf
  if [ ! -f "$gguf" ]; then
    py=$(bash scripts/install-py-test-deps.sh)
    PYTHONPATH=$py python3 graph/tests/gguf_py/hf_to_gguf.py "$ckpt" "$gguf" --dummy-vocab
  fi
  target/release/maxc compile "$gguf" --out .tools/bench-mla-gguf.maxc --force --quiet \
    --max-seq-len 1024 --max-batch-size 1 --page-size 16
fi
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "DeepSeek-V3-shaped random checkpoint ($ckpt), bf16, $(nproc) CPUs, $runs runs, 64 new tokens"
for ctx in $contexts; do
  prompt=$(python3 -c "print(','.join(str(2 + (i * 37) % 8000) for i in range($ctx)))")
  declare -A dec=() first=()
  for _ in $(seq "$runs"); do
    for form in absorbed decompressed; do
      line=$(target/release/maxc generate ".tools/bench-mla-$form.maxc" --tokens "$prompt" \
        --max-new-tokens 64 --ignore-eos 2>&1 >/dev/null | grep 'tokens/s')
      dec[$form]+="$(sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p' <<<"$line") "
      first[$form]+="$(sed -n 's/.*first after \([0-9.]*\) ms.*/\1/p' <<<"$line") "
    done
  done
  a=$(median ${dec[absorbed]}); d=$(median ${dec[decompressed]})
  fa=$(median ${first[absorbed]}); fd=$(median ${first[decompressed]})
  echo "context $ctx: decode tokens/s absorbed $a (${dec[absorbed]% }), decompressed $d (${dec[decompressed]% })," \
    "ratio $(python3 -c "print(round($a / $d, 2))")"
  echo "             prompt to first token ms absorbed $fa, decompressed $fd," \
    "ratio $(python3 -c "print(round($fa / $fd, 2))")"
  if [ -n "$llama" ]; then
    speeds=() ours=()
    for _ in $(seq "$runs"); do
      speeds+=("$("$llama" -m "$gguf" -p 0 -n 64 -d "$ctx" -t "$(nproc)" -r 1 -o csv 2>/dev/null |
        python3 -c 'import csv,sys; r=list(csv.DictReader(sys.stdin)); print(round(float(r[-1]["avg_ts"]), 1))')")
      ours+=("$(target/release/maxc generate .tools/bench-mla-gguf.maxc --tokens "$prompt" \
        --max-new-tokens 64 --ignore-eos 2>&1 >/dev/null |
        sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p')")
    done
    echo "             GGUF decode tokens/s: llama.cpp $(median "${speeds[@]}") (${speeds[*]})," \
      "maxc $(median "${ours[@]}") (${ours[*]})"
  fi
done
