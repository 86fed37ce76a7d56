//! maxc's CPU library kernels, arranged by op, then by instruction set. The executor calls
//! them where they beat the generated code; each takes its operands as slices or pointers and
//! holds no state but per-thread scratch.
//!
//! - [`isa`]: the instruction set this CPU runs the kernels in (the leaf every op reads).
//! - [`options`]: the choices a caller makes once, when it sets up an executor.
//! - [`pool`]: the thread pool the kernels split their work over.
//! - [`matmul`]: `x · wᵀ` on weights in their stored format (f32, f16, bf16, the GGUF blocks),
//!   with its register tiles and block kernels per instruction set.
//! - [`gemm`]: f32 matmuls on the `gemm` crate; [`moe`]: SwiGLU experts on them and
//!   DeepSeek's router; [`mla`]: latent attention computed decompressed.
//! - [`attention`]: causal attention over the paged KV cache; [`elementwise`]: fused
//!   elementwise programs (x86-64).

#[cfg(target_arch = "x86_64")]
pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod elementwise;
pub mod gemm;
pub mod isa;
#[cfg(target_arch = "x86_64")]
mod math;
pub mod matmul;
pub mod mla;
pub mod moe;
pub mod options;
pub mod pool;
