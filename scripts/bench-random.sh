#!/usr/bin/env bash
# maxc against llama.cpp at the sizes people run, without downloading them: a Llama-3.2-1B-shaped
# and a Qwen3-0.6B-shaped checkpoint of random bf16 weights (scripts/make-random-llama.py, fixed
# seed), written as GGUF the way llama.cpp's converter writes them
# (graph/tests/gguf_py/hf_to_gguf.py, a placeholder vocabulary), quantized to Q4_K_M by
# llama.cpp's own llama-quantize, then scripts/bench-peers.sh on each file alone with a 512-token
# prefill: prefill 512 and batch-1 decode tokens/s of both engines, their ratios, and the
# fidelity of maxc's i16 and q8 activations against its default f32.
#
#   bash scripts/bench-random.sh            (ROUNDS, ISA=avx2 as bench-peers.sh)
#
# Disk: about 8 GB under .tools/random (the checkpoints, their bf16 GGUF, the Q4_K_M files).
# Not part of CI: it builds llama.cpp and writes gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.tools/random
mkdir -p "$dir"
quantize="$(bash scripts/llama-cpp.sh)/llama-quantize"
py=""
for model in llama-1b qwen3-0.6b; do
  ckpt=$dir/$model
  q4=$dir/$model.Q4_K_M.gguf
  if [ ! -f "$q4" ]; then
    [ -n "$py" ] || py=$(bash scripts/install-py-test-deps.sh)
    if [ ! -f "$ckpt/model.safetensors" ]; then
      flag=""
      [ "$model" = qwen3-0.6b ] && flag=--qwen3
      PYTHONPATH=$py python3 scripts/make-random-llama.py "$ckpt" $flag >/dev/null
    fi
    PYTHONPATH=$py python3 graph/tests/gguf_py/hf_to_gguf.py "$ckpt" "$dir/$model.bf16.gguf" --dummy-vocab
    "$quantize" "$dir/$model.bf16.gguf" "$q4" Q4_K_M >/dev/null 2>&1
    rm -f "$dir/$model.bf16.gguf"
  fi
  VARIANTS= PP=512 bash scripts/bench-peers.sh "$q4"
done
