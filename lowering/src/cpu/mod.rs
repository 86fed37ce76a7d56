//! The CPU backend: Cranelift-generated native code for the kernel IR.
//!
//! [`compile_kernel`] turns one [`KernelBody`] into position-independent, relocation-free
//! machine code with the calling convention documented in [`maxc_runtime::schema::kernel`].
//! Every kernel kind is generated except [`KernelBody::MoeExperts`], which stays a runtime
//! library kernel. Code generation depends only on the kernel and the fixed [`CpuTarget`],
//! never on the machine running the compiler, so the same input gives the same bytes.

mod attention;
mod builder;
mod dtype;
mod elementwise;
mod gather;
mod math;
mod matmul;
mod norm;
mod paged;
mod rope;
mod softmax;
mod topk;

use builder::KernelBuilder;
use cranelift_codegen::control::ControlPlane;
use cranelift_codegen::ir::{types, AbiParam, Function, Signature, UserFuncName};
use cranelift_codegen::isa::{self, OwnedTargetIsa};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::{CodegenError, Context};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use maxc_runtime::schema::KernelBody;

/// The alignment (bytes) a kernel's code must start at when several kernels share one code
/// blob: the code addresses its inline 128-bit constants PC-relatively and some instructions
/// need them 16-byte aligned.
pub const KERNEL_CODE_ALIGN: usize = 16;

/// The fixed code-generation target: architecture + feature set. Fixed, not host-detected, so
/// compiler output is deterministic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuTarget {
    /// `"x86_64"` or `"aarch64"`.
    pub arch: String,
    /// Instruction-set features the code may use, e.g. `["sse3", "ssse3", "sse4.1", ...]`.
    pub features: Vec<String>,
}

impl CpuTarget {
    /// The baseline target for the architecture this compiler runs on: x86-64-v2 (128-bit SSE
    /// up to SSE4.2) on x86_64, NEON on aarch64; an error on other architectures.
    pub fn host_baseline() -> Result<Self, CpuError> {
        let (arch, features): (&str, &[&str]) = match std::env::consts::ARCH {
            "x86_64" => ("x86_64", &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt"]),
            "aarch64" => ("aarch64", &["neon"]),
            other => {
                return Err(CpuError::UnsupportedArch {
                    arch: other.to_string(),
                })
            }
        };
        Ok(CpuTarget {
            arch: arch.to_string(),
            features: features.iter().map(|f| f.to_string()).collect(),
        })
    }

    /// Whether the machine running this code has the target's architecture and every feature.
    pub fn host_supports(&self) -> bool {
        self.arch == std::env::consts::ARCH && self.features.iter().all(|f| host_has(f))
    }
}

#[cfg(target_arch = "x86_64")]
fn host_has(feature: &str) -> bool {
    match feature {
        "sse3" => std::arch::is_x86_feature_detected!("sse3"),
        "ssse3" => std::arch::is_x86_feature_detected!("ssse3"),
        "sse4.1" => std::arch::is_x86_feature_detected!("sse4.1"),
        "sse4.2" => std::arch::is_x86_feature_detected!("sse4.2"),
        "popcnt" => std::arch::is_x86_feature_detected!("popcnt"),
        "avx" => std::arch::is_x86_feature_detected!("avx"),
        "avx2" => std::arch::is_x86_feature_detected!("avx2"),
        "fma" => std::arch::is_x86_feature_detected!("fma"),
        "bmi1" => std::arch::is_x86_feature_detected!("bmi1"),
        "bmi2" => std::arch::is_x86_feature_detected!("bmi2"),
        "lzcnt" => std::arch::is_x86_feature_detected!("lzcnt"),
        "cmpxchg16b" => std::arch::is_x86_feature_detected!("cmpxchg16b"),
        _ => false,
    }
}

#[cfg(target_arch = "aarch64")]
fn host_has(feature: &str) -> bool {
    match feature {
        "neon" => std::arch::is_aarch64_feature_detected!("neon"),
        "lse" => std::arch::is_aarch64_feature_detected!("lse"),
        "fp16" => std::arch::is_aarch64_feature_detected!("fp16"),
        "dotprod" => std::arch::is_aarch64_feature_detected!("dotprod"),
        _ => false,
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn host_has(_feature: &str) -> bool {
    false
}

/// Why a kernel could not be compiled for the CPU.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// The target architecture is not one the backend generates code for.
    #[error("CPU target architecture `{arch}` is not supported (expected `x86_64` or `aarch64`)")]
    UnsupportedArch {
        /// The architecture found.
        arch: String,
    },
    /// A target feature has no Cranelift setting.
    #[error("CPU target feature `{feature}` is unknown for `{arch}` (expected one of: {known})")]
    UnknownFeature {
        /// The target architecture.
        arch: String,
        /// The feature found.
        feature: String,
        /// The features this backend knows for the architecture.
        known: String,
    },
    /// Cranelift rejected the target or its settings.
    #[error("cannot set up Cranelift for CPU target `{arch}`: {message}")]
    Isa {
        /// The target architecture.
        arch: String,
        /// Cranelift's message.
        message: String,
    },
    /// The kernel kind is not generated on the CPU.
    #[error("{kind} kernel: {what}")]
    Unsupported {
        /// The kernel kind.
        kind: &'static str,
        /// What is unsupported and what to do instead.
        what: String,
    },
    /// The kernel's parameters are inconsistent.
    #[error("{kind} kernel: {what}")]
    Invalid {
        /// The kernel kind.
        kind: &'static str,
        /// Which field is wrong, what was found and what was expected.
        what: String,
    },
    /// Cranelift failed to compile the generated IR.
    #[error("{kind} kernel: Cranelift code generation failed: {message}")]
    Codegen {
        /// The kernel kind.
        kind: &'static str,
        /// Cranelift's message (with the IR when the verifier failed).
        message: String,
    },
    /// The generated code needs relocations, so it cannot be loaded by a plain copy.
    #[error(
        "{kind} kernel: generated code has {count} relocation(s), first `{first}`; the target \
         likely lacks a feature Cranelift needs to stay inline (e.g. sse4.1 on x86_64)"
    )]
    Relocations {
        /// The kernel kind.
        kind: &'static str,
        /// Number of relocations.
        count: usize,
        /// The first relocation, as Cranelift prints it.
        first: String,
    },
}

