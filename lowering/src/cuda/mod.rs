//! The CUDA backend: CUDA C emitted from the kernel IR, compiled by NVRTC to PTX.
//!
//! [`emit_kernel`] turns one [`KernelBody`] into an `extern "C" __global__` function and its
//! [`CudaLaunch`]; [`module_source`] joins kernels after the shared prelude into one
//! translation unit; [`compile_ptx`] compiles it with NVRTC (loaded at run time through
//! `cudarc`); [`ptxas_check`] assembles the PTX with ptxas and reads each kernel's registers,
//! spills and shared memory. Kernel parameters follow the launch contract in
//! [`maxc_schema::kernel`]: the buffers as device pointers in the documented order,
//! then the step dims as `unsigned long long` in [`maxc_schema::StepDim`] slot
//! order; every index derived from a step dim is guarded against it. Values accumulate in f32.
//! Emission depends only on the kernel and the target, so the same input gives the same text.

mod attention;
mod elementwise;
mod error;
mod gather;
mod init;
mod matmul;
mod matmul_shape;
mod mla;
mod mma;
mod moe;
mod norm;
mod nvrtc;
mod paged;
mod prelude;
mod ptxas;
mod rope;
mod softmax;
mod source;
mod target;
mod topk;

pub use error::{CudaError, INSTALL_HINT};
pub use nvrtc::{compile_ptx, nvrtc_options, nvrtc_status, Ptx};
pub use ptxas::{ptxas_check, KernelResources};
pub use target::CudaTarget;

use maxc_schema::{CudaLaunch, KernelBody};
use source::Ctx;

/// A kernel's source and how to launch it.
type Emitted = (String, CudaLaunch);

/// One generated CUDA kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaKernel {
    /// The kernel's C name (its PTX entry).
    pub name: String,
    /// Its CUDA C source (without the prelude; see [`module_source`]), possibly with helper
    /// device functions named after it.
    pub source: String,
    /// How to launch it.
    pub launch: CudaLaunch,
}

/// Emits `body` as a CUDA kernel named `name` (a C identifier) for `target`.
pub fn emit_kernel(
    name: &str,
    body: &KernelBody,
    target: &CudaTarget,
) -> Result<CudaKernel, CudaError> {
    let cx = Ctx {
        name,
        kind: body.kind(),
    };
    check_name(cx)?;
    if target.sm() < CudaTarget::MIN_SM {
        return Err(CudaError::Arch {
            arch: target.arch.clone(),
        });
    }
    let (source, launch) = match body {
        KernelBody::Gather {
            rows,
            cols,
            index,
            src_dtype,
            scale,
        } => gather::emit(cx, *rows, *cols, *index, *src_dtype, *scale)?,
        KernelBody::Positions => paged::emit_positions(cx)?,
        KernelBody::RmsNorm {
            rows,
            cols,
            width,
            weight_offset,
            eps,
            residual,
            weight_dtype,
        } => norm::emit(
            cx,
            *rows,
            (*cols, *width),
            *weight_offset,
            *eps,
            *residual,
            *weight_dtype,
        )?,
        KernelBody::Elementwise {
            rows,
            cols,
            inputs,
            program,
        } => elementwise::emit(cx, *rows, *cols, inputs, program)?,
        KernelBody::Rope {
            heads,
            head_dim,
            rotary_dim,
        } => rope::emit(cx, *heads, *head_dim, *rotary_dim)?,
        KernelBody::DecompressedAttention { .. } => {
            return Err(cx.invalid(
                "decompressed latent attention runs on the CPU only (it is the measuring form); compile with `--mla-attention absorbed` for CUDA".into(),
            ))
        }
        KernelBody::Concat { rows, groups, a, b } => mla::emit_concat(cx, *rows, *groups, *a, *b)?,
        KernelBody::HeadMatmul {
            rows,
            heads,
            n,
            k,
            weight_dtype,
        } => mla::emit_head_matmul(cx, *rows, *heads, *n, *k, *weight_dtype)?,
        KernelBody::MoeRouter {
            rows,
            experts,
            top_k,
            n_group,
            topk_group,
            scoring,
            group_score,
            renormalize,
            scale,
            bias_dtype,
        } => mla::emit_router(
            cx,
            *rows,
            *experts,
            mla::Routing {
                top_k: *top_k,
                n_group: *n_group,
                topk_group: *topk_group,
                scoring: *scoring,
                group_score: *group_score,
                renormalize: *renormalize,
                scale: *scale,
            },
            *bias_dtype,
        )?,
        KernelBody::KvStore { .. } => paged::emit_kv_store(cx, &paged::cache_view(cx, body)?)?,
        KernelBody::Attention {
            heads,
            scale,
            window,
            value_dim,
            ..
        } => attention::emit(
            cx,
            &paged::cache_view(cx, body)?,
            *heads,
            *scale,
            *window,
            *value_dim,
        )?,
        KernelBody::Softmax { rows, cols } => softmax::emit(cx, *rows, *cols)?,
        KernelBody::TopK {
            rows,
            cols,
            k,
            renormalize,
        } => topk::emit(cx, *rows, *cols, *k, *renormalize)?,
        KernelBody::Matmul {
            rows,
            n,
            k,
            weight_dtype,
            bias,
        } => matmul::emit(cx, target, *rows, *n, *k, *weight_dtype, *bias)?,
        KernelBody::MoeExperts {
            rows,
            hidden,
            ffn,
            experts,
            weight_dtype,
        } => moe::emit(cx, *rows, *hidden, *ffn, *experts, *weight_dtype)?,
        KernelBody::Zeros { elements, dtype } => init::emit_zeros(cx, *elements, *dtype)?,
        KernelBody::RankExperts { experts_per_rank } => {
            init::emit_rank_experts(cx, *experts_per_rank)?
        }
        KernelBody::AllReduce { .. } | KernelBody::AllGather { .. } => {
            return Err(CudaError::Invalid {
                name: name.to_string(),
                kind: body.kind(),
                what: "tensor parallelism on GPUs needs NCCL collectives, which the CUDA backend does not have yet; compile with --target cpu".into(),
            })
        }
    };
    Ok(CudaKernel {
        name: name.to_string(),
        source,
        launch,
    })
}

/// One translation unit: the prelude (headers, load and conversion helpers, reductions, the
/// tensor-core wrappers), then every kernel's source in order, each after a blank line.
pub fn module_source(kernels: &[CudaKernel]) -> String {
    let mut s = prelude::PRELUDE.to_string();
    for k in kernels {
        s.push('\n');
        s.push_str(&k.source);
    }
    s
}

/// Checks that the kernel name is a C identifier that cannot collide with the prelude.
fn check_name(cx: Ctx) -> Result<(), CudaError> {
    let name = cx.name;
    let mut chars = name.chars();
    let starts_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !starts_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(cx.invalid(format!(
            "the name `{name}` is not a C identifier (ASCII letters, digits and `_`, not \
             starting with a digit)"
        )));
    }
    if name.starts_with("maxc_") || name.starts_with("__") {
        return Err(cx.invalid(format!(
            "the name `{name}` uses a reserved prefix (`maxc_` is the prelude's, `__` the \
             compiler's)"
        )));
    }
    Ok(())
}
