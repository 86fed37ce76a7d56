#!/usr/bin/env bash
# Decode speed when the CPUs are shared (issue 34): SmolLM2 Q4_1 (scripts/fetch-smollm2.sh),
# a 128-token prompt, 64 greedy tokens, decode tokens/s from `maxc generate`, RUNS runs (default
# 5) with 0, 1 and 2 competing busy processes, each competitor's speed as a share of the quiet
# median. With BASE=path/to/another/maxc the same runs for that binary interleave (an A/B of two
# builds); with LLAMA=1 llama.cpp's llama-bench (scripts/llama-cpp.sh builds it) on the same
# file and thread count. DECODE=0, QUOTA=0 or SERVE=0 skip a part. A benchmark, not a test: it
# prints, it asserts nothing.
#
# maxc runs with MAXC_WEIGHTS=huge: the weights are copied into huge pages before the first step,
# so decode is measured as a server runs it. (By default the copy runs behind the first steps; in
# a 64-token run it overlaps most of decode, and under a CPU quota it is billed to the same
# budget, which is the copy's cost, not decode's.)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-5}
export MAXC_WEIGHTS=${MAXC_WEIGHTS:-huge}
cargo build --release --locked --quiet -p maxc-cli
gguf=$(bash scripts/fetch-smollm2.sh)
art=.tools/bench-contention.maxc
target/release/maxc compile "$gguf" --out "$art" --force --quiet --max-seq-len 512 \
  --max-batch-size 8
prompt=$(python3 -c 'print(",".join(str(1 + (i * 37) % 4000) for i in range(128)))')
threads=$(nproc)
bins=("target/release/maxc")
[ -n "${BASE:-}" ] && bins+=("$BASE")
llama=""
if [ "${LLAMA:-0}" = 1 ]; then
  llama="$(bash scripts/llama-cpp.sh)/llama-bench"
fi

