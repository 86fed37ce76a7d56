#!/usr/bin/env bash
# Load test of `maxc serve` with ../shared/tools/serve_load.py (OpenAI completions over SSE;
# TTFT, ITL, TPOT, tokens/s) at 1, 8 and 32 concurrent clients on SmolLM2 (Q4_1 GGUF), at the
# default step budget and at a latency budget of 64 tokens, with the same prompts through
# `maxc generate` one at a time for comparison, and, given --llama-server PATH, llama.cpp's
# server on the same GGUF driven the same way. tiny-llama's test tokenizer decodes random ids
# to no text, and serve_load.py times text chunks, so tiny-llama's server is measured in total
# tokens/s only: the same prompts, non-streaming, from 1, 8 and 32 concurrent clients.
#
#   bash scripts/load-test.sh [--llama-server PATH] [--requests-per-client N] [--quick]
#
# Prints one JSON line per run (server, model, settings, serve_load.py's numbers) and a table.
# Everything listens on 127.0.0.1 only; every run is bounded in requests.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_server=""
per_client=2
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-server) llama_server=$2; shift 2 ;;
    --requests-per-client) per_client=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    *) echo "load-test: unknown argument $1" >&2; exit 2 ;;
  esac
done
load=${MAXC_SERVE_LOAD:-../shared/tools/serve_load.py}
[ -f "$load" ] || { echo "load-test: $load not found (set MAXC_SERVE_LOAD)" >&2; exit 2; }

cargo build --release --locked -p maxc-cli >&2
maxc=target/release/maxc
export PYTHONPATH=$(bash scripts/install-py-test-deps.sh)
gguf=$(bash scripts/fetch-smollm2.sh)
work=.tools/load
mkdir -p "$work"
results=$work/results.jsonl
: > "$results"

prompt_tokens=128
max_tokens=64
clients="1 8 32"
[ "$quick" = 1 ] && clients="1 8"

compile() { # name model flags...
  local name=$1 model=$2; shift 2
  "$maxc" compile "$model" --out "$work/$name.maxc" --force --quiet \
    --max-batch-size 32 --max-seq-len 256 --page-size 16 "$@" >&2
}
compile tiny golden/fixtures/tiny-llama
compile smollm2 "$gguf"
compile smollm2-b64 "$gguf" --max-batch-input-tokens 64

wait_health() { # url
  for _ in $(seq 1 600); do
    curl -sf "$1" > /dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "load-test: $1 never became healthy" >&2
  return 1
}

run_load() { # label model url
  local label=$1 model=$2 url=$3 c
  for c in $clients; do
    local n=$((c * per_client))
    [ "$n" -lt 8 ] && n=8
    python3 "$load" --url "$url" --concurrency "$c" --requests "$n" \
      --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens" --model "$model" \
      --index-base $((RANDOM % 500)) \
      | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['server']='$label'; print(json.dumps(r))" \
      | tee -a "$results"
  done
}

serve_maxc() { # name label
  local name=$1 label=$2 port=18500
  "$maxc" serve "$work/$name.maxc" --host 127.0.0.1 --port $port --metrics-port $((port + 1)) \
    2> "$work/$name.serve.log" &
  local pid=$!
  wait_health "http://127.0.0.1:$port/health"
  run_load "$label" "$name.maxc" "http://127.0.0.1:$port"
  kill -TERM "$pid"; wait "$pid" || true
}

# `maxc generate`, one prompt after another (the prompts serve_load.py sends).
sequential() { # name label
  local name=$1 label=$2 n=8
  python3 - "$maxc" "$work/$name.maxc" "$n" "$prompt_tokens" "$max_tokens" "$label" <<'PY' | tee -a "$results"
import json, subprocess, sys, time
maxc, art, n, pt, mt, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
toks = 0
t0 = time.perf_counter()
for r in range(n):
    ids = [(i * 7919 + 13 + r * 31) % 1000 + 3 for i in range(pt)]
    out = subprocess.run([maxc, "generate", art, "--tokens", ",".join(map(str, ids)),
                          "--max-new-tokens", str(mt), "--ignore-eos", "--json"],
                         capture_output=True, text=True, check=True)
    toks += len(json.loads(out.stdout.strip().splitlines()[-1])["generated"])
wall = time.perf_counter() - t0
print(json.dumps({"server": label, "concurrency": 1, "requests": n, "wall_s": round(wall, 3),
                  "output_tok_per_s": round(toks / wall, 2), "note": "maxc generate per prompt, load included"}))
PY
}

sequential tiny "generate tiny-llama"

# tiny-llama served: every client sends its prompts one after another, non-streaming; output
# tokens from `usage`, over the wall time of the whole run.
burst() { # name label
  local name=$1 label=$2 port=18500 c
  "$maxc" serve "$work/$name.maxc" --host 127.0.0.1 --port $port --metrics-port $((port + 1)) \
    2> "$work/$name.serve.log" &
  local pid=$!
  wait_health "http://127.0.0.1:$port/health"
  for c in $clients; do
    python3 - "http://127.0.0.1:$port" "$name.maxc" "$c" "$per_client" "$prompt_tokens" "$max_tokens" "$label" <<'PY' | tee -a "$results"
import asyncio, json, sys, time
import aiohttp
url, model, c, per, pt, mt, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
n = max(c * per, 8)
async def client(session, reqs, out):
    for r in reqs:
        ids = [(i * 7919 + 13 + r * 31) % 1000 + 3 for i in range(pt)]
        body = {"model": model, "prompt": ids, "max_tokens": mt, "temperature": 0, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            out.append((await resp.json())["usage"]["completion_tokens"])
async def main():
    out = []
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s, range(i, n, c), out) for i in range(c)))
        wall = time.perf_counter() - t0
    print(json.dumps({"server": label, "concurrency": c, "requests": n, "wall_s": round(wall, 3),
                      "req_per_s": round(n / wall, 3), "output_tok_per_s": round(sum(out) / wall, 2),
                      "note": "non-streaming; total tokens/s only"}))
asyncio.run(main())
PY
  done
  kill -TERM "$pid"; wait "$pid" || true
}
sequential smollm2 "generate smollm2"
burst tiny "maxc tiny-llama (budget 2048)"
serve_maxc smollm2 "maxc smollm2 (budget 2048)"
serve_maxc smollm2-b64 "maxc smollm2 (budget 64)"

if [ -n "$llama_server" ]; then
  port=18600
  "$llama_server" -m "$gguf" --host 127.0.0.1 --port $port -np 32 -c $((32 * 256)) \
    -t "$(nproc)" --no-webui > "$work/llama-server.log" 2>&1 &
  pid=$!
  wait_health "http://127.0.0.1:$port/health"
  run_load "llama-server smollm2" "smollm2" "http://127.0.0.1:$port"
  kill -TERM "$pid"; wait "$pid" || true
fi

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'server':34} {'clients':>7} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'fail':>4}")
for r in rows:
    f = lambda k: "" if r.get(k) is None else f"{r[k]:.1f}"
    print(f"{r['server']:34} {r['concurrency']:>7} {r.get('req_per_s', 0) or 0:>7.2f} {r['output_tok_per_s']:>10.1f} "
          f"{f('ttft_ms_p50'):>9} {f('ttft_ms_p99'):>9} {f('itl_ms_p50'):>8} {f('itl_ms_p99'):>8} {r.get('failures', 0):>4}")
PY
