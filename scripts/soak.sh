#!/usr/bin/env bash
# Soak test of `maxc serve`: MINUTES (default 10) of mixed load from 32 concurrent clients with
# random disconnects against tiny-llama (a KV cache small enough that requests are preempted,
# prefix caching on), through scripts/soak.py. Reports requests, failures, resident memory over
# time (sampled every 5 s) and KV blocks in use at the end; then SIGTERM, which must exit 0.
#
#   bash scripts/soak.sh [MINUTES]
#
# Everything listens on 127.0.0.1; the run is bounded by MINUTES. Writes .tools/soak/.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
work=.tools/soak
mkdir -p "$work"
cargo build --release --locked --quiet -p maxc-cli
maxc=target/release/maxc
export PYTHONPATH=$(bash scripts/install-py-test-deps.sh)
fixtures=${MAXC_FIXTURES:-golden/fixtures}
"$maxc" compile "$fixtures/tiny-llama" --out "$work/tiny.maxc" --force --quiet \
  --max-batch-size 8 --max-seq-len 256 --page-size 16 --kv-cache-pages 48

log=$work/serve.log
"$maxc" serve "$work/tiny.maxc" --host 127.0.0.1 --port 0 --metrics-port 0 2> "$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  grep -q "API on" "$log" && break
  sleep 0.1
done
api=$(sed -n 's/.*API on \(http:[^,]*\), metrics on \(http:[^ ]*\).*/\1/p' "$log")
metrics=$(sed -n 's/.*API on \(http:[^,]*\), metrics on \(http:[^ ]*\).*/\2/p' "$log")
[ -n "$api" ] || { echo "soak: the server did not start:" >&2; cat "$log" >&2; exit 1; }
until curl -sf "$api/health" >/dev/null; do sleep 0.1; done

status=0
python3 scripts/soak.py --url "$api" --metrics "$metrics" --pid "$pid" --model tiny.maxc \
  --minutes "$minutes" > "$work/summary.json" || status=$?
kill -TERM "$pid"
wait "$pid" && term=0 || term=$?
trap - EXIT
python3 - "$work/summary.json" "$term" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"soak: {s['minutes']} min, {s['clients']} clients: {s['requests']} requests, {s['ok']} ok, "
      f"{s['dropped_on_purpose']} dropped on purpose, {s['failed']} failed")
for e in s["errors"]:
    print("  failure:", e)
print(f"resident memory: {s['rss_mib_at_warmup_end']:.1f} MiB when warm-up ended, peak "
      f"{s['rss_mib_peak_after_warmup']:.1f} MiB after (bound {s['rss_bound_mib']} MiB)")
rss = [x["rss_mib"] for x in s["samples"]]
print("  samples (MiB):", " ".join(f"{r:.0f}" for r in rss))
print(f"KV blocks at the end: {s['kv_blocks_in_use_at_end']:.0f} in use, "
      f"{s['kv_blocks_prefix_cache_only']:.0f} held by the prefix cache alone, "
      f"of {s['kv_blocks_total']:.0f}; {s['preemptions']:.0f} preemptions")
print(f"SIGTERM exit status: {sys.argv[2]}")
for k, v in s["checks"].items():
    print(f"  {'ok  ' if v else 'FAIL'} {k}")
EOF
[ "$status" = 0 ] && [ "$term" = 0 ]
