//! The ops of the graph IR and their shape inference.
//!
//! Every op has one output. Operands are ordered; [`Op::infer`] checks them and gives the output
//! type, so a graph can be re-checked after any pass (`Graph::validate`).

use super::dim::{names, same_volume, shape_string, Dim, Shape};
use crate::DType;
use maxc_schema::KvDtype;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The type of a tensor value: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape, with symbolic dims.
    pub shape: Shape,
}

impl TensorType {
    /// A tensor type.
    pub fn new(dtype: DType, shape: impl IntoIterator<Item = Dim>) -> Self {
        TensorType {
            dtype,
            shape: shape.into_iter().collect(),
        }
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.dtype, shape_string(&self.shape))
    }
}

/// Layout of a role's paged KV cache. The cache tensor is
/// `[total_num_pages, num_layers, planes, num_kv_heads, page_size, head_dim]` (a KV head's rows
/// back to back within a page): a page holds
/// the keys and values (`planes` 2) or the one latent (`planes` 1, multi-head latent
/// attention) of the `num_layers` layers of one [`KvGroup`]. Every group draws pages from the
/// one pool and has its own lookup-table input; a sliding group hands back the pages its window
/// has left.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Layer slots in a page: the layers of one group.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// What the cache stores each key and value as; the graph sees them as f32.
    pub dtype: KvDtype,
    /// The page groups, in lookup-table order.
    pub groups: Vec<KvGroup>,
    /// Planes per layer slot: 2 (keys, then values) or 1 (a latent whose first elements are
    /// also the values: [`Op::LatentAttention`]).
    #[serde(default = "two_planes")]
    pub planes: usize,
}

fn two_planes() -> usize {
    2
}

/// Decoder layers of the KV cache that attend alike and so share pages and a lookup table.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGroup {
    /// The layers' sliding window (`None`: full attention).
    pub window: Option<usize>,
    /// The decoder layers, by page slot.
    pub layers: Vec<usize>,
}

/// Where a decoder layer's keys and values live: its page group and its slot in the group's
/// pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSlot {
    /// The page group (its lookup table).
    pub group: usize,
    /// The layer slot within a page.
    pub slot: usize,
}

impl KvLayout {
    /// The layout of a cache for layers with sliding windows `windows` (`None`: full
    /// attention; one entry per decoder layer). Layers are grouped by window, every group of
    /// the same size: the greatest common divisor of the counts of each window, so that no
    /// slot is wasted. A group takes the next layers of its window in layer order; groups are
    /// ordered by their first layer. Where every layer attends alike there is one group.
    pub fn grouped(
        windows: &[Option<usize>],
        num_kv_heads: usize,
        head_dim: usize,
        page_size: usize,
        dtype: KvDtype,
    ) -> KvLayout {
        let mut counts: BTreeMap<Option<usize>, usize> = BTreeMap::new();
        for w in windows {
            *counts.entry(*w).or_default() += 1;
        }
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let size = counts.values().fold(0, |g, &c| gcd(g, c)).max(1);
        let mut groups: Vec<KvGroup> = Vec::new();
        let mut open: BTreeMap<Option<usize>, usize> = BTreeMap::new();
        for (layer, w) in windows.iter().enumerate() {
            let g = match open.get(w) {
                Some(&g) if groups[g].layers.len() < size => g,
                _ => {
                    groups.push(KvGroup {
                        window: *w,
                        layers: Vec::new(),
                    });
                    open.insert(*w, groups.len() - 1);
                    groups.len() - 1
                }
            };
            groups[g].layers.push(layer);
        }
        KvLayout {
            num_layers: size.min(windows.len()),
            num_kv_heads,
            head_dim,
            page_size,
            dtype,
            groups,
            planes: 2,
        }
    }

    /// The layout of a multi-head latent attention cache: per token and layer one "head" of
    /// `head_dim` values (the compressed latent, then the shared rope key), one plane.
    pub fn latent(
        windows: &[Option<usize>],
        head_dim: usize,
        page_size: usize,
        dtype: KvDtype,
    ) -> KvLayout {
        KvLayout {
            planes: 1,
            ..Self::grouped(windows, 1, head_dim, page_size, dtype)
        }
    }

