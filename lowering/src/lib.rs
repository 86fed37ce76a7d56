//! maxc's lowering: from a role's graph to a [`maxc_schema::Program`]: kernel selection,
//! named fusion passes, the memory plan, and the backends that turn the kernel IR into code.

pub mod cpu;
pub mod cuda;
pub mod error;
pub mod kgraph;
pub mod passes;
pub mod program;
pub mod select;

pub use error::{LowerError, Result};
pub use program::{lower_graph, LowerOptions, Lowered};
