//! maxc's graph layer: from a Hugging Face style checkpoint to one graph per role.
//!
//! - [`registry`]: the architectures maxc knows, by their `architectures` name.
//! - [`deployment`]: per-architecture deployment hooks ([`DeploymentConfig`]) and [`GraphRole`].
//! - [`weights`]: the weight pipeline (safetensors, role prefixes, dtype conversion, binding).
//! - [`ir`]: the graph IR on petgraph, with symbolic dims and shape inference.
//! - [`bounds`]: [`BatchProcessorRuntime`], KV cache parameters and `max_dims`.
//! - [`interp`]: the reference interpreter, the numerical oracle of every backend.
//! - [`pipeline`]: the steps above in DESIGN.md's order, as one call.

pub mod arch;
pub mod bounds;
pub mod deployment;
pub mod error;
pub mod interp;
pub mod ir;
pub mod pipeline;
pub mod registry;
pub mod tokenizer;
pub mod weights;

pub use bounds::{BatchProcessorRuntime, KvCacheParams, MlaAttention, ModuleRuntime};
pub use deployment::{DeploymentConfig, GraphRole};
pub use error::{Error, Result};
pub use ir::{Dim, Graph, Op};
pub use maxc_schema::DType;
pub use registry::Registry;
