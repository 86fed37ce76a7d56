//! The reference interpreter: a plain f32 evaluator of the graph IR, the numerical oracle that
//! every lowered backend is tested against. It runs one step of a ragged batch (prefill chunks
//! and decode rows together) over a paged KV cache.

pub mod kernels;
mod session;

pub use session::Session;

use crate::ir::{Dim, KvLayout, Op};
use crate::weights::StateDict;
use crate::{Error, Graph, Result};
use kernels::PagedBatch;
use petgraph::graph::NodeIndex;
use std::collections::BTreeMap;

/// A dense f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Tensor {
    /// Row `i` of a 2-D tensor.
    pub fn row(&self, i: usize) -> &[f32] {
        let n = self.shape.last().copied().unwrap_or(1);
        &self.data[i * n..(i + 1) * n]
    }
}

/// One step's inputs: a ragged batch of token rows with their paged-cache bookkeeping.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepInputs {
    /// The token rows of every sequence, concatenated.
    pub tokens: Vec<i64>,
    /// Where each sequence's rows start, plus the end: `B + 1` non-decreasing offsets from 0.
    pub input_row_offsets: Vec<u32>,
    /// Tokens already in the cache, per sequence.
    pub cache_lengths: Vec<u32>,
    /// `[B, pages_per_seq]`: the cache page holding each sequence's tokens `p * page_size ..`.
    pub kv_lookup_table: Vec<u32>,
    /// Columns of `kv_lookup_table` (`max_num_pages`).
    pub pages_per_seq: usize,
}

/// A role's paged KV cache for the interpreter.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Its layout.
    pub layout: KvLayout,
    /// Pages.
    pub num_pages: usize,
    /// `[num_pages, layers, 2, page_size, kv_heads, head_dim]`.
    pub data: Vec<f32>,
}

enum Val {
    F(Vec<f32>),
    I(Vec<i64>),
}

impl Val {
    fn f(&self) -> &[f32] {
        match self {
            Val::F(v) => v,
            Val::I(_) => unreachable!("validated graph: float operand"),
        }
    }
    fn i(&self) -> &[i64] {
        match self {
            Val::I(v) => v,
            Val::F(_) => unreachable!("validated graph: integer operand"),
        }
    }
}

/// A graph with its weights as f32, ready to run steps.
pub struct Interpreter {
    graph: Graph,
    params: BTreeMap<NodeIndex, Vec<f32>>,
    vocab_size: usize,
    kv_layout: KvLayout,
}

impl Interpreter {
    /// Prepares `graph` with `weights` (keys are the graph's parameter names).
    pub fn new(graph: Graph, weights: &StateDict) -> Result<Self> {
        graph.validate()?;
        let mut params = BTreeMap::new();
        let mut vocab_size = 0;
        for id in graph.node_ids() {
            let node = graph.node(id);
            match &node.op {
                Op::Param => {
                    let w = weights.get(&node.name).ok_or_else(|| {
                        Error::Eval(format!("no weight for parameter `{}`", node.name))
                    })?;
                    params.insert(id, w.to_f32(&node.name)?);
                }
                Op::Embedding => {
                    let table = graph.operands(id)[0];
                    vocab_size = graph.node(table).ty.shape[0].fixed().unwrap_or(0);
                }
                _ => {}
            }
        }
        let kv_layout = graph
            .kv_layout()
            .cloned()
            .ok_or_else(|| Error::Eval("the graph has no KV cache".into()))?;
        Ok(Interpreter {
            graph,
            params,
            vocab_size,
            kv_layout,
        })
    }

    /// The graph being run.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The vocabulary size (rows of the token embedding).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A zeroed KV cache of `num_pages` pages.
    pub fn new_kv_cache(&self, num_pages: usize) -> KvCache {
        KvCache {
            layout: self.kv_layout.clone(),
            num_pages,
            data: vec![0.0; num_pages * self.kv_layout.page_elems()],
        }
    }