busy=()
start_busy() {
  for _ in $(seq "$1"); do
    (while :; do :; done) &
    busy+=($!)
  done
}
stop_busy() {
  [ ${#busy[@]} -gt 0 ] || return 0
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${busy[@]}" 2>/dev/null || true
  busy=()
}
trap stop_busy EXIT

decode() {  # BIN -> decode tokens/s of one run (and, in WIDTHS, the threads it ended on)
  local line
  line=$("$1" generate "$art" --tokens "$prompt" --max-new-tokens 64 --ignore-eos 2>&1 >/dev/null |
    grep 'tokens/s' || true)
  echo "$line" | sed -n 's/.*; \([0-9]*\) at the end (\([0-9]*\) changes.*/\1 threads, \2 changes/p' >> "$widths"
  echo "$line" | sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p'
}
widths=$(mktemp)
llama_decode() {
  "$llama" -m "$gguf" -p 0 -n 64 -t "$threads" -r 1 -o csv 2>/dev/null |
    python3 -c 'import csv,sys; r=list(csv.DictReader(sys.stdin)); print(r[-1]["avg_ts"])'
}

declare -A quiet
for competitors in $([ "${DECODE:-1}" = 1 ] && echo 0 1 2); do
  start_busy "$competitors"
  sleep 0.5
  for bin in "${bins[@]}" ${llama:+llama}; do
    speeds=()
    for _ in $(seq "$runs"); do
      if [ "$bin" = llama ]; then speeds+=("$(llama_decode)"); else speeds+=("$(decode "$bin")"); fi
    done
    line=$(python3 - "$competitors" "${quiet[$bin]:-}" "${speeds[@]}" <<'PY'
import statistics, sys
c, quiet, v = int(sys.argv[1]), sys.argv[2], [float(x) for x in sys.argv[3:]]
med = statistics.median(v)
share = "" if not quiet else "  share of quiet median: " + ", ".join(
    f"{100 * x / float(quiet):.0f}%" for x in v) + f" (min {100 * min(v) / float(quiet):.0f}%)"
print(f"{med:.2f}|" + ", ".join(f"{x:.1f}" for x in v) + share)
PY
)
    [ "$competitors" = 0 ] && quiet[$bin]=${line%%|*}
    echo "$competitors busy, $bin: decode tokens/s ${line#*|} (median ${line%%|*})"
    if [ -s "$widths" ]; then
      echo "  width at the end of each run: $(paste -sd';' "$widths" | sed 's/;/; /g')"
    fi
    : > "$widths"
  done
  stop_busy
done

# A cgroup CPU quota of one core: the thread count maxc chooses inside it, and decode there
# against `--threads 1` unconfined (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`; where
# neither can be made, it says so).
if [ "${QUOTA:-1}" = 1 ]; then
  cg=""
  if [ -f /sys/fs/cgroup/cgroup.controllers ] && mkdir -p /sys/fs/cgroup/maxc-bench 2>/dev/null &&
     echo "100000 100000" > /sys/fs/cgroup/maxc-bench/cpu.max 2>/dev/null; then
    cg=/sys/fs/cgroup/maxc-bench
  elif [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ] &&
       mkdir -p /sys/fs/cgroup/cpu/maxc-bench 2>/dev/null &&
       echo 100000 > /sys/fs/cgroup/cpu/maxc-bench/cpu.cfs_period_us 2>/dev/null &&
       echo 100000 > /sys/fs/cgroup/cpu/maxc-bench/cpu.cfs_quota_us 2>/dev/null; then
    cg=/sys/fs/cgroup/cpu/maxc-bench
  fi
  if [ -z "$cg" ]; then
    echo "cgroup quota: this machine lets the script make no cgroup with a CPU quota; skipped"
  else
    quota=() free=()
    for _ in $(seq "$runs"); do
      line=$(sh -c "echo \$\$ > $cg/cgroup.procs && exec target/release/maxc generate $art \
        --tokens $prompt --max-new-tokens 64 --ignore-eos" 2>&1 >/dev/null | grep 'tokens/s')
      quota+=("$(echo "$line" | sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p')")
      chosen=${line#*CPU: }
      free+=("$(target/release/maxc generate "$art" --tokens "$prompt" --max-new-tokens 64 \
        --ignore-eos --threads 1 2>&1 >/dev/null | sed -n 's/.*then \([0-9.]*\) tokens\/s.*/\1/p')")
    done
    rmdir "$cg" 2>/dev/null || true
    echo "cgroup quota of 1 CPU ($cg): maxc chose $chosen"
    echo "  decode tokens/s in the quota ${quota[*]}; --threads 1 unconfined ${free[*]}"
  fi
fi

# Serving: 8 clients (serve_load.py, 16 requests of 64 tokens after a 128-token prompt) with 0
# and 2 competing busy processes; /health and /metrics polled every 50 ms throughout, the
# slowest answer of each, and the kernels' width (maxc_cpu_threads) at the end.
[ "${SERVE:-1}" = 1 ] || exit 0
load=${MAXC_SERVE_LOAD:-../shared/tools/serve_load.py}
export PYTHONPATH=$(bash scripts/install-py-test-deps.sh)
port=${PORT:-18531}
mport=${METRICS_PORT:-18532}
target/release/maxc serve "$art" --host 127.0.0.1 --port "$port" --metrics-port "$mport" \
  --served-model-name default 2>/dev/null &
server=$!
trap 'stop_busy; kill $server 2>/dev/null || true' EXIT
for _ in $(seq 200); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.1
done
for competitors in 0 2; do
  start_busy "$competitors"
  sleep 0.5
  python3 - "http://127.0.0.1:$port" "http://127.0.0.1:$mport/metrics" "$load" "$competitors" <<'PY'
import json, subprocess, sys, threading, time, urllib.request
url, metrics, load, competitors = sys.argv[1:5]
worst, stop = {"/health": 0.0, "/metrics": 0.0}, threading.Event()
def probe():
    while not stop.is_set():
        for name, target in (("/health", url + "/health"), ("/metrics", metrics)):
            t = time.perf_counter()
            try:
                urllib.request.urlopen(target, timeout=5).read()
                worst[name] = max(worst[name], (time.perf_counter() - t) * 1e3)
            except Exception:
                worst[name] = float("inf")
        time.sleep(0.05)
th = threading.Thread(target=probe); th.start()
out = subprocess.run([sys.executable, load, "--url", url, "--concurrency", "8",
                      "--requests", "16", "--max-tokens", "64", "--prompt-tokens", "128"],
                     capture_output=True, text=True).stdout
stop.set(); th.join()
r = json.loads(out.strip().splitlines()[-1])
width = [l.split()[-1] for l in urllib.request.urlopen(metrics, timeout=5).read().decode().splitlines()
         if l.startswith("maxc_cpu_threads ")]
print(f"serving, {competitors} busy: {r['output_tok_per_s']} output tokens/s at 8 clients, "
      f"{r['failures']} failed, /health slowest {worst['/health']:.1f} ms, /metrics slowest "
      f"{worst['/metrics']:.1f} ms, kernels' width at the end {''.join(width) or '?'}")
PY
  stop_busy
done