    /// Decoder layer `layer`'s group and slot; `None` past the last layer.
    pub fn slot(&self, layer: usize) -> Option<KvSlot> {
        self.groups.iter().enumerate().find_map(|(group, g)| {
            g.layers
                .iter()
                .position(|&l| l == layer)
                .map(|slot| KvSlot { group, slot })
        })
    }

    /// Each group's window, in group order.
    pub fn windows(&self) -> Vec<Option<usize>> {
        self.groups.iter().map(|g| g.window).collect()
    }

    /// The cache tensor's type, with `total_num_pages` symbolic: f32 values, whatever
    /// [`KvLayout::dtype`] stores them as.
    pub fn tensor_type(&self) -> TensorType {
        TensorType::new(
            DType::F32,
            [
                Dim::sym(names::TOTAL_NUM_PAGES),
                self.num_layers.into(),
                self.planes.into(),
                self.page_size.into(),
                self.num_kv_heads.into(),
                self.head_dim.into(),
            ],
        )
    }

    /// Elements in one page (one group's layers, every plane).
    pub fn page_elems(&self) -> usize {
        self.num_layers * self.planes * self.page_size * self.num_kv_heads * self.head_dim
    }
}

/// An operation of the graph IR.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A per-step graph input; the node's name is the input's name.
    Input,
    /// The paged KV cache: state that attention reads and writes; persists across steps.
    KvCache(KvLayout),
    /// A weight; the node's name is its key in the role's weights.
    Param,
    /// `(table [V, H], ids [T]) -> [T, H]`: rows of `table`, times `scale`.
    Embedding {
        /// What the rows are multiplied by (1 but for Gemma's `sqrt(hidden)`).
        scale: f32,
    },
    /// `(x [.., K], w [N, K]) -> [.., N]`: `x · wᵀ`, the layout of a Hugging Face linear weight.
    Linear,
    /// `(a, b) -> a`: elementwise sum; `b`'s shape is `a`'s or a suffix of it (broadcast).
    Add,
    /// `(a, b) -> a`: elementwise product, broadcast as [`Op::Add`].
    Mul,
    /// `x -> x`: `x · sigmoid(x)`.
    Silu,
    /// `x -> x`: GELU with the tanh approximation (`gelu_pytorch_tanh`), elementwise.
    GeluTanh,
    /// `(x [.., W], w [W]) -> [.., W]`: `x / sqrt(mean(x²) + eps) · (w + offset)` over the
    /// last axis.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
        /// Added to the weight (Gemma's `(1 + w)`: 1).
        offset: f32,
    },
    /// `x -> shape`: same elements, new shape.
    Reshape {
        /// The new shape.
        shape: Shape,
    },
    /// `(tokens [T], input_row_offsets [B+1], cache_lengths [B]) -> i64 [T]`: each token's
    /// position in its sequence (cache length plus its index within the step's rows).
    Positions,
    /// `(x [T, H, D], positions [T]) -> [T, H, D]`: rotary embedding, rotate-half layout.
    /// The first `2 · table.half()` elements of each head rotate (partial rotary where that is
    /// less than `D`); the rest pass through.
    Rope {
        /// The frequencies (with any rope scaling applied), and the scale of cos and sin.
        table: maxc_schema::RopeTable,
    },
    /// `(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_cache, kv_lookup_table [B, P],
    /// cache_lengths [B], input_row_offsets [B+1]) -> [T, Hq, D]`: writes the step's K and V into
    /// layer `layer` of the paged cache, then causal attention of each row over its sequence's
    /// cached and new tokens (its last `window` of them, itself included, where a window is
    /// set). `Hq` is a multiple of `Hkv` (GQA/MQA).
    PagedAttention {
        /// The decoder layer, the cache slot written and read.
        layer: usize,
        /// Scale of `q · k`, usually `1 / sqrt(D)`.
        scale: f32,
        /// Sliding-window attention: the positions a row at position `p` sees are
        /// `p + 1 - window ..= p`.
        window: Option<usize>,
    },
    /// `x -> x`: softmax over the last axis.
    Softmax,
    /// `probs [T, E] -> [T, E]`: keeps each row's `k` largest entries (ties: lower index first),
    /// zeroes the rest; with `renormalize`, the kept ones are divided by their sum.
    TopK {
        /// Entries kept per row.
        k: usize,
        /// Whether kept entries sum to one.
        renormalize: bool,
    },
    /// `(x [T, H], routing [T, E], then per expert e: gate_e [F, H], up_e [F, H],
    /// down_e [H, F]) -> [T, H]`: `Σ_e routing[t, e] · down_e(silu(gate_e x) · up_e x)` over the
    /// experts with a non-zero routing weight.
    MoeExperts {
        /// Experts E.
        num_experts: usize,
    },
    /// `() -> dtype [shape]`: zeros (state that a program allocates and initialises, such as
    /// expert-parallel exchange buffers). The shape is fixed.
    Zeros {
        /// Element type.
        dtype: DType,
        /// The shape.
        shape: Shape,
    },
    /// `(rank i32 [1]) -> i32 [experts_per_rank]`: the experts an expert-parallel rank holds,
    /// `rank · experts_per_rank + i`.
    RankExperts {
        /// Experts per rank.
        experts_per_rank: usize,
    },
    /// `(x f32 [..]) -> f32 [..]`: every tensor-parallel rank's `x` summed element-wise (ranks
    /// added in rank order), the same on every rank: where a layer's row-split matmul (attention
    /// output, MLP down) joins its ranks' partial sums.
    AllReduceSum,
    /// `(x f32 [.., C]) -> f32 [.., C · ranks]`: every tensor-parallel rank's `x` (the same
    /// shape on each) side by side along the last axis, in rank order, the same on every rank:
    /// where the vocabulary projection, split by rows, joins its ranks' logits.
    AllGather {
        /// Ranks of the group.
        ranks: usize,
    },
    /// `(x [T, H], logit_indices i32 [logit_rows]) -> [logit_rows, H]`: the rows whose logits
    /// the step returns, row `logit_indices[i]` of `x` (zeros where it is -1).
    LogitRows,
    /// `(a [.., A], b [.., B]) -> [.., A + B]`: `a` then `b` along the last axis; the leading
    /// dims are the same.
    Concat,
    /// `(x [T, H, K], w [H, N, K]) -> [T, H, N]`: each head its own linear map,
    /// `out[t, h] = w[h] · x[t, h]` (multi-head latent attention's absorbed up-projections).
    HeadLinear,
    /// `(q [T, H, D], kv [T, 1, D], kv_cache, kv_lookup_table [B, P], cache_lengths [B],
    /// input_row_offsets [B+1]) -> [T, H, value_dim]`: multi-head latent attention in the latent
    /// space. Writes each row's `kv` (the compressed latent, then the rope key) into layer
    /// `layer` of a one-plane cache, then causal attention of every query head over its
    /// sequence's cached and new rows, all heads reading the one latent as their key, and its
    /// first `value_dim` values as their value.
    LatentAttention {
        /// The decoder layer, the cache slot written and read.
        layer: usize,
        /// Scale of `q · k`.
        scale: f32,
        /// Elements of the value: the latent's first `value_dim` (the KV LoRA rank).
        value_dim: usize,
    },
    /// `(q_nope [T, H, N], q_rope [T, H, R], kv [T, 1, C + R], w_uk [H, C, N],
    /// w_uv [H, V, C], kv_cache, kv_lookup_table [B, P], cache_lengths [B],
    /// input_row_offsets [B+1], batch_context_lengths [B]) -> [T, H, V]`: multi-head latent
    /// attention computed decompressed, each sequence's context (`batch_context_lengths`, its
    /// cached plus new tokens: what the expansion is sized by) expanded once a step. Writes each row's `kv` (latent `c`, then rope key) into layer `layer` of a
    /// one-plane cache as [`Op::LatentAttention`] does, then for head `h` of a row at position
    /// `p`: keys `[W_UK_h c_j | k_rope_j]` (`W_UK_h c = w_uk[h]ᵀ c`) and values
    /// `W_UV_h c_j` (`w_uv[h] c`) for `j <= p`, scores `q · k · scale`. The same function as
    /// the absorbed form; it costs more per cached token and less per query row.
    DecompressedLatentAttention {
        /// The decoder layer, the cache slot written and read.
        layer: usize,
        /// Scale of `q · k`.
        scale: f32,
    },
    /// `(logits [T, E], bias [E]) -> routing [T, E]`: group-limited top-k routing (DeepSeek's
    /// router). Scores `s` are the sigmoid (or softmax) of the logits; choice scores are
    /// `c = s + bias`. The experts are split into `n_group` groups of consecutive experts, each
    /// group scored by the sum of its two largest `c` (or its largest `s`); the `topk_group`
    /// best groups are kept and the `top_k` largest `c` among their experts chosen (ties: lower
    /// index first). A chosen expert's weight is its `s`, divided by the chosen ones' sum
    /// (plus 1e-20) where `renormalize`, times `scale`; the others get 0.
    MoeRouter {
        /// Experts chosen per token.
        top_k: usize,
        /// Groups of experts.
        n_group: usize,
        /// Groups kept per token.
        topk_group: usize,
        /// How logits become scores.
        scoring: RouterScoring,
        /// How a group is scored.
        group_score: GroupScore,
        /// Whether the chosen weights are divided by their sum.
        renormalize: bool,
        /// What the weights are multiplied by (`routed_scaling_factor`).
        scale: f32,
    },
}

