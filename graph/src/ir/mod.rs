//! The graph IR: a petgraph DAG of single-output [`Op`] nodes with typed, symbolically shaped
//! values. Edges carry the operand slot they feed, so operand order survives any pass.

mod dim;
mod op;

pub use dim::{names, same_volume, shape_string, Dim, Shape};
pub use op::{GroupScore, KvGroup, KvLayout, KvSlot, Op, RouterScoring, TensorType};
pub use petgraph::graph::NodeIndex;

use crate::{Error, GraphRole, Result};
use petgraph::graph::DiGraph;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A node: a named op and the type of its value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Unique within the graph: the input name, the weight key, or a path like
    /// `model.layers.0.self_attn.q_proj`.
    pub name: String,
    /// What the node computes.
    pub op: Op,
    /// The type of its value.
    pub ty: TensorType,
}

/// One role's graph: nodes, the graph inputs in order, and the named outputs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Graph {
    /// The role this graph serves.
    pub role: GraphRole,
    dag: DiGraph<Node, usize>,
    inputs: Vec<NodeIndex>,
    outputs: Vec<(String, NodeIndex)>,
}

impl Graph {
    /// An empty graph for `role`.
    pub fn new(role: GraphRole) -> Self {
        Graph {
            role,
            dag: DiGraph::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
        }
    }

    /// The node at `id`.
    pub fn node(&self, id: NodeIndex) -> &Node {
        &self.dag[id]
    }

    /// Every node id, in insertion order (a topological order: operands come first).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        self.dag.node_indices()
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.dag.node_count()
    }

    /// True when the graph has no node.
    pub fn is_empty(&self) -> bool {
        self.dag.node_count() == 0
    }

    /// The operands of `id`, in slot order.
    pub fn operands(&self, id: NodeIndex) -> Vec<NodeIndex> {
        let mut edges: Vec<(usize, NodeIndex)> = self
            .dag
            .edges_directed(id, Direction::Incoming)
            .map(|e| (*e.weight(), e.source()))
            .collect();
        edges.sort_unstable();
        edges.into_iter().map(|(_, n)| n).collect()
    }

    /// Graph inputs (per-step inputs and the KV cache), in declaration order.
    pub fn inputs(&self) -> &[NodeIndex] {
        &self.inputs
    }

    /// Named outputs, in declaration order.
    pub fn outputs(&self) -> &[(String, NodeIndex)] {
        &self.outputs
    }

    /// The node named `name`.
    pub fn find(&self, name: &str) -> Option<NodeIndex> {
        self.dag.node_indices().find(|&n| self.dag[n].name == name)
    }

    /// Weight parameters: key -> type, sorted by key.
    pub fn params(&self) -> BTreeMap<String, TensorType> {
        self.dag
            .node_indices()
            .filter(|&n| self.dag[n].op == Op::Param)
            .map(|n| (self.dag[n].name.clone(), self.dag[n].ty.clone()))
            .collect()
    }

    /// The parameters that may hold a GGUF block type: those used only as a [`Op::Linear`]
    /// weight or an [`Op::Embedding`] table, whose kernels read blocks.
    pub fn block_params(&self) -> BTreeSet<String> {
        self.dag
            .node_indices()
            .filter(|&n| self.dag[n].op == Op::Param)
            .filter(|&n| {
                self.dag.edges_directed(n, Direction::Outgoing).all(|e| {
                    matches!(
                        (&self.dag[e.target()].op, *e.weight()),
                        (Op::Linear, 1) | (Op::Embedding { .. }, 0)
                    )
                })
            })
            .map(|n| self.dag[n].name.clone())
            .collect()
    }

    /// Sets parameter `key`'s dtype (the weight bound to it decides), then checks the graph.
    pub fn set_param_dtype(&mut self, key: &str, dtype: crate::DType) -> Result<()> {
        let n = self
            .dag
            .node_indices()
            .find(|&n| self.dag[n].op == Op::Param && self.dag[n].name == key)
            .ok_or_else(|| Error::Graph {
                node: key.into(),
                op: "param".into(),
                message: "no such parameter".into(),
            })?;
        self.dag[n].ty.dtype = dtype;
        Ok(())
    }

    /// How many nodes of each op, by op name (leaves excluded).
    pub fn op_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for n in self.dag.node_indices() {
            let op = &self.dag[n].op;
            if !op.is_leaf() {
                *counts.entry(op.name()).or_insert(0) += 1;
            }
        }
        counts
    }

    /// Every symbolic dim named in the graph's inputs and outputs (the per-step sizes its
    /// buffers are planned at), sorted.
    pub fn step_dims(&self) -> BTreeSet<String> {
        self.inputs
            .iter()
            .chain(self.outputs.iter().map(|(_, n)| n))
            .flat_map(|&n| self.dag[n].ty.shape.iter())
            .filter_map(|d| match d {
                Dim::Sym(s) => Some(s.clone()),
                Dim::Fixed(_) => None,
            })
            .collect()
    }

    /// The KV cache layout, where the graph has a cache.
    pub fn kv_layout(&self) -> Option<&KvLayout> {
        self.dag.node_indices().find_map(|n| match &self.dag[n].op {
            Op::KvCache(l) => Some(l),
            _ => None,
        })
    }

    /// Checks the whole graph: unique names, operand slots 0..n, operand types that fit each op
    /// (re-inferred and compared with the stored type), inputs and outputs that exist, no cycle.
    /// The error names the node and the mismatch.
    pub fn validate(&self) -> Result<()> {
        let mut names = BTreeSet::new();
        for id in self.dag.node_indices() {
            let node = &self.dag[id];
            let fail = |message: String| Error::Graph {
                node: node.name.clone(),
                op: node.op.name().into(),
                message,
            };
            if !names.insert(node.name.as_str()) {
                return Err(fail("another node has this name".into()));
            }
            let mut slots: Vec<usize> = self
                .dag
                .edges_directed(id, Direction::Incoming)
                .map(|e| *e.weight())
                .collect();
            slots.sort_unstable();
            if slots.iter().enumerate().any(|(i, &s)| i != s) {
                return Err(fail(format!(
                    "operand slots {slots:?} are not 0..{}",
                    slots.len()
                )));
            }
            let operands = self.operands(id);
            if node.op.is_leaf() {
                if !operands.is_empty() {
                    return Err(fail("a leaf has operands".into()));
                }
                if let Op::KvCache(layout) = &node.op {
                    if node.ty != layout.tensor_type() {
                        return Err(fail(format!("type {} differs from its layout's", node.ty)));
                    }
                }
                continue;
            }
            if let Some(&late) = operands.iter().find(|&&o| o >= id) {
                return Err(fail(format!(
                    "operand `{}` comes after the node (a cycle?)",
                    self.dag[late].name
                )));
            }
            let tys: Vec<&TensorType> = operands.iter().map(|&o| &self.dag[o].ty).collect();
            let inferred = node.op.infer(&tys).map_err(fail)?;
            if inferred != node.ty {
                return Err(fail(format!(
                    "stored type {} differs from inferred type {inferred}",
                    node.ty
                )));
            }
        }
        for &i in &self.inputs {
            if !matches!(self.dag[i].op, Op::Input | Op::KvCache(_)) {
                return Err(Error::Graph {
                    node: self.dag[i].name.clone(),
                    op: self.dag[i].op.name().into(),
                    message: "listed as a graph input but is not an input".into(),
                });
            }
        }
        if self.outputs.is_empty() {
            return Err(Error::Graph {
                node: "<graph>".into(),
                op: "-".into(),
                message: "no outputs".into(),
            });
        }
        Ok(())
    }
}

