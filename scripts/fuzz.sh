#!/usr/bin/env bash
# Fuzzes maxc's readers and parsers with cargo fuzz (libFuzzer, AddressSanitizer):
#
#   bash scripts/fuzz.sh TARGET SECONDS      one target (fuzz/fuzz_targets/TARGET.rs)
#   bash scripts/fuzz.sh all SECONDS         every target in turn
#
# Targets: safetensors, checkpoint_index, gguf, config, artifact, program, http_body,
# tokenizer_stream, serve_config. Each starts from the seeds in fuzz/seeds/TARGET (plus, for artifact and
# program, the template artifact's own manifest and program) and keeps its corpus in
# .tools/fuzz/corpus/TARGET. A crash stops the run with the failing input in
# .tools/fuzz/artifacts/TARGET (turn it into a regression test). Prints each target's runs and
# coverage. cargo-fuzz is installed from crates.io where missing; the nightly toolchain is used
# where rustup has it, else the stable one with RUSTC_BOOTSTRAP=1. MAXC_FUZZ_TEMPLATE_ONLY=1
# stops after making the template artifact (for running several targets side by side).
# MAXC_FUZZ_SEED and MAXC_FUZZ_RUNS fix libFuzzer's seed and stop each target after that many
# runs (CI sets both, so that its run is the same on every machine: a new crash shows up when
# the code changes, not at random).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: scripts/fuzz.sh TARGET|all SECONDS" >&2; exit 2; }
target=$1
seconds=$2
root=$(pwd)
work=$root/.tools/fuzz
mkdir -p "$work"

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --quiet --locked cargo-fuzz --version 0.13.2 --root "$work/cargo-fuzz"
  export PATH="$work/cargo-fuzz/bin:$PATH"
fi
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  toolchain=(+nightly)
else
  export RUSTC_BOOTSTRAP=1
fi

# The template artifact (tiny-llama, small weights) that artifact, program and
# tokenizer_stream read.
# MAXC_BIN: a maxc binary already built (CI passes the test build's); else a release build.
maxc=${MAXC_BIN:-}
if [ -z "$maxc" ]; then
  cargo build --release --locked --quiet -p maxc-cli
  maxc=target/release/maxc
fi
template=$work/template.maxc
"$maxc" compile "${MAXC_FIXTURES:-golden/fixtures}/tiny-llama" --out "$template" \
  --force --quiet --weights q8_0 --max-seq-len 64 --page-size 16 --max-batch-size 2
export MAXC_FUZZ_ARTIFACT=$template
[ "${MAXC_FUZZ_TEMPLATE_ONLY:-0}" = 1 ] && exit 0

targets=(safetensors checkpoint_index gguf config artifact program http_body tokenizer_stream serve_config)
[ "$target" = all ] || targets=("$target")
cd fuzz
cargo "${toolchain[@]}" fuzz build --target-dir "$work/target" >&2
for t in "${targets[@]}"; do
  corpus=$work/corpus/$t
  mkdir -p "$corpus" "$work/artifacts/$t"
  if [ -d "seeds/$t" ]; then cp -n seeds/$t/* "$corpus/" 2>/dev/null || true; fi
  case $t in
    artifact) cp "$template/manifest.json" "$corpus/template-manifest.json" ;;
    program) cp "$template/decoder/program.bin" "$corpus/template-program.bin" ;;
  esac
  log=$work/$t.log
  echo "== fuzz $t for ${seconds}s" >&2
  status=0
  extra=()
  [ -n "${MAXC_FUZZ_SEED:-}" ] && extra+=(-seed="$MAXC_FUZZ_SEED")
  [ -n "${MAXC_FUZZ_RUNS:-}" ] && extra+=(-runs="$MAXC_FUZZ_RUNS")
  cargo "${toolchain[@]}" fuzz run --target-dir "$work/target" "$t" "$corpus" -- \
    -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/$t/" "${extra[@]}" > "$log" 2>&1 || status=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
  echo "fuzz $t: up to ${seconds}s, $runs runs, coverage $cov, corpus $(ls "$corpus" | wc -l) inputs"
  if [ "$status" != 0 ]; then
    tail -40 "$log" >&2
    echo "fuzz $t: FAILED (input in $work/artifacts/$t)" >&2
    exit 1
  fi
done
