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

use maxc_schema::kernel::StepDim;
pub use maxc_schema::{StepInputs, StepLimits};

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

/// A role's paged KV cache for the interpreter.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Its layout.
    pub layout: KvLayout,
    /// Pages.
    pub num_pages: usize,
    /// `[num_pages, layers, planes, kv_heads, page_size, head_dim]`.
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

/// A value of an init graph's output: integers (i32 and i64 types) or floats.
#[derive(Clone, Debug, PartialEq)]
pub enum InitValue {
    /// Integer elements.
    Ints(Vec<i64>),
    /// Float elements.
    Floats(Vec<f32>),
}

/// Runs an init graph (the `ep_init` graph: inputs, zeros and rank experts, no weights and no
/// steps) with integer `inputs` by name, and returns its outputs by name.
pub fn run_init_graph(
    graph: &Graph,
    inputs: &BTreeMap<String, Vec<i64>>,
) -> Result<BTreeMap<String, InitValue>> {
    graph.validate()?;
    let mut vals: BTreeMap<NodeIndex, InitValue> = BTreeMap::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        let elements = || -> Result<usize> {
            node.ty.shape.iter().try_fold(1usize, |n, d| {
                d.fixed()
                    .map(|d| n * d)
                    .ok_or_else(|| Error::Eval(format!("`{}` has symbolic dim `{d}`", node.name)))
            })
        };
        let v =
            match &node.op {
                Op::Input => InitValue::Ints(inputs.get(&node.name).cloned().ok_or_else(|| {
                    Error::Eval(format!("no value for graph input `{}`", node.name))
                })?),
                Op::Zeros { dtype, .. } if dtype.is_float() => {
                    InitValue::Floats(vec![0.0; elements()?])
                }
                Op::Zeros { .. } => InitValue::Ints(vec![0; elements()?]),
                Op::RankExperts { experts_per_rank } => {
                    let rank = match vals.get(&graph.operands(id)[0]) {
                        Some(InitValue::Ints(r)) if r.len() == 1 => r[0],
                        _ => {
                            return Err(Error::Eval(format!(
                                "`{}`: the rank is not one integer",
                                node.name
                            )))
                        }
                    };
                    let per = *experts_per_rank as i64;
                    InitValue::Ints((0..per).map(|i| rank * per + i).collect())
                }
                other => {
                    return Err(Error::Eval(format!(
                        "`{}` ({}) is not an init-graph op",
                        node.name,
                        other.name()
                    )))
                }
            };
        vals.insert(id, v);
    }
    Ok(graph
        .outputs()
        .iter()
        .map(|(name, id)| (name.clone(), vals[id].clone()))
        .collect())
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
                Op::Embedding { .. } => {
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

    /// The step's one check ([`StepInputs::checked_dims`]) against this graph and `cache`:
    /// the interpreter has no bounds but the cache's pages.
    fn check(&self, s: &StepInputs, cache: &KvCache) -> Result<()> {
        if cache.layout != self.kv_layout {
            return Err(Error::Eval(
                "the KV cache's layout differs from the graph's".into(),
            ));
        }
        let mut bounds = [u64::MAX; StepDim::COUNT];
        bounds[StepDim::TotalNumPages as usize] = cache.num_pages as u64;
        let limits = StepLimits {
            bounds,
            vocab_size: self.vocab_size as u64,
            page_size: self.kv_layout.page_size as u64,
            max_seq_len: u64::MAX,
            kv_windows: self
                .kv_layout
                .windows()
                .into_iter()
                .map(|w| w.map(|w| w as u64))
                .collect(),
        };
        s.checked_dims(&limits)
            .map(|_| ())
            .map_err(|e| Error::Eval(e.to_string()))
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
            ("logit_rows".to_string(), s.logit_indices.len()),
        ]);
        let widen = |v: &[i32]| v.iter().map(|&x| i64::from(x)).collect::<Vec<i64>>();
        let (offs, lens) = (widen(&s.input_row_offsets), widen(&s.cache_lengths));
        let batch = PagedBatch {
            row_offsets: &offs,
            cache_lengths: &lens,
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
                    "logit_indices" => widen(&s.logit_indices),

                    "batch_context_lengths" => {
                        (0..b).map(|i| lens[i] + offs[i + 1] - offs[i]).collect()
                    }
                    other => match maxc_schema::kv_lookup_group(other) {
                        Some(g) => widen(s.lookup_table(g)),
                        None => {
                            return Err(Error::Eval(format!("no value for graph input `{other}`")))
                        }
                    },
                }),
                Op::KvCache(_) => continue,
                Op::Param => continue,
                Op::Embedding { scale } => {
                    let h = shape[1];
                    let table = self
                        .params
                        .get(&ops[0])
                        .map(Vec::as_slice)
                        .unwrap_or_else(|| v(0).f());
                    Val::F(
                        v(1).i()
                            .iter()
                            .flat_map(|&t| {
                                table[t as usize * h..][..h].iter().map(move |v| v * scale)
                            })
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
                Op::GeluTanh => Val::F(v(0).f().iter().map(|&x| kernels::gelu_tanh(x)).collect()),
                Op::RmsNorm { eps, offset } => Val::F(kernels::rms_norm(
                    self.f(&vals, ops[0]),
                    self.f(&vals, ops[1]),
                    (*eps, *offset),
                )),
                Op::Reshape { .. } => match v(0) {
                    Val::F(x) => Val::F(x.clone()),
                    Val::I(x) => Val::I(x.clone()),
                },
                Op::Positions => Val::I(batch.rows().map(|(_, _, pos)| pos as i64).collect()),
                Op::Rope { table } => Val::F(kernels::rope(v(0).f(), v(1).i(), shape[1], table)),
                Op::PagedAttention {
                    layer,
                    scale,
                    window,
                } => Val::F(kernels::paged_attention(
                    v(0).f(),
                    v(1).f(),
                    v(2).f(),
                    (&mut cache.data, v(4).i()),
                    shape[1],
                    &self.kv_layout,
                    (*layer, *window),
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
                Op::AllReduceSum | Op::AllGather { .. } => {
                    return Err(Error::Eval(format!(
                        "`{}` ({}) joins the tensor-parallel ranks; the interpreter runs the whole model at degree 1",
                        node.name,
                        node.op.name()
                    )))
                }
                Op::Zeros { .. } | Op::RankExperts { .. } => {
                    return Err(Error::Eval(format!(
                        "`{}` ({}) belongs in an init graph; run it with `run_init_graph`",
                        node.name,
                        node.op.name()
                    )))
                }
                Op::Concat => Val::F(kernels::concat(v(0).f(), v(1).f(), last(0), last(1))),
                Op::HeadLinear => Val::F(kernels::head_linear(
                    v(0).f(),
                    self.f(&vals, ops[1]),
                    shape[1],
                    last(0),
                )),
                Op::LatentAttention {
                    layer,
                    scale,
                    value_dim,
                } => Val::F(kernels::latent_attention(
                    v(0).f(),
                    v(1).f(),
                    (&mut cache.data, v(3).i()),
                    shape[1],
                    &self.kv_layout,
                    (*layer, *value_dim),
                    *scale,
                    &batch,
                )),
                Op::DecompressedLatentAttention { layer, scale } => {
                    let nope = last(0);
                    let value = g.node(ops[4]).ty.shape[1].fixed().unwrap_or(1);
                    Val::F(kernels::decompressed_latent_attention(
                        (v(0).f(), v(1).f()),
                        v(2).f(),
                        (self.f(&vals, ops[3]), self.f(&vals, ops[4])),
                        (&mut cache.data, v(6).i()),
                        (shape[1], nope, value),
                        &self.kv_layout,
                        *layer,
                        *scale,
                        &batch,
                    ))
                }
                Op::MoeRouter { .. } => Val::F(kernels::moe_router(
                    v(0).f(),
                    self.f(&vals, ops[1]),
                    &node.op,
                )),
                Op::LogitRows => {
                    let h = last(0);
                    let x = v(0).f();
                    Val::F(
                        s.logit_indices
                            .iter()
                            .flat_map(|&row| match usize::try_from(row) {
                                Ok(row) => x[row * h..(row + 1) * h].to_vec(),
                                Err(_) => vec![0.0; h],
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