    fn check(&self, s: &StepInputs, cache: &KvCache) -> Result<()> {
        let bad = |m: String| Err(Error::Eval(m));
        let b = s.cache_lengths.len();
        if s.input_row_offsets.len() != b + 1 {
            return bad(format!(
                "input_row_offsets has {} entries, expected batch size + 1 = {}",
                s.input_row_offsets.len(),
                b + 1
            ));
        }
        if s.input_row_offsets[0] != 0 || s.input_row_offsets.windows(2).any(|w| w[0] > w[1]) {
            return bad(format!(
                "input_row_offsets {:?} must start at 0 and never decrease",
                s.input_row_offsets
            ));
        }
        if s.input_row_offsets[b] as usize != s.tokens.len() {
            return bad(format!(
                "input_row_offsets ends at {}, but there are {} tokens",
                s.input_row_offsets[b],
                s.tokens.len()
            ));
        }
        if s.kv_lookup_table.len() != b * s.pages_per_seq {
            return bad(format!(
                "kv_lookup_table has {} entries, expected {b} × {}",
                s.kv_lookup_table.len(),
                s.pages_per_seq
            ));
        }
        if let Some(t) = s
            .tokens
            .iter()
            .find(|&&t| t < 0 || t as usize >= self.vocab_size)
        {
            return bad(format!(
                "token id {t} is outside the vocabulary (0..{})",
                self.vocab_size
            ));
        }
        let page = self.kv_layout.page_size;
        for i in 0..b {
            let end = s.cache_lengths[i] as usize
                + (s.input_row_offsets[i + 1] - s.input_row_offsets[i]) as usize;
            if end > s.pages_per_seq * page {
                return bad(format!(
                    "sequence {i} reaches {end} tokens, beyond its {} pages of {page}",
                    s.pages_per_seq
                ));
            }
            let used = end.div_ceil(page);
            if let Some(p) = s.kv_lookup_table[i * s.pages_per_seq..][..used]
                .iter()
                .find(|&&p| p as usize >= cache.num_pages)
            {
                return bad(format!(
                    "sequence {i} uses page {p}, but the cache has {} pages",
                    cache.num_pages
                ));
            }
        }
        if cache.layout != self.kv_layout {
            return bad("the KV cache's layout differs from the graph's".into());
        }
        Ok(())
    }