pub use maxc_schema::{GroupScore, RouterScoring};

impl Op {
    /// The op's short name, for errors and listings.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::KvCache(_) => "kv_cache",
            Op::Param => "param",
            Op::Embedding { .. } => "embedding",
            Op::Linear => "linear",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Silu => "silu",
            Op::GeluTanh => "gelu_tanh",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Reshape { .. } => "reshape",
            Op::Positions => "positions",
            Op::Rope { .. } => "rope",
            Op::PagedAttention { .. } => "paged_attention",
            Op::Softmax => "softmax",
            Op::TopK { .. } => "top_k",
            Op::MoeExperts { .. } => "moe_experts",
            Op::LogitRows => "logit_rows",
            Op::Zeros { .. } => "zeros",
            Op::RankExperts { .. } => "rank_experts",
            Op::AllReduceSum => "all_reduce_sum",
            Op::AllGather { .. } => "all_gather",
            Op::Concat => "concat",
            Op::HeadLinear => "head_linear",
            Op::LatentAttention { .. } => "latent_attention",
            Op::DecompressedLatentAttention { .. } => "decompressed_latent_attention",
            Op::MoeRouter { .. } => "moe_router",
        }
    }

    /// True for ops without operands whose type is declared, not inferred.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input | Op::KvCache(_) | Op::Param)
    }

    /// The output type for these operand types, or what does not fit.
    pub fn infer(&self, xs: &[&TensorType]) -> Result<TensorType, String> {
        match self {
            Op::Input | Op::Param => Err("a leaf has a declared type".into()),
            Op::KvCache(layout) => {
                arity(xs, 0)?;
                Ok(layout.tensor_type())
            }
            Op::Embedding { .. } => {
                arity(xs, 2)?;
                let (table, ids) = (xs[0], xs[1]);
                real(table, "table")?;
                rank(table, 2, "table")?;
                rank(ids, 1, "ids")?;
                integer(ids, "ids")?;
                Ok(TensorType::new(
                    DType::F32,
                    [ids.shape[0].clone(), table.shape[1].clone()],
                ))
            }
            Op::Linear => {
                arity(xs, 2)?;
                let (x, w) = (xs[0], xs[1]);
                float(x, "x")?;
                real(w, "w")?;
                rank(w, 2, "w")?;
                let k = x.shape.last().ok_or("x is a scalar")?;
                same_dim(k, &w.shape[1], "x's last dim", "w's in-features (dim 1)")?;
                let mut shape = x.shape.clone();
                *shape.last_mut().expect("rank checked") = w.shape[0].clone();
                Ok(TensorType::new(DType::F32, shape))
            }
            Op::Add | Op::Mul => {
                arity(xs, 2)?;
                let (a, b) = (xs[0], xs[1]);
                float(a, "a")?;
                float(b, "b")?;
                if b.shape.len() > a.shape.len()
                    || a.shape[a.shape.len() - b.shape.len()..] != b.shape[..]
                {
                    return Err(format!(
                        "b's shape {} is not a suffix of a's shape {}",
                        shape_string(&b.shape),
                        shape_string(&a.shape)
                    ));
                }
                Ok(TensorType::new(DType::F32, a.shape.clone()))
            }
            Op::Silu | Op::GeluTanh | Op::Softmax => {
                arity(xs, 1)?;
                float(xs[0], "x")?;
                Ok(TensorType::new(DType::F32, xs[0].shape.clone()))
            }
            Op::RmsNorm { .. } => {
                arity(xs, 2)?;
                let (x, w) = (xs[0], xs[1]);
                float(x, "x")?;
                rank(w, 1, "w")?;
                let h = x.shape.last().ok_or("x is a scalar")?;
                same_dim(h, &w.shape[0], "x's last dim", "w's size")?;
                Ok(TensorType::new(DType::F32, x.shape.clone()))
            }
            Op::Reshape { shape } => {
                arity(xs, 1)?;
                if !same_volume(&xs[0].shape, shape) {
                    return Err(format!(
                        "cannot reshape {} to {}: element counts differ",
                        shape_string(&xs[0].shape),
                        shape_string(shape)
                    ));
                }
                Ok(TensorType::new(xs[0].dtype, shape.clone()))
            }
            Op::Positions => {
                arity(xs, 3)?;
                for (x, what) in xs
                    .iter()
                    .zip(["tokens", "input_row_offsets", "cache_lengths"])
                {
                    rank(x, 1, what)?;
                    integer(x, what)?;
                }
                Ok(TensorType::new(DType::I64, [xs[0].shape[0].clone()]))
            }
            Op::Rope { table } => {
                let inv_freq = &table.inv_freq;
                arity(xs, 2)?;
                let (x, pos) = (xs[0], xs[1]);
                float(x, "x")?;
                rank(x, 3, "x")?;
                rank(pos, 1, "positions")?;
                integer(pos, "positions")?;
                same_dim(&x.shape[0], &pos.shape[0], "x's rows", "positions' length")?;
                match x.shape[2] {
                    Dim::Fixed(d) if d >= 2 * inv_freq.len() && !inv_freq.is_empty() => {}
                    ref d => {
                        return Err(format!(
                            "x's head dim {d} is less than the rotated dims (2 × {} inv_freq)",
                            inv_freq.len()
                        ))
                    }
                }
                Ok(TensorType::new(DType::F32, x.shape.clone()))
            }
            Op::PagedAttention { window, .. } => {
                arity(xs, 7)?;
                if *window == Some(0) {
                    return Err("a sliding window of 0 positions".into());
                }
                let (q, k, v, cache, lut, lens, offs) =
                    (xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6]);
                for (x, what) in [(q, "q"), (k, "k"), (v, "v")] {
                    float(x, what)?;
                    rank(x, 3, what)?;
                    same_dim(
                        &x.shape[0],
                        &q.shape[0],
                        &format!("{what}'s rows"),
                        "q's rows",
                    )?;
                }
                if k.shape != v.shape {
                    return Err(format!(
                        "k {} and v {} differ",
                        shape_string(&k.shape),
                        shape_string(&v.shape)
                    ));
                }
                same_dim(&q.shape[2], &k.shape[2], "q's head dim", "k's head dim")?;
                let (hq, hkv) = (q.shape[1].fixed(), k.shape[1].fixed());
                match (hq, hkv) {
                    (Some(hq), Some(hkv)) if hkv > 0 && hq % hkv == 0 => {}
                    _ => {
                        return Err(format!(
                            "q heads {} are not a multiple of kv heads {}",
                            q.shape[1], k.shape[1]
                        ))
                    }
                }
                rank(cache, 6, "kv_cache")?;
                same_dim(
                    &cache.shape[2],
                    &Dim::Fixed(2),
                    "kv_cache's planes",
                    "keys and values",
                )?;
                same_dim(
                    &cache.shape[4],
                    &k.shape[1],
                    "kv_cache's kv heads",
                    "k's heads",
                )?;
                same_dim(
                    &cache.shape[5],
                    &k.shape[2],
                    "kv_cache's head dim",
                    "k's head dim",
                )?;
                rank(lut, 2, "kv_lookup_table")?;
                integer(lut, "kv_lookup_table")?;
                rank(lens, 1, "cache_lengths")?;
                integer(lens, "cache_lengths")?;
                same_dim(
                    &lut.shape[0],
                    &lens.shape[0],
                    "kv_lookup_table's rows",
                    "cache_lengths' length",
                )?;
                rank(offs, 1, "input_row_offsets")?;
                integer(offs, "input_row_offsets")?;
                Ok(TensorType::new(DType::F32, q.shape.clone()))
            }
            Op::TopK { k, .. } => {
                arity(xs, 1)?;
                rank(xs[0], 2, "probs")?;
                if let Some(e) = xs[0].shape[1].fixed() {
                    if *k == 0 || *k > e {
                        return Err(format!("k = {k} is not in 1..={e} (the expert count)"));
                    }
                }
                Ok(TensorType::new(DType::F32, xs[0].shape.clone()))
            }
            Op::MoeExperts { num_experts } => {
                arity(xs, 2 + 3 * num_experts)?;
                let (x, routing) = (xs[0], xs[1]);
                rank(x, 2, "x")?;
                rank(routing, 2, "routing")?;
                same_dim(&routing.shape[0], &x.shape[0], "routing's rows", "x's rows")?;
                same_dim(
                    &routing.shape[1],
                    &Dim::Fixed(*num_experts),
                    "routing's columns",
                    "the expert count",
                )?;
                let h = &x.shape[1];
                let f = &xs[2]
                    .shape
                    .first()
                    .ok_or("expert 0's gate is a scalar")?
                    .clone();
                for e in 0..*num_experts {
                    let (g, u, d) = (xs[2 + 3 * e], xs[3 + 3 * e], xs[4 + 3 * e]);
                    for (w, what, want) in
                        [(g, "gate", [f, h]), (u, "up", [f, h]), (d, "down", [h, f])]
                    {
                        float(w, what)?;
                        if w.shape.len() != 2 || &w.shape[0] != want[0] || &w.shape[1] != want[1] {
                            return Err(format!(
                                "expert {e}'s {what} weight is {}, expected [{}, {}]",
                                shape_string(&w.shape),
                                want[0],
                                want[1]
                            ));
                        }
                    }
                }
                Ok(TensorType::new(DType::F32, x.shape.clone()))
            }
            Op::Zeros { dtype, shape } => {
                arity(xs, 0)?;
                if let Some(d) = shape.iter().find(|d| d.fixed().is_none()) {
                    return Err(format!(
                        "zeros of symbolic dim `{d}`: the shape must be fixed"
                    ));
                }
                Ok(TensorType::new(*dtype, shape.clone()))
            }
            Op::AllReduceSum => {
                arity(xs, 1)?;
                if xs[0].dtype != DType::F32 {
                    return Err(format!("all_reduce_sum of {}, expected f32", xs[0]));
                }
                Ok(xs[0].clone())
            }
            Op::AllGather { ranks } => {
                arity(xs, 1)?;
                let x = xs[0];
                if x.dtype != DType::F32 || x.shape.is_empty() || *ranks == 0 {
                    return Err(format!(
                        "all_gather of {x} over {ranks} ranks, expected f32 [.., C]"
                    ));
                }
                let mut shape = x.shape.clone();
                let last = shape.len() - 1;
                shape[last] = match shape[last] {
                    Dim::Fixed(c) => Dim::Fixed(c * *ranks),
                    _ => return Err(format!("all_gather of {x}: its last dim must be fixed")),
                };
                Ok(TensorType::new(DType::F32, shape))
            }
            Op::RankExperts { experts_per_rank } => {
                arity(xs, 1)?;
                rank(xs[0], 1, "rank")?;
                integer(xs[0], "rank")?;
                if xs[0].shape[0] != Dim::Fixed(1) || xs[0].dtype != DType::I32 {
                    return Err(format!("rank is {}, expected i32 [1]", xs[0]));
                }
                if *experts_per_rank == 0 {
                    return Err("no experts per rank".into());
                }
                Ok(TensorType::new(DType::I32, [Dim::Fixed(*experts_per_rank)]))
            }
            Op::LogitRows => {
                arity(xs, 2)?;
                let (x, idx) = (xs[0], xs[1]);
                rank(x, 2, "x")?;
                rank(idx, 1, "logit_indices")?;
                if idx.dtype != DType::I32 {
                    return Err(format!("logit_indices is {idx}, expected i32"));
                }
                Ok(TensorType::new(
                    DType::F32,
                    [idx.shape[0].clone(), x.shape[1].clone()],
                ))
            }
            Op::Concat => {
                arity(xs, 2)?;
                let (a, b) = (xs[0], xs[1]);
                float(a, "a")?;
                float(b, "b")?;
                let n = a.shape.len();
                if n == 0 || b.shape.len() != n || a.shape[..n - 1] != b.shape[..n - 1] {
                    return Err(format!(
                        "a {} and b {} differ outside their last dim",
                        shape_string(&a.shape),
                        shape_string(&b.shape)
                    ));
                }
                let (Some(wa), Some(wb)) = (a.shape[n - 1].fixed(), b.shape[n - 1].fixed()) else {
                    return Err("concatenated dims must be fixed".into());
                };
                let mut shape = a.shape.clone();
                shape[n - 1] = Dim::Fixed(wa + wb);
                Ok(TensorType::new(DType::F32, shape))
            }
            Op::HeadLinear => {
                arity(xs, 2)?;
                let (x, w) = (xs[0], xs[1]);
                float(x, "x")?;
                rank(x, 3, "x")?;
                float(w, "w")?;
                rank(w, 3, "w")?;
                same_dim(&x.shape[1], &w.shape[0], "x's heads", "w's heads (dim 0)")?;
                same_dim(
                    &x.shape[2],
                    &w.shape[2],
                    "x's last dim",
                    "w's in-features (dim 2)",
                )?;
                Ok(TensorType::new(
                    DType::F32,
                    [x.shape[0].clone(), x.shape[1].clone(), w.shape[1].clone()],
                ))
            }
            Op::LatentAttention { value_dim, .. } => {
                arity(xs, 6)?;
                let (q, kv, cache, lut, lens, offs) = (xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]);
                for (x, what) in [(q, "q"), (kv, "kv")] {
                    float(x, what)?;
                    rank(x, 3, what)?;
                }
                same_dim(&kv.shape[0], &q.shape[0], "kv's rows", "q's rows")?;
                same_dim(
                    &kv.shape[1],
                    &Dim::Fixed(1),
                    "kv's heads",
                    "one latent head",
                )?;
                same_dim(&q.shape[2], &kv.shape[2], "q's head dim", "kv's head dim")?;
                match q.shape[2].fixed() {
                    Some(d) if *value_dim > 0 && *value_dim <= d => {}
                    _ => {
                        return Err(format!(
                            "value_dim {value_dim} is not in 1..={} (the latent's width)",
                            q.shape[2]
                        ))
                    }
                }
                latent_cache(cache, &kv.shape[2], [lut, lens, offs])?;
                Ok(TensorType::new(
                    DType::F32,
                    [
                        q.shape[0].clone(),
                        q.shape[1].clone(),
                        Dim::Fixed(*value_dim),
                    ],
                ))
            }
            Op::DecompressedLatentAttention { .. } => {
                arity(xs, 10)?;
                rank(xs[9], 1, "batch_context_lengths")?;
                integer(xs[9], "batch_context_lengths")?;
                same_dim(
                    &xs[9].shape[0],
                    &xs[7].shape[0],
                    "batch_context_lengths' length",
                    "cache_lengths' length",
                )?;
                let (qn, qr, kv, w_uk, w_uv, cache) = (xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]);
                for (x, what) in [(qn, "q_nope"), (qr, "q_rope"), (kv, "kv")] {
                    float(x, what)?;
                    rank(x, 3, what)?;
                    same_dim(
                        &x.shape[0],
                        &qn.shape[0],
                        &format!("{what}'s rows"),
                        "q_nope's rows",
                    )?;
                }
                same_dim(
                    &qr.shape[1],
                    &qn.shape[1],
                    "q_rope's heads",
                    "q_nope's heads",
                )?;
                same_dim(
                    &kv.shape[1],
                    &Dim::Fixed(1),
                    "kv's heads",
                    "one latent head",
                )?;
                for (w, what) in [(w_uk, "w_uk"), (w_uv, "w_uv")] {
                    float(w, what)?;
                    rank(w, 3, what)?;
                    same_dim(
                        &w.shape[0],
                        &qn.shape[1],
                        &format!("{what}'s heads"),
                        "q_nope's heads",
                    )?;
                }
                same_dim(
                    &w_uk.shape[2],
                    &qn.shape[2],
                    "w_uk's dim 2",
                    "q_nope's head dim",
                )?;
                let (c, r) = (w_uk.shape[1].fixed(), qr.shape[2].fixed());
                let (Some(c), Some(r)) = (c, r) else {
                    return Err("the latent and rope widths must be fixed".into());
                };
                same_dim(
                    &kv.shape[2],
                    &Dim::Fixed(c + r),
                    "kv's width",
                    "the latent plus the rope key",
                )?;
                same_dim(
                    &w_uv.shape[2],
                    &Dim::Fixed(c),
                    "w_uv's dim 2",
                    "the latent's width",
                )?;
                latent_cache(cache, &kv.shape[2], [xs[6], xs[7], xs[8]])?;
                Ok(TensorType::new(
                    DType::F32,
                    [
                        qn.shape[0].clone(),
                        qn.shape[1].clone(),
                        w_uv.shape[1].clone(),
                    ],
                ))
            }
            Op::MoeRouter {
                top_k,
                n_group,
                topk_group,
                ..
            } => {
                arity(xs, 2)?;
                let (logits, bias) = (xs[0], xs[1]);
                float(logits, "logits")?;
                rank(logits, 2, "logits")?;
                float(bias, "bias")?;
                rank(bias, 1, "bias")?;
                same_dim(
                    &bias.shape[0],
                    &logits.shape[1],
                    "bias's size",
                    "the expert count",
                )?;
                let e = logits.shape[1]
                    .fixed()
                    .ok_or("the expert count is symbolic")?;
                if *n_group == 0 || e % n_group != 0 {
                    return Err(format!("{n_group} groups do not divide {e} experts"));
                }
                if *topk_group == 0 || topk_group > n_group {
                    return Err(format!("keeps {topk_group} of {n_group} groups"));
                }
                if *top_k == 0 || *top_k > topk_group * (e / n_group) {
                    return Err(format!(
                        "chooses {top_k} experts of the {} its {topk_group} groups hold",
                        topk_group * (e / n_group)
                    ));
                }
                Ok(TensorType::new(DType::F32, logits.shape.clone()))
            }
        }
    }
}

