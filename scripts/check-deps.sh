#!/usr/bin/env bash
# The contract between compiler and runtime, and the runtime's layers, as dependency trees
# (DESIGN.md): serve -> runtime -> {kernels, kv} -> schema, each arrow one way.
# - schema (the contract) pulls no other maxc crate and nothing that runs, serves or renders;
# - kv (the page table and prefix cache) pulls schema alone of maxc, and no async or HTTP stack;
# - kernels (the CPU library kernels) pulls schema alone of maxc, no async, HTTP, tokenizer,
#   driver or artifact-reading stack;
# - the runtime (artifact, executors, engine) pulls no HTTP, metrics, tracing-export, tokenizer,
#   template or scheduler crate;
# - serve pulls no compiler crate;
# - the compiler side (graph, lowering, exporter) pulls no executor or serving crate;
# - the lean `maxc` (built without the default `compile` feature) pulls no compiler crate.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
# Crate names (one per line, no versions) of `cargo tree` for the given arguments, normal
# dependencies only (tests may use anything).
crates() { cargo tree --locked -e normal --prefix none "$@" | sed 's/ v[0-9].*//' | sort -u; }
features_of() { cargo tree --locked -e normal,features --prefix none -i "$@" 2>/dev/null | sed -n 's/^[^ ]* feature "\([^"]*\)".*/\1/p' | sort -u; }
need() { # $1: what, $2: list, rest: required names (the arrows that must exist)
  local what=$1 list=$2; shift 2
  for c in "$@"; do
    if ! grep -qx "$c" <<<"$list"; then
      echo "check-deps: $what does not depend on $c" >&2
      fail=1
    fi
  done
}
refuse() { # $1: what, $2: list, rest: forbidden names
  local what=$1 list=$2; shift 2
  for c in "$@"; do
    if grep -qx "$c" <<<"$list"; then
      echo "check-deps: $what depends on $c" >&2
      fail=1
    fi
  done
}

compiler="maxc-graph maxc-lowering maxc-exporter cranelift-codegen cranelift-frontend petgraph"
serving="axum hyper hyper-util http-body-util prometheus-client opentelemetry opentelemetry_sdk opentelemetry-otlp tokenizers minijinja serde-saphyr"

# shellcheck disable=SC2086
refuse "maxc-schema (the contract)" "$(crates -p maxc-schema)" \
  maxc-kv maxc-kernels maxc-runtime maxc-serve $compiler $serving tokio cudarc gemm memmap2
# shellcheck disable=SC2086
refuse "maxc-kv (KV bookkeeping)" "$(crates -p maxc-kv)" \
  maxc-kernels maxc-runtime maxc-serve $compiler $serving tokio cudarc gemm
need "maxc-kv (KV bookkeeping)" "$(crates -p maxc-kv)" maxc-schema
# shellcheck disable=SC2086
refuse "maxc-kernels (CPU kernels)" "$(crates -p maxc-kernels)" \
  maxc-kv maxc-runtime maxc-serve $compiler $serving tokio cudarc memmap2 libloading
need "maxc-kernels (CPU kernels)" "$(crates -p maxc-kernels)" maxc-schema
# shellcheck disable=SC2086
refuse "maxc-runtime (executors, engine)" "$(crates -p maxc-runtime)" \
  maxc-serve $compiler $serving tokio
need "maxc-runtime (executors, engine)" "$(crates -p maxc-runtime)" maxc-kernels maxc-kv maxc-schema
# shellcheck disable=SC2086
refuse "maxc-serve (scheduler, server)" "$(crates -p maxc-serve)" $compiler
need "maxc-serve (scheduler, server)" "$(crates -p maxc-serve)" maxc-runtime

for p in maxc-graph maxc-lowering maxc-exporter; do
  list=$(crates -p "$p")
  refuse "$p (compiler side)" "$list" maxc-runtime maxc-serve gemm minijinja axum tokio
  if features_of cudarc -p "$p" | grep -qx driver; then
    echo "check-deps: $p pulls cudarc's CUDA driver bindings" >&2
    fail=1
  fi
done

lean=$(crates -p maxc-cli --no-default-features)
refuse "the lean maxc (--no-default-features)" "$lean" \
  maxc-graph maxc-lowering maxc-exporter cranelift-codegen cranelift-frontend petgraph
if features_of cudarc -p maxc-cli --no-default-features | grep -qx nvrtc; then
  echo "check-deps: the lean maxc pulls NVRTC (cudarc feature nvrtc)" >&2
  fail=1
fi
if [ "$fail" = 0 ]; then
  echo "check-deps: serve -> runtime -> {kernels, kv} -> schema one way; compiler side free of executor and serving crates; lean maxc free of compiler crates"
fi
exit "$fail"
