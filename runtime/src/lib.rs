//! maxc's runtime: the artifact reader and its validation, the CPU and CUDA executors, the
//! expert-parallel exchange, the communicators of parallel ranks, and the engine that runs steps of one role on them, with
//! sampling. It holds no compiler (artifacts are compiled ahead of time by `maxc compile`)
//! and no HTTP, metrics or scheduler (the `maxc-serve` crate, above it). The contract with
//! the compiler is the schema crate, re-exported as [`schema`]; the KV cache's bookkeeping is
//! the `maxc-kv` crate, re-exported as [`kv`].

pub mod artifact;
pub mod bench;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod diff;
pub mod dump;
pub mod engine;
pub mod error;
pub mod hugemem;
pub mod logits;
pub mod profile;
pub mod sampling;
pub mod session;
pub mod signature;

pub use artifact::Artifact;
pub use engine::{Engine, RoleInfo, StepExecutor, StepWalk};
pub use error::{Result, RuntimeError};
pub use logits::Logits;
pub use maxc_kernels as kernels;
pub use maxc_kv as kv;
pub use maxc_kv::PageTable;
pub use maxc_schema as schema;
pub use maxc_schema::StepInputs;
pub use session::Session;