    /// Runs one step: writes the step's keys and values into `cache` and returns the graph's
    /// `logits` output.
    pub fn step(&self, s: &StepInputs, cache: &mut KvCache) -> Result<Tensor> {
        self.check(s, cache)?;
        let g = &self.graph;
        let b = s.cache_lengths.len();
        let dims = BTreeMap::from([
            ("total_seq_len".to_string(), s.tokens.len()),
            ("batch_size".to_string(), b),
            ("input_row_offsets_len".to_string(), b + 1),
            ("max_num_pages".to_string(), s.pages_per_seq),
            ("total_num_pages".to_string(), cache.num_pages),
        ]);
        let widen = |v: &[u32]| v.iter().map(|&x| x as i64).collect::<Vec<i64>>();
        let (offs, lens, lut) = (
            widen(&s.input_row_offsets),
            widen(&s.cache_lengths),
            widen(&s.kv_lookup_table),
        );
        let batch = PagedBatch {
            row_offsets: &offs,
            cache_lengths: &lens,
            lookup: &lut,
            pages_per_seq: s.pages_per_seq,
        };

        // Values die after their last use.
        let mut uses: BTreeMap<NodeIndex, usize> = BTreeMap::new();
        for id in g.node_ids() {
            for o in g.operands(id) {
                *uses.entry(o).or_insert(0) += 1;
            }
        }
        for (_, id) in g.outputs() {
            *uses.entry(*id).or_insert(0) += 1;
        }
        let mut vals: BTreeMap<NodeIndex, Val> = BTreeMap::new();
        for id in g.node_ids() {
            let node = g.node(id);
            let ops = g.operands(id);
            let shape: Vec<usize> = node
                .ty
                .shape
                .iter()
                .map(|d| {
                    d.resolve(&dims).ok_or_else(|| {
                        Error::Eval(format!("dim `{d}` of `{}` is unbound", node.name))
                    })
                })
                .collect::<Result<_>>()?;
            let last = |i: usize| {
                g.node(ops[i])
                    .ty
                    .shape
                    .last()
                    .and_then(Dim::fixed)
                    .unwrap_or(1)
            };
            let v = |i: usize| &vals[&ops[i]];
            let out = match &node.op {
                Op::Input => Val::I(match node.name.as_str() {
                    "tokens" => s.tokens.clone(),
                    "input_row_offsets" => offs.clone(),
                    "cache_lengths" => lens.clone(),
                    "kv_lookup_table" => lut.clone(),
                    "batch_context_lengths" => {
                        (0..b).map(|i| lens[i] + offs[i + 1] - offs[i]).collect()
                    }
                    other => {
                        return Err(Error::Eval(format!("no value for graph input `{other}`")))
                    }
                }),
                Op::KvCache(_) => continue,
                Op::Param => continue,
                Op::Embedding => {
                    let h = shape[1];
                    let table = self
                        .params
                        .get(&ops[0])
                        .map(Vec::as_slice)
                        .unwrap_or_else(|| v(0).f());
                    Val::F(
                        v(1).i()
                            .iter()
                            .flat_map(|&t| table[t as usize * h..][..h].iter().copied())
                            .collect(),
                    )
                }
                Op::Linear => Val::F(kernels::linear(
                    self.f(&vals, ops[0]),
                    self.f(&vals, ops[1]),
                    last(0),
                )),
                Op::Add => Val::F(kernels::broadcast(
                    self.f(&vals, ops[0]),
                    self.f(&vals, ops[1]),
                    |a, b| a + b,
                )),
                Op::Mul => Val::F(kernels::broadcast(
                    self.f(&vals, ops[0]),
                    self.f(&vals, ops[1]),
                    |a, b| a * b,
                )),
                Op::Silu => Val::F(v(0).f().iter().map(|&x| kernels::silu(x)).collect()),
                Op::RmsNorm { eps } => Val::F(kernels::rms_norm(
                    self.f(&vals, ops[0]),
                    self.f(&vals, ops[1]),
                    *eps,
                )),
                Op::Reshape { .. } => match v(0) {
                    Val::F(x) => Val::F(x.clone()),
                    Val::I(x) => Val::I(x.clone()),
                },
                Op::Positions => Val::I(batch.rows().map(|(_, _, pos)| pos as i64).collect()),
                Op::Rope { inv_freq } => {
                    Val::F(kernels::rope(v(0).f(), v(1).i(), shape[1], inv_freq))
                }
                Op::PagedAttention { layer, scale } => Val::F(kernels::paged_attention(
                    v(0).f(),
                    v(1).f(),
                    v(2).f(),
                    &mut cache.data,
                    shape[1],
                    &self.kv_layout,
                    *layer,
                    *scale,
                    &batch,
                )),
                Op::Softmax => Val::F(kernels::softmax(v(0).f(), last(0))),
                Op::TopK { k, renormalize } => {
                    Val::F(kernels::top_k(v(0).f(), last(0), *k, *renormalize))
                }
                Op::MoeExperts { num_experts } => {
                    let x = v(0).f();
                    let routing = v(1).f();
                    let h = last(0);
                    let mut out = vec![0.0; x.len()];
                    for e in 0..*num_experts {
                        let (gate, up, down) = (
                            self.f(&vals, ops[2 + 3 * e]),
                            self.f(&vals, ops[3 + 3 * e]),
                            self.f(&vals, ops[4 + 3 * e]),
                        );
                        for (t, row) in x.chunks_exact(h).enumerate() {
                            let weight = routing[t * num_experts + e];
                            if weight == 0.0 {
                                continue;
                            }
                            let g = kernels::linear(row, gate, h);
                            let u = kernels::linear(row, up, h);
                            let act: Vec<f32> = g
                                .iter()
                                .zip(&u)
                                .map(|(&g, &u)| kernels::silu(g) * u)
                                .collect();
                            let y = kernels::linear(&act, down, act.len());
                            for (o, y) in out[t * h..][..h].iter_mut().zip(y) {
                                *o += weight * y;
                            }
                        }
                    }
                    Val::F(out)
                }
                Op::LastTokens => {
                    let h = last(0);
                    let x = v(0).f();
                    Val::F(
                        (0..b)
                            .flat_map(|i| {
                                let end = offs[i + 1] as usize;
                                if end == offs[i] as usize {
                                    vec![0.0; h]
                                } else {
                                    x[(end - 1) * h..end * h].to_vec()
                                }
                            })
                            .collect(),
                    )
                }
            };
            for o in &ops {
                if let Some(n) = uses.get_mut(o) {
                    *n -= 1;
                    if *n == 0 {
                        vals.remove(o);
                    }
                }
            }
            vals.insert(id, out);
        }
        let (_, out_id) = g
            .outputs()
            .iter()
            .find(|(n, _)| n == "logits")
            .ok_or_else(|| Error::Eval("no `logits` output".into()))?;
        let shape = g
            .node(*out_id)
            .ty
            .shape
            .iter()
            .map(|d| d.resolve(&dims).unwrap_or(0))
            .collect();
        match vals.remove(out_id) {
            Some(Val::F(data)) => Ok(Tensor { shape, data }),
            _ => Err(Error::Eval("`logits` was not computed".into())),
        }
    }

    /// A float operand: a parameter's weights or a computed value.
    fn f<'a>(&'a self, vals: &'a BTreeMap<NodeIndex, Val>, id: NodeIndex) -> &'a [f32] {
        match self.params.get(&id) {
            Some(p) => p,
            None => vals[&id].f(),
        }
    }
}
