#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (sm_80 or newer): builds maxc, compiles tiny-llama, tiny-qwen2,
# tiny-mixtral and tiny-roles for CUDA (f32 and bf16 weights), runs the fixture suite on the CUDA
# executor (logits against the Hugging Face fixtures: < 1e-3 for f32, < 3e-2 for bf16; greedy
# tokens), and prints prefill/decode tokens/s on the GPU next to the CPU artifact. ~5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader || true
cuda_env=$(bash scripts/install-cuda-tools.sh)
eval "$cuda_env"
export MAXC_REQUIRE_NVRTC=1 MAXC_GPU=1
echo "== fixture suite on CUDA"
cargo test --release -p maxc-cli --test backends -- --include-ignored cuda 2>&1 | tail -n 40
echo "== NCCL: the communicators' common check on a one-GPU group (or why there is none)"
cargo test --release -p maxc-runtime --lib comm::nccl -- --nocapture 2>&1 | grep -E "NCCL|no NCCL|test result"
echo "== throughput (tiny-llama, SmolLM2): CPU vs CUDA"
MAXC_BENCH_CUDA=1 cargo bench -p maxc-cli --bench step 2>&1 | tail -n 40