/// Checks a one-plane latent cache of slots `width` wide and the step's lookup table, cache
/// lengths and row offsets (multi-head latent attention's operands).
fn latent_cache(
    cache: &TensorType,
    width: &Dim,
    [lut, lens, offs]: [&TensorType; 3],
) -> Result<(), String> {
    rank(cache, 6, "kv_cache")?;
    same_dim(
        &cache.shape[2],
        &Dim::Fixed(1),
        "kv_cache's planes",
        "one latent plane",
    )?;
    same_dim(
        &cache.shape[4],
        &Dim::Fixed(1),
        "kv_cache's kv heads",
        "one latent head",
    )?;
    same_dim(
        &cache.shape[5],
        width,
        "kv_cache's head dim",
        "the latent's width",
    )?;
    rank(lut, 2, "kv_lookup_table")?;
    for (x, what) in [
        (lut, "kv_lookup_table"),
        (lens, "cache_lengths"),
        (offs, "input_row_offsets"),
    ] {
        integer(x, what)?;
    }
    rank(lens, 1, "cache_lengths")?;
    rank(offs, 1, "input_row_offsets")
}

fn arity(xs: &[&TensorType], n: usize) -> Result<(), String> {
    if xs.len() == n {
        Ok(())
    } else {
        Err(format!("takes {n} operand(s), got {}", xs.len()))
    }
}

