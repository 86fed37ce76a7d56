//! Lowering passes over the kernel graph. Each pass is a small struct with one guarantee; the
//! kernel graph is validated after every pass, and an error names the pass.

mod fuse;
mod memory;

pub use fuse::{FuseElementwise, FuseMatmulBias, FuseResidualRmsNorm};
pub use memory::{bytes_at_bounds, plan_memory, MemoryPlan, ALIGN};

use crate::error::Result;
use crate::kgraph::KGraph;

/// A transformation of the kernel graph.
pub trait Pass {
    /// The pass's name, for errors and logs.
    fn name(&self) -> &'static str;
    /// Runs once; returns whether anything changed.
    fn run(&self, g: &mut KGraph) -> Result<bool>;
}

/// The fusion pipeline, in order.
pub fn default_passes() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(FuseMatmulBias),
        Box::new(FuseElementwise),
        Box::new(FuseResidualRmsNorm),
    ]
}

/// Runs each pass until it changes nothing, validating after every run.
pub fn run_passes(g: &mut KGraph, passes: &[Box<dyn Pass>]) -> Result<()> {
    for pass in passes {
        while pass.run(g)? {
            g.validate(pass.name())?;
        }
        g.validate(pass.name())?;
        tracing::debug!(pass = pass.name(), nodes = g.nodes.len(), "pass done");
    }
    Ok(())
}
