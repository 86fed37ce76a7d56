#!/usr/bin/env bash
# Structured outputs' cost end to end: SmolLM2 (scripts/fetch-smollm2.sh) compiled and served in
# release, 8 concurrent json_schema requests against the same requests unconstrained
# (scripts/bench-structured.py), and from the server's metrics the per-step mask time and how
# much of it the overlap with the forward pass hid. The per-token mask times are `cargo bench -p
# maxc-serve --bench grammar`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p maxc-cli
gguf=$(bash scripts/fetch-smollm2.sh)
art=.tools/bench-structured.maxc
target/release/maxc compile "$gguf" --out "$art" --force --quiet --max-seq-len 512 \
  --max-batch-size 8
port=${PORT:-18431}
mport=$((port + 1))
target/release/maxc serve "$art" --host 127.0.0.1 --port "$port" --metrics-port "$mport" \
  2>/dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.2
done
python3 scripts/bench-structured.py "http://127.0.0.1:$port" "${ROUNDS:-3}" \
  "http://127.0.0.1:$mport/metrics"
