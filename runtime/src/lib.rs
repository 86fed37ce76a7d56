//! maxc's runtime: the artifact reader and its validation, the executors and the engine that
//! runs sequences on them. It holds no compiler: artifacts are compiled ahead of time by
//! `maxc compile`. The contract with the compiler is the schema crate, re-exported as
//! [`schema`].

pub mod artifact;
pub mod bench;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod diff;
pub mod dump;
pub mod engine;
pub mod error;
pub mod hugemem;
pub mod logits;
pub mod metrics;
pub mod profile;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod signature;
pub mod tokenizer;
pub mod trace;

pub use artifact::Artifact;
pub use engine::Engine;
pub use error::{Result, RuntimeError};
pub use logits::Logits;
pub use maxc_schema as schema;
pub use maxc_schema::{PageTable, StepInputs};
