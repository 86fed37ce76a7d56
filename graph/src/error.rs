//! The graph layer's error type. Every variant names what it concerns: a file, a key, a field,
//! a dim or a node, together with what was found and what was expected.

use std::path::PathBuf;

/// Result with the graph layer's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of the graph layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file is malformed (truncated safetensors, bad index, ...).
    #[error("{}: {message}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A model configuration is missing a field or holds a value maxc cannot use.
    #[error("{}: `{field}`: {message}", file.display())]
    Config {
        /// The config file (config.json, or the file it was read from).
        file: PathBuf,
        /// The field, as a JSON path (`text_config.hidden_size`).
        field: String,
        /// What was found and what was expected.
        message: String,
    },
    /// No registered architecture has this name.
    #[error("unknown architecture `{name}` (from {source_desc}); registered: {known}")]
    UnknownArchitecture {
        /// The name that was asked for.
        name: String,
        /// Where the name came from.
        source_desc: String,
        /// The registered names, comma separated.
        known: String,
    },
    /// An architecture name was registered twice.
    #[error("architecture `{0}` is registered twice")]
    DuplicateArchitecture(String),
    /// A graph parameter has no weight in the checkpoint.
    #[error("role {role}: missing weight `{key}` (expected {expected}){hint}")]
    MissingWeight {
        /// The graph role.
        role: String,
        /// The parameter key, after the role prefix was stripped.
        key: String,
        /// The expected dtype and shape.
        expected: String,
        /// Extra context, e.g. the prefix that was looked under.
        hint: String,
    },
    /// Checkpoint weights that no graph parameter uses.
    #[error("role {role}: {count} unused checkpoint weight(s): {keys}")]
    UnusedWeights {
        /// The graph role.
        role: String,
        /// How many keys are unused.
        count: usize,
        /// The first few unused keys.
        keys: String,
    },
    /// A weight's shape differs from its graph parameter's.
    #[error("role {role}: weight `{key}` has shape {found:?}, expected {expected:?}")]
    WeightShape {
        /// The graph role.
        role: String,
        /// The weight key.
        key: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// Shape the graph expects.
        expected: Vec<usize>,
    },
    /// A weight's dtype cannot be converted to what the graph needs.
    #[error("weight `{key}`: {message}")]
    WeightDtype {
        /// The weight key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A dim that `max_dims` does not bound, or a bad runtime setting.
    #[error("dim `{dim}`: {message}")]
    Dim {
        /// The dim's name.
        dim: String,
        /// What is wrong, and the dims that are known.
        message: String,
    },
    /// A runtime setting out of its range.
    #[error("runtime setting `{field}` = {value}: {message}")]
    Setting {
        /// The setting's name, as the CLI flag spells it.
        field: String,
        /// The value given.
        value: String,
        /// What was expected.
        message: String,
    },
    /// The graph is malformed: a node's operands do not fit its op.
    #[error("graph node `{node}` ({op}): {message}")]
    Graph {
        /// The node's name.
        node: String,
        /// The node's op.
        op: String,
        /// The mismatch.
        message: String,
    },
    /// The interpreter was given inputs that do not fit the graph.
    #[error("evaluation: {0}")]
    Eval(String),
}

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`Error::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            message: message.into(),
        }
    }

    /// An [`Error::Config`] for `file` and `field`.
    pub fn config(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Config {
            file: file.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}
