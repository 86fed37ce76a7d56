#!/usr/bin/env bash
# A model that does not fit one process's memory limit, served as a tensor-parallel group of
# processes that each fit it: `scripts/mpi-memory-limit.sh MODEL LIMIT_MB [DEGREE]`.
#
# Compiles MODEL at tensor-parallel degree 1 and DEGREE (default 2), then, each process in a
# memory cgroup of its own limited to LIMIT_MB (v1 `memory.limit_in_bytes`, swap included where
# the kernel accounts it, or v2 `memory.max` with `memory.swap.max` 0):
#   1. `maxc generate` at degree 1: expected to be killed at the limit;
#   2. `mpirun -np DEGREE maxc serve` at DEGREE, one completion request over HTTP: expected to
#      answer, each rank under the limit.
# Prints each run's outcome and each cgroup's peak usage (page cache included: the mapped file's
# pages count while they are resident, and the kernel reclaims them at the limit). Needs root (or
# a delegated cgroup), Open MPI (scripts/install-mpi.sh) and a maxc built with `--features mpi`
# ($MAXC, default target/release/maxc). Exits 1 where either expectation fails, 2 where this
# machine gives no memory cgroup to make.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/mpi-memory-limit.sh MODEL LIMIT_MB [DEGREE]}
limit_mb=${2:?usage: scripts/mpi-memory-limit.sh MODEL LIMIT_MB [DEGREE]}
degree=${3:-2}
maxc=${MAXC:-target/release/maxc}
[ -x "$maxc" ] || { echo "error: $maxc is not built (cargo build --release -p maxc-cli --features mpi)" >&2; exit 1; }
limit=$((limit_mb * 1024 * 1024))

# The memory cgroup this shell is in, and how its children are limited.
if [ -d /sys/fs/cgroup/memory ]; then
  version=1
  base=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
else
  version=2
  base=/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  grep -qw memory "$base/cgroup.subtree_control" 2>/dev/null ||
    echo "+memory" > "$base/cgroup.subtree_control" ||
    { echo "error: cannot enable the memory controller under $base" >&2; exit 2; }
fi
groups=()
make_group() { # NAME: a child cgroup limited to LIMIT_MB
  local g=$base/maxc-limit-$$-$1
  mkdir "$g" 2>/dev/null || { echo "error: cannot make cgroup $g (root or a delegated cgroup needed)" >&2; exit 2; }
  groups+=("$g")
  if [ $version = 1 ]; then
    echo "$limit" > "$g/memory.limit_in_bytes"
    [ -f "$g/memory.memsw.limit_in_bytes" ] && echo "$limit" > "$g/memory.memsw.limit_in_bytes"
  else
    echo "$limit" > "$g/memory.max"
    [ -f "$g/memory.swap.max" ] && echo 0 > "$g/memory.swap.max"
  fi
  return 0
}
peak_mb() { # CGROUP
  local f=$1/memory.max_usage_in_bytes
  [ $version = 2 ] && f=$1/memory.peak
  if [ -f "$f" ]; then echo $(( $(cat "$f") / 1024 / 1024 )); else echo "?"; fi
}
tmp=$(mktemp -d)
server=
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  for g in "${groups[@]}"; do rmdir "$g" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

for d in 1 "$degree"; do
  "$maxc" compile "$model" --out "$tmp/tp$d.maxc" --quiet --max-seq-len 512 \
    --tensor-parallel-degree "$d"
done
echo "artifact: $(du -sm "$tmp/tp1.maxc" | cut -f1) MB at degree 1, $(du -sm "$tmp/tp$degree.maxc" | cut -f1) MB at degree $degree; limit per process: $limit_mb MB (cgroup v$version)"

# Serves artifact tp$1.maxc as $1 processes (mpirun above 1), each in its own cgroup under the
# limit, and asks for two completions: one to start, one once the weights have settled into
# their huge-page copy (made behind the first step). Non-zero where the server ended first.
serve() {
  local d=$1 port launch=()
  for r in $(seq 0 $((d - 1))); do make_group "tp$d-rank$r"; done
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  if [ "$d" -gt 1 ]; then launch=(mpirun --allow-run-as-root --oversubscribe -np "$d"); fi
  "${launch[@]}" \
    sh -c 'echo $$ > "$1-rank${OMPI_COMM_WORLD_RANK:-0}/cgroup.procs" && shift && exec "$@"' sh \
    "$base/maxc-limit-$$-tp$d" "$maxc" serve "$tmp/tp$d.maxc" --host 127.0.0.1 --port "$port" \
    --metrics-port 0 > "$tmp/serve$d.out" 2>&1 &
  server=$!
  local up=
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then up=1; break; fi
    kill -0 $server 2>/dev/null || break
    sleep 0.1
  done
  local answered=0
  if [ -n "$up" ]; then
    for _ in 1 2; do
      curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\": \"tp$d.maxc\", \"prompt\": [1, 2, 3, 4], \"max_tokens\": 8, \"ignore_eos\": true}" \
        > /dev/null && answered=$((answered + 1))
      sleep 3
    done
  fi
  local alive=no
  kill -0 $server 2>/dev/null && alive=yes
  kill -TERM $server 2>/dev/null || true
  wait $server 2>/dev/null || true
  server=
  echo "degree $d as $d process(es): answered $answered of 2, still serving after them: $alive"
  for r in $(seq 0 $((d - 1))); do
    echo "  rank $r: peak $(peak_mb "$base/maxc-limit-$$-tp$d-rank$r") MB"
  done
  [ "$answered" = 2 ] && [ $alive = yes ]
}

if serve 1; then
  echo "error: degree 1 fitted the limit; choose a lower LIMIT_MB" >&2
  exit 1
fi
tail -n 3 "$tmp/serve1.out" | sed 's/^/  degree 1: /'
serve "$degree" || { cat "$tmp/serve$degree.out" >&2; exit 1; }
