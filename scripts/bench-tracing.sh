#!/usr/bin/env bash
# What tracing costs the server: ../shared/tools/serve_load.py against `maxc serve` on SmolLM2
# (Q4_1 GGUF) with tracing off and at `batch` level (request and max.batch spans written to a
# JSON-lines file), alternated over ROUNDS rounds (default 2) so that drift hits both alike.
# Prints one JSON line per run and a table of output tokens/s with the batch/off ratio.
#
#   bash scripts/bench-tracing.sh [CLIENTS] [ROUNDS]
#
# Listens on 127.0.0.1 only; every run is bounded in requests.
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-8}
rounds=${2:-2}
load=${MAXC_SERVE_LOAD:-../shared/tools/serve_load.py}
[ -f "$load" ] || { echo "bench-tracing: $load not found (set MAXC_SERVE_LOAD)" >&2; exit 2; }
cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc
export PYTHONPATH=$(bash scripts/install-py-test-deps.sh)
gguf=$(bash scripts/fetch-smollm2.sh)
work=.tools/bench-tracing
mkdir -p "$work"
results=$work/results.jsonl
: > "$results"
"$maxc" compile "$gguf" --out "$work/smollm2.maxc" --force --quiet \
  --max-batch-size 32 --max-seq-len 256 --page-size 16 >&2

run() { # label flags...
  local label=$1 port=18700; shift
  rm -f "$work/spans.jsonl"
  "$maxc" serve "$work/smollm2.maxc" --host 127.0.0.1 --port $port --metrics-port $((port + 1)) \
    "$@" 2> "$work/serve.log" &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    sleep 0.1
  done
  python3 "$load" --url "http://127.0.0.1:$port" --concurrency "$clients" \
    --requests $((clients * 3)) --prompt-tokens 128 --max-tokens 64 --model smollm2.maxc \
    --index-base 7 \
    | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['tracing']='$label'; print(json.dumps(r))" \
    | tee -a "$results"
  kill -TERM "$pid"; wait "$pid" || true
  if [ -f "$work/spans.jsonl" ]; then
    echo "spans written: $(wc -l < "$work/spans.jsonl")" >&2
  fi
}

for _ in $(seq 1 "$rounds"); do
  run off
  run batch --kernel-trace-level batch --trace-file "$work/spans.jsonl"
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'tracing':8} {'clients':>7} {'out tok/s':>10} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'fail':>4}")
for r in rows:
    print(f"{r['tracing']:8} {r['concurrency']:>7} {r['output_tok_per_s']:>10.1f} {r['ttft_ms_p50']:>9.1f} "
          f"{r['itl_ms_p50']:>8.1f} {r['itl_ms_p99']:>8.1f} {r.get('failures', 0):>4}")
off = statistics.mean(r["output_tok_per_s"] for r in rows if r["tracing"] == "off")
on = statistics.mean(r["output_tok_per_s"] for r in rows if r["tracing"] == "batch")
print(f"mean output tok/s: off {off:.1f}, batch {on:.1f}, batch/off {on / off:.3f}")
PY