/// Compiles one kernel to relocation-free, position-independent machine code with the
/// calling convention in [`maxc_runtime::schema::kernel`].
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
    let isa = build_isa(target)?;
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
            ..
        } => gather::emit(kb, *cols, *index, *src_dtype),
        KernelBody::Positions => {
            paged::emit_positions(kb);
            Ok(())
        }
        KernelBody::RmsNorm {
            cols,
            eps,
            residual,
            weight_dtype,
            ..
        } => norm::emit(kb, *cols, *eps, *residual, *weight_dtype),
        KernelBody::Elementwise {
            cols,
            inputs,
            program,
            ..
        } => elementwise::emit(kb, *cols, inputs, program),
        KernelBody::Rope { heads, head_dim } => rope::emit(kb, *heads, *head_dim),
        KernelBody::KvStore {
            layer,
            num_layers,
            kv_heads,
            head_dim,
            page_size,
        } => paged::emit_kv_store(
            kb,
            &paged::CacheLayout::new(
                kb.kind(),
                *layer,
                *num_layers,
                *kv_heads,
                *head_dim,
                *page_size,
            )?,
        ),
        KernelBody::Attention {
            layer,
            num_layers,
            heads,
            kv_heads,
            head_dim,
            page_size,
            scale,
        } => {
            let cache = paged::CacheLayout::new(
                kb.kind(),
                *layer,
                *num_layers,
                *kv_heads,
                *head_dim,
                *page_size,
            )?;
            attention::emit(kb, &cache, *heads, *scale)
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
        KernelBody::MoeExperts { .. } => Err(CpuError::Unsupported {
            kind: body.kind(),
            what: "MoE experts run as a runtime library kernel, not generated code".to_string(),
        }),
    }
}

/// The Cranelift ISA for `target`, with explicit settings so output does not depend on the host.
fn build_isa(target: &CpuTarget) -> Result<OwnedTargetIsa, CpuError> {
    let isa_err = |message: String| CpuError::Isa {
        arch: target.arch.clone(),
        message,
    };
    let triple = match target.arch.as_str() {
        // kernel.rs fixes System V on x86-64, whatever the host OS.
        "x86_64" => "x86_64-unknown-linux-gnu",
        "aarch64" if cfg!(target_os = "macos") => "aarch64-apple-darwin",
        "aarch64" => "aarch64-unknown-linux-gnu",
        other => {
            return Err(CpuError::UnsupportedArch {
                arch: other.to_string(),
            })
        }
    };
    let mut shared = settings::builder();
    let debug = if cfg!(debug_assertions) {
        "true"
    } else {
        "false"
    };
    for (name, value) in [
        ("opt_level", "speed"),
        ("is_pic", "true"),
        ("enable_verifier", debug),
        ("enable_probestack", "false"),
    ] {
        shared
            .set(name, value)
            .map_err(|e| isa_err(format!("setting `{name}`: {e}")))?;
    }
    let mut builder = isa::lookup_by_name(triple).map_err(|e| isa_err(format!("{triple}: {e}")))?;
    for feature in &target.features {
        if let Some(flag) = isa_flag(&target.arch, feature)? {
            builder
                .enable(flag)
                .map_err(|e| isa_err(format!("enabling `{flag}` for `{feature}`: {e}")))?;
        }
    }
    builder
        .finish(settings::Flags::new(shared))
        .map_err(|e| isa_err(e.to_string()))
}

/// Target features and their Cranelift ISA flags (`None`: part of the architecture baseline).
const X86_FEATURES: &[(&str, Option<&str>)] = &[
    ("sse3", Some("has_sse3")),
    ("ssse3", Some("has_ssse3")),
    ("sse4.1", Some("has_sse41")),
    ("sse4.2", Some("has_sse42")),
    ("popcnt", Some("has_popcnt")),
    ("cmpxchg16b", Some("has_cmpxchg16b")),
    ("avx", Some("has_avx")),
    ("avx2", Some("has_avx2")),
    ("fma", Some("has_fma")),
    ("bmi1", Some("has_bmi1")),
    ("bmi2", Some("has_bmi2")),
    ("lzcnt", Some("has_lzcnt")),
];
const AARCH64_FEATURES: &[(&str, Option<&str>)] = &[
    ("neon", None),
    ("lse", Some("has_lse")),
    ("fp16", Some("has_fp16")),
    ("dotprod", Some("has_dotprod")),
];

/// The Cranelift flag for one target feature.
fn isa_flag(arch: &str, feature: &str) -> Result<Option<&'static str>, CpuError> {
    let table = if arch == "x86_64" {
        X86_FEATURES
    } else {
        AARCH64_FEATURES
    };
    table
        .iter()
        .find(|(name, _)| *name == feature)
        .map(|(_, flag)| *flag)
        .ok_or_else(|| CpuError::UnknownFeature {
            arch: arch.to_string(),
            feature: feature.to_string(),
            known: table
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}
