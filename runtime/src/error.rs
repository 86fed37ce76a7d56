//! Runtime errors: each names the artifact file, the input or the setting it concerns.

use std::path::PathBuf;

/// A runtime error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A file of the artifact could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The artifact is malformed, incomplete or altered.
    #[error("{}: {message}", path.display())]
    Artifact {
        /// The file (or the artifact directory).
        path: PathBuf,
        /// What differs from what was expected.
        message: String,
    },
    /// The artifact was compiled for a target this machine or runtime cannot run.
    #[error("target mismatch: {0}")]
    Target(String),
    /// A request does not fit the artifact's bounds or vocabulary.
    #[error("invalid input: {0}")]
    Input(String),
    /// A collective among parallel ranks failed: a rank died, hung, or called another
    /// collective (the message names the rank and the collective).
    #[error("{0}")]
    Collective(String),
    /// The page table refused a step or an operation (out of pages, a sequence too long, ...).
    #[error("{0}")]
    Pages(#[from] maxc_kv::PageError),
}

impl From<maxc_schema::StepError> for RuntimeError {
    fn from(e: maxc_schema::StepError) -> Self {
        RuntimeError::Input(e.0)
    }
}

impl RuntimeError {
    /// An [`RuntimeError::Artifact`] error.
    pub fn artifact(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        RuntimeError::Artifact {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Result with [`RuntimeError`].
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
