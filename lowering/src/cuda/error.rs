//! Errors of the CUDA backend.

/// The command that installs NVRTC, the CUDA headers and ptxas, and prints their environment.
pub const INSTALL_HINT: &str = "eval \"$(bash scripts/install-cuda-tools.sh)\"";

/// Why CUDA code could not be emitted, compiled or assembled.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The target architecture string is not one the backend accepts.
    #[error(
        "CUDA target `{arch}` is not supported: expected `sm_XY` (optionally `sm_XYa`) with \
         XY at least 70, e.g. `sm_90`"
    )]
    Arch {
        /// The architecture found.
        arch: String,
    },
    /// The kernel's parameters are inconsistent or not supported.
    #[error("kernel `{name}` ({kind}): {what}")]
    Invalid {
        /// The kernel's name.
        name: String,
        /// The kernel kind.
        kind: &'static str,
        /// Which field is wrong, what was found and what was expected.
        what: String,
    },
    /// The NVRTC library cannot be loaded.
    #[error("NVRTC is not available: {why}; install it with `{INSTALL_HINT}`")]
    NvrtcUnavailable {
        /// What was tried and what failed.
        why: String,
    },
    /// An NVRTC call other than the compilation failed.
    #[error("NVRTC call `{call}` failed: {message}")]
    Nvrtc {
        /// The call.
        call: &'static str,
        /// NVRTC's status or the reason.
        message: String,
    },
    /// NVRTC rejected the source.
    #[error(
        "NVRTC failed to compile the CUDA source for {arch} (options: {options}):\n{log}\n\
         --- source ---\n{listing}"
    )]
    Compile {
        /// The target architecture.
        arch: String,
        /// The options passed to NVRTC.
        options: String,
        /// NVRTC's log.
        log: String,
        /// The source with line numbers.
        listing: String,
    },
    /// ptxas cannot be run.
    #[error(
        "ptxas is not available: {why}; set MAXC_PTXAS or put ptxas on PATH (`{INSTALL_HINT}` \
         sets MAXC_PTXAS)"
    )]
    PtxasUnavailable {
        /// What was tried and what failed.
        why: String,
    },
    /// ptxas rejected the PTX.
    #[error("ptxas ({program}) failed for {arch} with {status}:\n{output}")]
    Ptxas {
        /// The ptxas executable.
        program: String,
        /// The target architecture.
        arch: String,
        /// The exit status.
        status: String,
        /// ptxas' output.
        output: String,
    },
    /// ptxas' resource report could not be read.
    #[error("cannot read ptxas' resource report: {what}\n{output}")]
    PtxasReport {
        /// What was expected.
        what: String,
        /// ptxas' output.
        output: String,
    },
    /// A temporary file could not be written or read.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
}
