#!/usr/bin/env bash
# Installs `instructor` (structured outputs from Pydantic models over the OpenAI API) from PyPI
# into .tools/py-instructor (git-ignored), pinned, apart from the test packages: it needs an
# older `openai` than they pin. Prints the folder to put on PYTHONPATH. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/py-instructor
pins=(instructor==1.17.0)
marker="$dest/.installed-$(echo "${pins[*]}" | tr ' =' '_-')"
if [ ! -f "$marker" ]; then
  rm -rf "$dest"
  python3 -m pip install --quiet --disable-pip-version-check --target "$dest" "${pins[@]}" >&2
  touch "$marker"
fi
cd "$dest" && pwd
