//! The CPU backend: Cranelift-generated native code for the kernel IR.
//!
//! [`compile_kernel`] turns one [`KernelBody`] into position-independent, relocation-free
//! machine code with the calling convention documented in [`maxc_schema::kernel`].
//! Every kernel kind is generated except [`KernelBody::MoeExperts`], which stays a runtime
//! library kernel. Code generation depends only on the kernel and the fixed [`CpuTarget`],
//! never on the machine running the compiler, so the same input gives the same bytes.

mod attention;
mod builder;
mod columns;
mod dtype;
mod elementwise;
mod error;
mod gather;
mod init;
mod math;
mod matmul;
mod norm;
mod paged;
mod rope;
mod softmax;
mod target;
mod topk;

pub use error::CpuError;
pub use target::CpuTarget;

use builder::KernelBuilder;
use cranelift_codegen::control::ControlPlane;
use cranelift_codegen::ir::{types, AbiParam, Function, Signature, UserFuncName};
use cranelift_codegen::{CodegenError, Context};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use maxc_schema::KernelBody;

/// The alignment (bytes) a kernel's code must start at when several kernels share one code
/// blob: the code addresses its inline 128-bit constants PC-relatively and some instructions
/// need them 16-byte aligned.
pub const KERNEL_CODE_ALIGN: usize = 16;

/// Compiles one kernel to relocation-free, position-independent machine code with the
/// calling convention in [`maxc_schema::kernel`].
pub fn compile_kernel(body: &KernelBody, target: &CpuTarget) -> Result<Vec<u8>, CpuError> {
    compile_function(body.kind(), target, |kb| emit_body(kb, body))
}

/// Builds a kernel-signature function named `kind` with `emit`, compiles it for `target` and
/// returns its code, rejecting code that needs relocations.
fn compile_function(
    kind: &'static str,
    target: &CpuTarget,
    emit: impl FnOnce(&mut KernelBuilder) -> Result<(), CpuError>,
) -> Result<Vec<u8>, CpuError> {
    let isa = target::build_isa(target)?;
    let mut sig = Signature::new(isa.default_call_conv());
    for _ in 0..4 {
        sig.params.push(AbiParam::new(types::I64));
    }
    let mut func = Function::with_name_signature(UserFuncName::testcase(kind), sig);
    let mut fb_ctx = FunctionBuilderContext::new();
    {
        let fb = FunctionBuilder::new(&mut func, &mut fb_ctx);
        let mut kb = KernelBuilder::new(fb, kind);
        emit(&mut kb)?;
        kb.finish(isa.frontend_config());
    }
    let mut ctx = Context::for_function(func);
    let code = ctx
        .compile(&*isa, &mut ControlPlane::default())
        .map_err(|e| CpuError::Codegen {
            kind,
            message: match &e.inner {
                CodegenError::Verifier(errors) => {
                    cranelift_codegen::print_errors::pretty_verifier_error(
                        e.func,
                        None,
                        errors.clone(),
                    )
                }
                other => other.to_string(),
            },
        })?;
    let relocs = code.buffer.relocs();
    if let Some(first) = relocs.first() {
        return Err(CpuError::Relocations {
            kind,
            count: relocs.len(),
            first: format!("{first:?}"),
        });
    }
    Ok(code.code_buffer().to_vec())
}

/// Emits the IR of `body` into the function under construction.
fn emit_body(kb: &mut KernelBuilder, body: &KernelBody) -> Result<(), CpuError> {
    match body {
        KernelBody::Gather {
            cols,
            index,
            src_dtype,
            scale,
            ..
        } => gather::emit(kb, *cols, *index, *src_dtype, *scale),
        KernelBody::Positions => {
            paged::emit_positions(kb);
            Ok(())
        }
        KernelBody::RmsNorm {
            cols,
            width,
            weight_offset,
            eps,
            residual,
            weight_dtype,
            ..
        } => norm::emit(
            kb,
            (*cols, *width),
            *weight_offset,
            *eps,
            *residual,
            *weight_dtype,
        ),
        KernelBody::Elementwise {
            cols,
            inputs,
            program,
            ..
        } => elementwise::emit(kb, *cols, inputs, program),
        KernelBody::Rope {
            heads,
            head_dim,
            rotary_dim,
        } => rope::emit(kb, *heads, *head_dim, *rotary_dim),
        KernelBody::KvStore { .. } => {
            paged::emit_kv_store(kb, &paged::cache_view(kb.kind(), body)?)
        }
        KernelBody::Attention {
            heads,
            scale,
            window,
            value_dim,
            ..
        } => {
            let cache = paged::cache_view(kb.kind(), body)?;
            attention::emit(kb, &cache, *heads, *scale, *window, *value_dim)
        }
        KernelBody::Concat { groups, a, b, .. } => {
            elementwise::emit_concat(kb, *groups, *a, *b);
            Ok(())
        }
        KernelBody::Softmax { cols, .. } => softmax::emit(kb, *cols),
        KernelBody::TopK {
            cols,
            k,
            renormalize,
            ..
        } => topk::emit(kb, *cols, *k, *renormalize),
        KernelBody::Matmul {
            rows,
            n,
            k,
            weight_dtype,
            bias,
        } => matmul::emit(kb, *rows, *n, *k, *weight_dtype, *bias),
        KernelBody::Zeros { dtype, .. } => init::emit_zeros(kb, *dtype),
        KernelBody::RankExperts { experts_per_rank } => {
            init::emit_rank_experts(kb, *experts_per_rank);
            Ok(())
        }
        KernelBody::MoeExperts { .. }
        | KernelBody::HeadMatmul { .. }
        | KernelBody::MoeRouter { .. }
        | KernelBody::DecompressedAttention { .. } => Err(CpuError::Unsupported {
            kind: body.kind(),
            what: "runs as a runtime library kernel, not generated code".to_string(),
        }),
        KernelBody::AllReduce { .. } | KernelBody::AllGather { .. } => Err(CpuError::Unsupported {
            kind: body.kind(),
            what: "runs on the executor's communicator, not generated code".to_string(),
        }),
    }
}
