//! The kernel graph: the program between selection and emission. Nodes are kernel calls in
//! execution order over values; passes fuse nodes and plan memory, and [`KGraph::validate`]
//! checks it after every pass.

use crate::error::{LowerError, Result};
use maxc_schema::{DType, Extent, KernelBody, KvLayout, RopeTable};
use std::collections::BTreeMap;

/// Index of a value.
pub type ValueId = usize;

/// Where a value lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// An intermediate, planned into the arena.
    Temp,
    /// A weight, by its artifact key.
    Param(String),
    /// A per-step input.
    Input,
    /// The paged KV cache.
    KvCache,
    /// A view of the KV cache starting at one layer's slot (kernels address it as layer 0).
    KvCacheLayer(u64),
    /// A rotary table.
    RopeTable(u32),
}

/// A value of the kernel graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KValue {
    /// The graph node (input, weight) it holds.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<Extent>,
    /// Where it lives.
    pub kind: ValueKind,
}

/// A kernel call: `inputs` then `outputs` are its buffers in argument order.
#[derive(Clone, Debug, PartialEq)]
pub struct KNode {
    /// What it computes.
    pub body: KernelBody,
    /// Values read (and, for the KV cache, written in place).
    pub inputs: Vec<ValueId>,
    /// Values written.
    pub outputs: Vec<ValueId>,
    /// The graph nodes it implements.
    pub nodes: Vec<String>,
}

/// A role's kernel graph.
#[derive(Clone, Debug, Default)]
pub struct KGraph {
    /// The role.
    pub role: String,
    /// Every value; ids are indices.
    pub values: Vec<KValue>,
    /// Kernel calls in execution order.
    pub nodes: Vec<KNode>,
    /// Per-step inputs by name.
    pub inputs: BTreeMap<String, ValueId>,
    /// Outputs by name.
    pub outputs: BTreeMap<String, ValueId>,
    /// The KV cache layout.
    pub kv: Option<KvLayout>,
    /// Rotary tables.
    pub rope_tables: Vec<RopeTable>,
    /// Vocabulary size.
    pub vocab_size: u64,
}

impl KGraph {
    /// Adds a value.
    pub fn value(&mut self, v: KValue) -> ValueId {
        self.values.push(v);
        self.values.len() - 1
    }

    /// The nodes reading each value, by node index.
    pub fn consumers(&self) -> BTreeMap<ValueId, Vec<usize>> {
        let mut c: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for &v in &n.inputs {
                c.entry(v).or_default().push(i);
            }
        }
        c
    }

    /// The node writing each value.
    pub fn producers(&self) -> BTreeMap<ValueId, usize> {
        let mut p = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for &v in &n.outputs {
                p.insert(v, i);
            }
        }
        p
    }

    /// Whether `v` is a graph output.
    pub fn is_output(&self, v: ValueId) -> bool {
        self.outputs.values().any(|&o| o == v)
    }

    /// Checks that every value read is available (a non-temp value, or written by an earlier
    /// node), every temp is written once, every node has its kernel's buffer count, and every
    /// output is written. `pass` names the pass in the error.
    pub fn validate(&self, pass: &str) -> Result<()> {
        let fail = |message: String| {
            Err(LowerError::Invalid {
                pass: pass.into(),
                message,
            })
        };
        let mut written = vec![false; self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            let (ins, outs) = arity(&n.body);
            if n.inputs.len() != ins || n.outputs.len() != outs {
                return fail(format!(
                    "node {i} ({}) has {}+{} buffers, its kernel takes {ins}+{outs}",
                    n.body.kind(),
                    n.inputs.len(),
                    n.outputs.len()
                ));
            }
            for &v in &n.inputs {
                let val = self.values.get(v).map(|x| &x.kind);
                if val == Some(&ValueKind::Temp) && !written[v] {
                    return fail(format!(
                        "node {i} ({}) reads `{}` before it is written",
                        n.body.kind(),
                        self.values[v].name
                    ));
                }
                if val.is_none() {
                    return fail(format!("node {i} reads value {v}, which does not exist"));
                }
            }
            for &v in &n.outputs {
                if self.values[v].kind != ValueKind::Temp {
                    return fail(format!(
                        "node {i} writes `{}`, which is not an intermediate",
                        self.values[v].name
                    ));
                }
                if std::mem::replace(&mut written[v], true) {
                    return fail(format!("`{}` is written twice", self.values[v].name));
                }
            }
        }
        for (name, &v) in &self.outputs {
            if !written[v] {
                return fail(format!("output `{name}` is never written"));
            }
        }
        Ok(())
    }
}

/// Inputs and outputs a kernel takes.
pub fn arity(body: &KernelBody) -> (usize, usize) {
    match body {
        KernelBody::Gather { .. } | KernelBody::Positions => (2, 1),
        KernelBody::RmsNorm {
            residual: false, ..
        } => (2, 1),
        KernelBody::RmsNorm { residual: true, .. } => (3, 2),
        KernelBody::Elementwise { inputs, .. } => (inputs.len(), 1),
        KernelBody::Rope { .. } => (3, 1),
        KernelBody::KvStore { planes, .. } => (4 + (*planes).min(2) as usize, 0),
        KernelBody::Attention { .. } => (5, 1),
        KernelBody::Softmax { .. } | KernelBody::TopK { .. } => (1, 1),
        KernelBody::Matmul { bias, .. } => (2 + usize::from(*bias), 1),
        KernelBody::MoeExperts { experts, .. } => (2 + 3 * *experts as usize, 1),
        KernelBody::Zeros { .. } => (0, 1),
        KernelBody::RankExperts { .. }
        | KernelBody::AllReduce { .. }
        | KernelBody::AllGather { .. } => (1, 1),
        KernelBody::Concat { .. }
        | KernelBody::HeadMatmul { .. }
        | KernelBody::MoeRouter { .. } => (2, 1),
        KernelBody::DecompressedAttention { .. } => (9, 1),
    }
}
