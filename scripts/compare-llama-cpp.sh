#!/usr/bin/env bash
# maxc against llama.cpp on the same GGUF file: for each prompt, the ids each tokenizer gives and
# the greedy continuation each engine writes (llama-server's /tokenize and /completion at
# temperature 0, against `maxc generate --json`). Prints one line per prompt and exits non-zero
# when a tokenization differs or a continuation differs before TOKENS tokens.
#
#   bash scripts/compare-llama-cpp.sh [GGUF] [TOKENS]   (default: the real Gemma 3 270M Q4_K_M of
#                                                        scripts/fetch-gemma3.sh, 32 tokens)
#   ACTIVATIONS=q8 bash scripts/compare-llama-cpp.sh    (maxc with 8-bit activations, as llama.cpp)
#
# llama.cpp comes from scripts/llama-cpp.sh (built once, minutes). The server listens on
# loopback only. Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=${1:-}
tokens=${2:-32}
if [ -z "$gguf" ]; then
  gguf=$(bash scripts/fetch-gemma3.sh)
fi
bin=$(bash scripts/llama-cpp.sh "$gguf")
# MAXC_BIN: a maxc binary already built (default: a release build, made here).
maxc=${MAXC_BIN:-}
if [ -z "$maxc" ]; then
  cargo build --release --locked --quiet --bin maxc
  maxc=target/release/maxc
fi
art=.tools/peers/$(basename "$gguf" .gguf)-compare.maxc
"$maxc" compile "$gguf" --out "$art" --force --quiet --max-seq-len 1024 --max-batch-size 1

port=${PORT:-18391}
# An f32 KV cache, as maxc's CPU cache (llama.cpp's default is f16).
"$bin/llama-server" -m "$gguf" --host 127.0.0.1 --port "$port" -c 1024 -np 1 --no-webui \
  -ctk f32 -ctv f32 -t "$(nproc)" > .tools/peers/llama-server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.5
done

python3 - "$port" "$art" "$tokens" "${ACTIVATIONS:-}" "$maxc" <<'EOF'
import json, subprocess, sys, urllib.request

port, art, n, acts, maxc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "List three colours:\n\n1.",
    "Water boils at 100 degrees Celsius, which is",
    "Le chat est sur la table, et le chien",
    "日本の首都は",
    # Past Gemma 3's 512-token window: its sliding layers no longer see the start.
    "".join(f"Day {i}: the ship sailed {['north', 'east', 'south', 'west'][i % 4]} and the crew "
            f"counted {i * 7 % 13} gulls. " for i in range(1, 41)) + "On the last day,",
]

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))

failed = 0
for p in PROMPTS:
    theirs_prompt = post("/tokenize", {"content": p, "add_special": True})["tokens"]
    theirs = post("/completion", {"prompt": theirs_prompt, "n_predict": n, "temperature": 0,
                                  "top_k": 1, "cache_prompt": False, "return_tokens": True,
                                  "ignore_eos": True})["tokens"]
    cmd = [maxc, "generate", art, "--prompt", p, "--max-new-tokens", str(n),
           "--ignore-eos", "--json"]
    if acts:
        cmd += ["--activations", acts]
    ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    same_prompt = ours["prompt"] == theirs_prompt
    agree = next((i for i, (a, b) in enumerate(zip(ours["generated"], theirs)) if a != b),
                 min(len(ours["generated"]), len(theirs)))
    ok = same_prompt and agree >= n
    failed += not ok
    print(f"{'ok  ' if ok else 'DIFF'} prompt ids {'equal' if same_prompt else 'differ'} "
          f"({len(theirs_prompt)}), continuation equal for {agree}/{n}: {p[:48]!r}")
    if not same_prompt:
        print(f"     llama.cpp {theirs_prompt}\n     maxc      {ours['prompt']}")
    if agree < n:
        print(f"     llama.cpp {theirs[agree:agree + 8]}\n     maxc      {ours['generated'][agree:agree + 8]}")
sys.exit(1 if failed else 0)
EOF
