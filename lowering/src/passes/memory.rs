//! The memory plan: every intermediate gets an offset in one arena sized at the dims' bounds.

use crate::error::{LowerError, Result};
use crate::kgraph::{KGraph, ValueKind};
use maxc_schema::{Extent, StepDim};
use std::collections::BTreeMap;

/// Alignment of every arena offset, in bytes.
pub const ALIGN: u64 = 64;

/// Offsets of the intermediates and the arena size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Byte offset of each temp value.
    pub offsets: BTreeMap<usize, u64>,
    /// Arena bytes at the bounds.
    pub arena_bytes: u64,
}

/// Bytes of a value at the bounds.
pub fn bytes_at_bounds(
    shape: &[Extent],
    elem: usize,
    bounds: &BTreeMap<StepDim, u64>,
) -> Result<u64> {
    let mut n = elem as u64;
    for e in shape {
        n *= match e {
            Extent::Fixed(x) => *x,
            Extent::Step(d) => *bounds
                .get(d)
                .ok_or_else(|| LowerError::Unbounded(d.name().into()))?,
        };
    }
    Ok(n)
}

/// Guarantee: two intermediates whose lifetimes (from the kernel that writes them to the last
/// kernel that reads them, outputs to the end) overlap never share bytes; each offset is aligned
/// to [`ALIGN`]. First fit in order of definition, so the plan is deterministic.
pub fn plan_memory(g: &KGraph, bounds: &BTreeMap<StepDim, u64>) -> Result<MemoryPlan> {
    let end = g.nodes.len();
    let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for &v in &n.outputs {
            live.insert(v, (i, i));
        }
        for &v in &n.inputs {
            if let Some(l) = live.get_mut(&v) {
                l.1 = i;
            }
        }
    }
    for &v in g.outputs.values() {
        if let Some(l) = live.get_mut(&v) {
            l.1 = end;
        }
    }
    let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new(); // offset, size, start, end
    let mut plan = MemoryPlan::default();
    let mut order: Vec<(usize, (usize, usize))> = live.into_iter().collect();
    order.sort_by_key(|&(v, (s, _))| (s, v));
    for (v, (s, e)) in order {
        debug_assert_eq!(g.values[v].kind, ValueKind::Temp);
        let size = bytes_at_bounds(&g.values[v].shape, g.values[v].dtype.size(), bounds)?
            .div_ceil(ALIGN)
            * ALIGN;
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|p| p.2 <= e && s <= p.3)
            .map(|p| (p.0, p.0 + p.1))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (b0, b1) in busy {
            if offset + size <= b0 {
                break;
            }
            offset = offset.max(b1);
        }
        placed.push((offset, size, s, e));
        plan.offsets.insert(v, offset);
        plan.arena_bytes = plan.arena_bytes.max(offset + size);
    }
    Ok(plan)
}