/// Builds a [`Graph`] node by node; every op node's type is inferred (and checked) as it is added.
#[derive(Debug)]
pub struct GraphBuilder {
    graph: Graph,
    names: BTreeSet<String>,
}

impl GraphBuilder {
    /// A builder for `role`'s graph.
    pub fn new(role: GraphRole) -> Self {
        GraphBuilder {
            graph: Graph::new(role),
            names: BTreeSet::new(),
        }
    }

    fn push(&mut self, node: Node) -> Result<NodeIndex> {
        if !self.names.insert(node.name.clone()) {
            return Err(Error::Graph {
                node: node.name.clone(),
                op: node.op.name().into(),
                message: "another node has this name".into(),
            });
        }
        Ok(self.graph.dag.add_node(node))
    }

    /// A per-step graph input.
    pub fn input(&mut self, name: &str, ty: TensorType) -> Result<NodeIndex> {
        let id = self.push(Node {
            name: name.into(),
            op: Op::Input,
            ty,
        })?;
        self.graph.inputs.push(id);
        Ok(id)
    }

    /// The paged KV cache input.
    pub fn kv_cache(&mut self, layout: KvLayout) -> Result<NodeIndex> {
        let ty = layout.tensor_type();
        let id = self.push(Node {
            name: "kv_cache".into(),
            op: Op::KvCache(layout),
            ty,
        })?;
        self.graph.inputs.push(id);
        Ok(id)
    }

    /// A weight parameter under `key`.
    pub fn param(&mut self, key: &str, ty: TensorType) -> Result<NodeIndex> {
        self.push(Node {
            name: key.into(),
            op: Op::Param,
            ty,
        })
    }

    /// An op node over `operands`, its type inferred.
    pub fn op(&mut self, name: &str, op: Op, operands: &[NodeIndex]) -> Result<NodeIndex> {
        let tys: Vec<&TensorType> = operands.iter().map(|&o| &self.graph.dag[o].ty).collect();
        let ty = op.infer(&tys).map_err(|message| Error::Graph {
            node: name.into(),
            op: op.name().into(),
            message,
        })?;
        let id = self.push(Node {
            name: name.into(),
            op,
            ty,
        })?;
        for (slot, &o) in operands.iter().enumerate() {
            self.graph.dag.add_edge(o, id, slot);
        }
        Ok(id)
    }

    /// The type of `id`'s value.
    pub fn ty(&self, id: NodeIndex) -> &TensorType {
        &self.graph.dag[id].ty
    }

    /// Declares `id` an output named `name`.
    pub fn output(&mut self, name: &str, id: NodeIndex) {
        self.graph.outputs.push((name.into(), id));
    }

    /// The finished graph, validated.
    pub fn finish(self) -> Result<Graph> {
        self.graph.validate()?;
        Ok(self.graph)
    }
}
