//! Lowering errors: each names the pass, kernel or graph node it concerns.

/// A lowering error.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    /// The graph holds something the lowering cannot map to a kernel.
    #[error("graph node `{node}` ({op}): {message}")]
    Unsupported {
        /// The node.
        node: String,
        /// Its op.
        op: String,
        /// Why.
        message: String,
    },
    /// A pass left the kernel graph inconsistent.
    #[error("after pass `{pass}`: {message}")]
    Invalid {
        /// The pass that ran last.
        pass: String,
        /// What is inconsistent.
        message: String,
    },
    /// A dim has no bound.
    #[error("dim `{0}` has no bound (max_dims did not give one)")]
    Unbounded(String),
    /// Code generation failed.
    #[error("kernel `{kernel}`: {message}")]
    Codegen {
        /// The kernel.
        kernel: String,
        /// What failed.
        message: String,
    },
    /// The graph layer failed.
    #[error(transparent)]
    Graph(#[from] maxc_graph::Error),
}

/// Result with [`LowerError`].
pub type Result<T, E = LowerError> = std::result::Result<T, E>;