fn rank(x: &TensorType, n: usize, what: &str) -> Result<(), String> {
    if x.shape.len() == n {
        Ok(())
    } else {
        Err(format!(
            "{what} has rank {} ({}), expected rank {n}",
            x.shape.len(),
            shape_string(&x.shape)
        ))
    }
}

fn float(x: &TensorType, what: &str) -> Result<(), String> {
    if x.dtype.is_float() {
        Ok(())
    } else {
        Err(format!(
            "{what} has dtype {}, expected a float dtype",
            x.dtype
        ))
    }
}

fn real(x: &TensorType, what: &str) -> Result<(), String> {
    if x.dtype.is_real() {
        Ok(())
    } else {
        Err(format!(
            "{what} has dtype {}, expected a float or block dtype",
            x.dtype
        ))
    }
}

fn integer(x: &TensorType, what: &str) -> Result<(), String> {
    if matches!(x.dtype, DType::I32 | DType::I64) {
        Ok(())
    } else {
        Err(format!("{what} has dtype {}, expected i32 or i64", x.dtype))
    }
}

fn same_dim(a: &Dim, b: &Dim, what_a: &str, what_b: &str) -> Result<(), String> {
    if a == b {
        Ok(())
    } else {
        Err(format!("{what_a} ({a}) differs from {what_b} ({b})"))
    }
}
