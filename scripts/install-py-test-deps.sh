#!/usr/bin/env bash
# Installs the Python packages the tests drive maxc with (the `openai` client, httpx, pytest,
# numpy and safetensors to read the reference fixtures, jsonschema to check structured outputs, aiohttp for serve_load.py, gguf for
# llama.cpp's reference quantizers) from PyPI into .tools/py (git-ignored), pinned. Prints the
# folder to put on PYTHONPATH. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/py
pins=(openai==3.57.0 httpx==0.28.1 pytest==9.2.0 numpy==2.4.6 safetensors==0.8.0 aiohttp==3.14.5 gguf==0.19.0 jsonschema==4.26.0)
marker="$dest/.installed-$(echo "${pins[*]}" | tr ' =' '_-')"
if [ ! -f "$marker" ]; then
  rm -rf "$dest"
  python3 -m pip install --quiet --disable-pip-version-check --target "$dest" "${pins[@]}" >&2
  touch "$marker"
fi
cd "$dest" && pwd
