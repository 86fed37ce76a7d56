//! Lowering passes over the kernel graph. Each pass is a small struct with one guarantee; each of
//! its runs is one rewrite, the kernel graph is validated after every rewrite, and an error
//! names the pass. The runner counts the rewrites and can stop after the first N of them (as
//! tract's `stopping_at` does), so that a wrong lowering can be bisected to one rewrite.

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
    /// Makes at most one rewrite; returns whether it made one.
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

/// What [`run_passes`] did: the rewrites of each pass, in pipeline order, and whether it stopped
/// early at the limit it was given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// `(pass name, rewrites it made)`, one entry per pass that ran.
    pub rewrites: Vec<(&'static str, usize)>,
    /// The limit was reached (a pass might have rewritten more).
    pub stopped: bool,
}

impl PassReport {
    /// All rewrites made.
    pub fn total(&self) -> usize {
        self.rewrites.iter().map(|(_, n)| n).sum()
    }
}

/// Runs each pass until it changes nothing, validating after every rewrite; with
/// `stop_after: Some(n)`, makes no more than `n` rewrites in all (`Some(0)` lowers the graph as
/// kernel selection left it).
pub fn run_passes(
    g: &mut KGraph,
    passes: &[Box<dyn Pass>],
    stop_after: Option<usize>,
) -> Result<PassReport> {
    let mut report = PassReport::default();
    let mut left = stop_after.unwrap_or(usize::MAX);
    for pass in passes {
        let mut made = 0;
        while left > 0 && pass.run(g)? {
            g.validate(pass.name())?;
            made += 1;
            left -= 1;
        }
        g.validate(pass.name())?;
        tracing::debug!(
            pass = pass.name(),
            rewrites = made,
            nodes = g.nodes.len(),
            "pass done"
        );
        report.rewrites.push((pass.name(), made));
        if left == 0 && stop_after.is_some() {
            report.stopped = true;
            break;
        }
    }
    Ok(report)
}
