//! maxc's runtime: the artifact schema, its reader and validation, the paged KV cache's
//! bookkeeping and the executors. It holds no compiler: artifacts are compiled ahead of time by
//! `maxc compile`.

pub mod artifact;
pub mod chat;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod kv;
pub mod sampling;
pub mod schema;
pub mod step;
pub mod tokenizer;

pub use artifact::Artifact;
pub use engine::Engine;
pub use error::{Result, RuntimeError};
pub use step::{Logits, StepInputs};
