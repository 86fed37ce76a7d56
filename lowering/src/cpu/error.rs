//! Errors of the CPU backend.

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
