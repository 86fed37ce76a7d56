//! The kernel IR: what a lowered program runs. Both backends consume it (CPU: Cranelift native
//! code or a library kernel; CUDA: generated CUDA C), and it is stored in the artifact.
//!
//! Calling convention of a generated CPU kernel (System V on x86-64, AAPCS64 on aarch64):
//!
//! ```text
//! extern "C" fn(bufs: *const *mut u8, dims: *const u64, start: u64, end: u64)
//! ```
//!
//! - `bufs`: one pointer per buffer, in the order each [`KernelBody`] variant documents.
//! - `dims`: the step's sizes, indexed by [`StepDim`] (`dims[StepDim::TotalSeqLen as usize]`...).
//! - `start..end`: the slice of the kernel's parallel range (documented per variant) that this
//!   call computes; the executor splits the range across threads. Calls on disjoint slices may
//!   run at the same time and must not write the same memory.
//!
//! Float activations are f32. Weights ("param" buffers) are in the kernel's `weight_dtype`.
//! Integer step inputs (`input_row_offsets`, `cache_lengths`, `kv_lookup_table`) are i32;
//! `tokens` and positions are i64.

use super::{DType, KvDtype};
use serde::{Deserialize, Serialize};

/// The version of what a kernel body means beyond its fields (calling convention, parallel
/// range, buffer order). Bumped whenever that meaning changes without the body changing (as
/// when attention's parallel range became (row, KV head) pairs), so that code compiled under the
/// old meaning no longer matches its body's [`KernelBody::digest`].
pub const KERNEL_CONTRACT: &str = "maxc kernel contract 5";

/// A per-step size, by its slot in the `dims` array passed to every kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum StepDim {
    /// Token rows in the step (`total_seq_len`).
    TotalSeqLen = 0,
    /// Sequences in the step (`batch_size`).
    BatchSize = 1,
    /// Columns of the KV lookup table (`max_num_pages`).
    MaxNumPages = 2,
    /// Pages in the KV cache (`total_num_pages`).
    TotalNumPages = 3,
    /// Entries of `input_row_offsets` (`input_row_offsets_len`, the batch size plus one).
    InputRowOffsetsLen = 4,
    /// Logit rows the step returns (`logit_rows`): the length of its `logit_indices`.
    LogitRows = 5,
}

impl StepDim {
    /// Slots in the `dims` array.
    pub const COUNT: usize = 6;

    /// Every step dim, in slot order.
    pub const ALL: [StepDim; StepDim::COUNT] = [
        StepDim::TotalSeqLen,
        StepDim::BatchSize,
        StepDim::MaxNumPages,
        StepDim::TotalNumPages,
        StepDim::InputRowOffsetsLen,
        StepDim::LogitRows,
    ];

    /// The graph's name of this dim.
    pub fn name(self) -> &'static str {
        match self {
            StepDim::TotalSeqLen => "total_seq_len",
            StepDim::BatchSize => "batch_size",
            StepDim::MaxNumPages => "max_num_pages",
            StepDim::TotalNumPages => "total_num_pages",
            StepDim::InputRowOffsetsLen => "input_row_offsets_len",
            StepDim::LogitRows => "logit_rows",
        }
    }

    /// The dim with the graph name `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        StepDim::ALL.into_iter().find(|d| d.name() == name)
    }
}

/// How many rows a kernel processes: fixed, or a step dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Rows {
    /// A step dim's value.
    Step(StepDim),
    /// A constant.
    Fixed(u64),
}

/// One instruction of a fused elementwise expression; operands are indices of earlier
/// instructions. The last instruction is the result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EwInstr {
    /// The value of input `i` at this element.
    Input(u32),
    /// `a + b`.
    Add(u32, u32),
    /// `a * b`.
    Mul(u32, u32),
    /// `a · sigmoid(a)`.
    Silu(u32),
    /// GELU, tanh approximation: `0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³)))`, computed as
    /// `a · sigmoid(2·√(2/π)·(a + 0.044715·a³))` (the same function).
    GeluTanh(u32),
}

/// `2·√(2/π)`, the tanh GELU's slope inside its sigmoid form.
pub const GELU_TANH_SLOPE: f32 = 1.595_769;
/// The tanh GELU's cubic coefficient.
pub const GELU_TANH_CUBIC: f32 = 0.044_715;

/// An input of a fused elementwise kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EwInput {
    /// Element type (f32 activations, or a weight dtype).
    pub dtype: DType,
    /// A `[cols]` vector repeated over every row (a bias or a norm weight), instead of
    /// `[rows, cols]`.
    pub broadcast: bool,
}

/// Which rows a row gather reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GatherIndex {
    /// Row `i` of the output is row `index[i]` (i64 token ids) of the source; `rows` = tokens.
    Tokens,
    /// Row `i` of the output is row `index[i]` (the step input `logit_indices`, i32, checked
    /// to lie in `-1..total_seq_len`) of the source, or zeros where it is -1. The kernel's rows
    /// are `logit_rows`.
    LogitRows,
}

/// How a router turns logits into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RouterScoring {
    /// `sigmoid(logit)` per expert (DeepSeek-V3).
    Sigmoid,
    /// Softmax over a token's experts (DeepSeek-V2).
    Softmax,
}

/// How a group-limited router scores a group of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupScore {
    /// The sum of its two largest choice scores (DeepSeek-V3).
    TopTwoSum,
    /// Its largest score (DeepSeek-V2's `group_limited_greedy`).
    Max,
}

/// What a kernel computes. Each variant documents its buffers (in `bufs` order) and its
/// parallel range.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum KernelBody {
    /// `out[i, :] = src[idx(i), :] · scale`, converted to f32.
    /// Buffers: `src [V, cols]` (`src_dtype`), `index`, `out f32 [rows, cols]`.
    /// Parallel range: output rows.
    Gather {
        /// Output rows.
        rows: Rows,
        /// Row width.
        cols: u64,
        /// How the source row is chosen.
        index: GatherIndex,
        /// The source's element type.
        src_dtype: DType,
        /// What every value is multiplied by (Gemma's embeddings: `sqrt(hidden)`; else 1).
        scale: f32,
    },
    /// Each token row's position: `cache_lengths[b] + (r - input_row_offsets[b])`.
    /// Buffers: `input_row_offsets i32 [B+1]`, `cache_lengths i32 [B]`, `out i64 [T]`.
    /// Parallel range: sequences `0..B`.
    Positions,
    /// RMSNorm of each `width` values of rows (the whole row where `width == cols`; each head
    /// of q or k for the per-head norms), optionally of a residual sum:
    /// without residual: `x`, `w [width]`, `out` with
    /// `out = x / sqrt(mean(x²) + eps) · (w + weight_offset)`;
    /// with residual: `a`, `b`, `w [width]`, `sum`, `out` with `sum = a + b` and
    /// `out = rmsnorm(sum) · w`. All rows `[rows, cols]` f32; `w` in `weight_dtype`.
    /// Parallel range: rows.
    RmsNorm {
        /// Rows.
        rows: Rows,
        /// Row width.
        cols: u64,
        /// Values normalized together: `cols`, or a divisor of it.
        width: u64,
        /// Added to each weight (Gemma's `(1 + w)` norms: 1; else 0).
        weight_offset: f32,
        /// Added to the mean square.
        eps: f32,
        /// Whether the kernel first adds a residual.
        residual: bool,
        /// Element type of `w`.
        weight_dtype: DType,
    },
    /// A fused elementwise expression over `[rows, cols]` f32 values.
    /// Buffers: each input in order, then `out f32 [rows, cols]`. Parallel range: rows.
    Elementwise {
        /// Rows.
        rows: Rows,
        /// Row width.
        cols: u64,
        /// The inputs.
        inputs: Vec<EwInput>,
        /// The expression; the last instruction is the output.
        program: Vec<EwInstr>,
    },
    /// Rotary embedding (rotate-half layout) of the first `rotary_dim` elements of each head
    /// of `x [T, heads, head_dim]`: `out[i] = x[i]·cos - x[i+h]·sin`,
    /// `out[i+h] = x[i+h]·cos + x[i]·sin` for `i < h = rotary_dim/2`, with
    /// `cos = table[pos, 0, i]`, `sin = table[pos, 1, i]`; the other elements are copied.
    /// Buffers: `x`, `positions i64 [T]`, `table f32 [max_pos, 2, rotary_dim/2]`, `out`.
    /// Parallel range: rows `0..T`.
    Rope {
        /// Heads per row.
        heads: u64,
        /// Elements per head.
        head_dim: u64,
        /// Elements rotated, from each head's start (even, at most `head_dim`; Phi-3's
        /// `partial_rotary_factor` makes it less).
        rotary_dim: u64,
    },
    /// Writes the step's keys and values into layer `layer` of the paged cache: for row `r` of
    /// sequence `b` at position `p = cache_lengths[b] + r - input_row_offsets[b]`, page
    /// `kv_lookup_table[b, p / page_size]`, slot `p % page_size`.
    /// Cache layout [`KvView`]: rows of `head_dim` values in `kv_dtype`, rounded as
    /// [`KvDtype::round_row`] says. Buffers: `k f32 [T, kv_heads, head_dim]`, `v` (same; only
    /// with `planes` 2), `kv_cache`,
    /// `kv_lookup_table [B, P]`, `cache_lengths [B]`, `input_row_offsets [B+1]`. Parallel range:
    /// rows `0..T`.
    KvStore {
        /// Planes of a layer slot: 2 (keys, values) or 1 (a latent).
        planes: u64,
        /// The layer's slot in the cache.
        layer: u64,
        /// Layers in the cache.
        num_layers: u64,
        /// KV heads.
        kv_heads: u64,
        /// Elements per head.
        head_dim: u64,
        /// Tokens per page.
        page_size: u64,
        /// What the cache stores.
        kv_dtype: KvDtype,
    },
    /// Causal attention of each query row over its sequence's cached positions `0..=p` (the
    /// step's own keys must already be stored by [`KernelBody::KvStore`]). Query head `h` reads
    /// KV head `h / (heads / kv_heads)`. Scores `q·k · scale`, softmax, weighted sum of values:
    /// the value plane's `head_dim` values (`planes` 2), or the first `value_dim` values of the
    /// key itself (`planes` 1: multi-head latent attention, every head reading the one latent).
    /// Buffers: `q [T, heads, head_dim]`, `kv_cache`, `kv_lookup_table [B, P]`,
    /// `cache_lengths [B]`, `input_row_offsets [B+1]`, `out [T, heads, value_dim]`.
    /// Parallel range: (row, KV head) pairs `0..T·kv_heads`, item `i` being KV head
    /// `i % kv_heads` (and its query heads) of row `i / kv_heads`.
    Attention {
        /// Planes of a layer slot: 2 (keys, values) or 1 (a latent).
        planes: u64,
        /// Elements of a value: `head_dim` with 2 planes, at most `head_dim` with 1.
        value_dim: u64,
        /// The layer's slot in the cache.
        layer: u64,
        /// Layers in the cache.
        num_layers: u64,
        /// Query heads.
        heads: u64,
        /// KV heads (divides `heads`).
        kv_heads: u64,
        /// Elements per head.
        head_dim: u64,
        /// Tokens per page.
        page_size: u64,
        /// Score scale.
        scale: f32,
        /// Sliding window: a row at position `p` sees positions `p + 1 - window ..= p` only
        /// (`None`: every earlier position).
        window: Option<u64>,
        /// What the cache stores.
        kv_dtype: KvDtype,
    },
    /// Softmax over each row. Buffers: `x [rows, cols]`, `out`. Parallel range: rows.
    Softmax {
        /// Rows.
        rows: Rows,
        /// Row width.
        cols: u64,
    },
    /// Keeps each row's `k` largest entries (ties: lower index first), zeroes the rest;
    /// with `renormalize`, the kept entries are divided by their sum.
    /// Buffers: `x [rows, cols]`, `out`. Parallel range: rows.
    TopK {
        /// Rows.
        rows: Rows,
        /// Row width.
        cols: u64,
        /// Entries kept.
        k: u64,
        /// Whether kept entries sum to one.
        renormalize: bool,
    },
    /// `out = x · wᵀ (+ bias)`. Buffers: `x f32 [rows, k]`, `w [n, k]` (`weight_dtype`),
    /// then `bias [n]` where `bias`, then `out f32 [rows, n]`. Parallel range: output columns.
    Matmul {
        /// Rows of `x`.
        rows: Rows,
        /// Output features.
        n: u64,
        /// Input features.
        k: u64,
        /// Element type of `w` and `bias`.
        weight_dtype: DType,
        /// Whether a bias follows `w`.
        bias: bool,
    },
    /// SwiGLU experts weighted by a dense routing matrix:
    /// `out[t] = Σ_e routing[t, e] · down_e(silu(gate_e · x[t]) · (up_e · x[t]))` over experts
    /// with a non-zero weight. Buffers: `x [rows, hidden]`, `routing [rows, experts]`, then per
    /// expert `gate [ffn, hidden]`, `up [ffn, hidden]`, `down [hidden, ffn]`, then `out`.
    /// Parallel range: experts (the executor sums partial outputs).
    MoeExperts {
        /// Rows.
        rows: Rows,
        /// Model width.
        hidden: u64,
        /// Expert MLP width.
        ffn: u64,
        /// Experts.
        experts: u64,
        /// Element type of the expert weights.
        weight_dtype: DType,
    },
    /// `out[i] = 0` for `i < elements`. Buffers: `out [elements]` (`dtype`, a 1-, 2-, 4- or
    /// 8-byte type). Parallel range: elements.
    Zeros {
        /// Elements.
        elements: u64,
        /// Element type.
        dtype: DType,
    },
    /// The experts an expert-parallel rank holds: `out[i] = rank[0] · experts_per_rank + i`.
    /// Buffers: `rank i32 [1]`, `out i32 [experts_per_rank]`. Parallel range: `0..experts_per_rank`.
    RankExperts {
        /// Experts per rank.
        experts_per_rank: u64,
    },
    /// Multi-head latent attention, decompressed (the step's latents already stored by a
    /// one-plane [`KernelBody::KvStore`]): for each sequence, its cached latents `c_j`
    /// (the first `head_dim - rope` values of a slot) and rope keys (the rest) are expanded per
    /// head into keys `[w_uk[h]ᵀ c_j | k_rope_j]` and values `w_uv[h] c_j`; each query row at
    /// position `p` attends over `j <= p` with scores `(q_nope·k_nope + q_rope·k_rope) · scale`.
    /// Buffers: `q_nope f32 [T, heads, nope]`, `q_rope f32 [T, heads, rope]`,
    /// `w_uk [heads, head_dim - rope, nope]`, `w_uv [heads, value, head_dim - rope]`
    /// (`weight_dtype`), `kv_cache`, `kv_lookup_table [B, P]`, `cache_lengths [B]`,
    /// `input_row_offsets [B+1]`, `batch_context_lengths [B]` (each sequence's cached plus new
    /// tokens: the latents expanded), `out f32 [T, heads, value]`. Parallel range: heads (a
    /// library kernel on the CPU).
    DecompressedAttention {
        /// The layer's slot in the cache.
        layer: u64,
        /// Layers in the cache.
        num_layers: u64,
        /// Query heads.
        heads: u64,
        /// Elements of a cached latent slot (latent and rope key).
        head_dim: u64,
        /// Tokens per page.
        page_size: u64,
        /// Rope elements per head (the slot's last ones).
        rope: u64,
        /// Non-rotating query/key elements per head.
        nope: u64,
        /// Value elements per head.
        value: u64,
        /// Score scale.
        scale: f32,
        /// Element type of the up-projections.
        weight_dtype: DType,
        /// What the cache stores.
        kv_dtype: KvDtype,
    },
    /// `out[r, g, :] = [a[r, g, :] | b[r, g, :]]`. Buffers: `a f32 [rows, groups, a]`,
    /// `b f32 [rows, groups, b]`, `out f32 [rows, groups, a + b]`. Parallel range: rows.
    Concat {
        /// Rows.
        rows: Rows,
        /// Groups (heads) per row.
        groups: u64,
        /// Width of `a`'s groups.
        a: u64,
        /// Width of `b`'s groups.
        b: u64,
    },
    /// Each head its own linear map: `out[r, h, :] = w[h] · x[r, h, :]`. Buffers:
    /// `x f32 [rows, heads, k]`, `w [heads, n, k]` (`weight_dtype`, a float type),
    /// `out f32 [rows, heads, n]`. Parallel range: heads.
    HeadMatmul {
        /// Rows.
        rows: Rows,
        /// Heads.
        heads: u64,
        /// Output features per head.
        n: u64,
        /// Input features per head.
        k: u64,
        /// Element type of `w`.
        weight_dtype: DType,
    },
    /// Group-limited top-k routing (DeepSeek's router): per row, scores `s` from the logits,
    /// choice scores `c = s + bias`; the experts in `n_group` groups of consecutive experts,
    /// each group scored by `group_score`; the `topk_group` best groups kept (ties: lower
    /// index), then the `top_k` largest `c` among their experts chosen (ties: lower index).
    /// A chosen expert gets `s`, over the chosen ones' sum plus 1e-20 where `renormalize`,
    /// times `scale`; the others 0. Buffers: `logits f32 [rows, experts]`, `bias [experts]`
    /// (`bias_dtype`), `out f32 [rows, experts]`. Parallel range: rows.
    MoeRouter {
        /// Rows.
        rows: Rows,
        /// Experts.
        experts: u64,
        /// Experts chosen per row.
        top_k: u64,
        /// Groups of experts.
        n_group: u64,
        /// Groups kept per row.
        topk_group: u64,
        /// How logits become scores.
        scoring: RouterScoring,
        /// How a group is scored.
        group_score: GroupScore,
        /// Whether the chosen weights are divided by their sum.
        renormalize: bool,
        /// What the chosen weights are multiplied by.
        scale: f32,
        /// Element type of `bias`.
        bias_dtype: DType,
    },
    // (Last, so that the other bodies' encodings, and the kernel names hashed from them,
    // stay as they were.)
    /// Every tensor-parallel rank's `x` summed element-wise, ranks added in rank order:
    /// `out[r, c] = Σ_rank x_rank[r, c]`, the same bits on every rank. Buffers: `x f32 [rows,
    /// cols]`, `out f32 [rows, cols]`. Parallel range: none (the executor's communicator runs
    /// it).
    AllReduce {
        /// Rows.
        rows: Rows,
        /// Values per row.
        cols: u64,
    },
    /// `out[r, p · cols + c] = x_p[r, c]`: every tensor-parallel rank's rows side by side, in
    /// rank order, the same on every rank. Buffers: `x f32 [rows, cols]`, `out f32 [rows,
    /// ranks · cols]`. Parallel range: none (the executor's communicator runs it).
    AllGather {
        /// Rows.
        rows: Rows,
        /// Values per row on each rank.
        cols: u64,
        /// Ranks of the group.
        ranks: u64,
    },
}

/// One layer's view of the paged KV cache `[pages, num_layers, planes, kv_heads, page_size,
/// row]`, each row `head_dim` values in `dtype` ([`KvDtype::row_bytes`]): what a
/// [`KernelBody::KvStore`] or [`KernelBody::Attention`] reads of its body
/// ([`KernelBody::kv_view`]), the one definition of the cache's addressing that both backends,
/// the validator and the executors use. Offsets and sizes are in bytes.
///
/// Head-major within a page: a KV head's rows for the page's positions lie back to back, so
/// decode attention, which reads one head's keys and values over many positions, reads
/// contiguous runs of `page_size` rows that the hardware prefetchers follow (a token-major
/// page put each head's row a slot of every head apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvView {
    /// The layer's slot in the cache.
    pub layer: u64,
    /// Layers in the cache.
    pub num_layers: u64,
    /// KV heads.
    pub kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Planes of a layer slot: 2 (keys, then values) or 1 (a latent, its own value).
    pub planes: u64,
    /// What a row's values are stored as.
    pub dtype: KvDtype,
}

impl KvView {
    /// The checked view of a KV store or attention kernel's `body` (its message names the
    /// field, or says the kernel has no cache).
    pub fn of(body: &KernelBody) -> Result<KvView, String> {
        let view = body
            .kv_view()
            .ok_or_else(|| format!("a {} kernel reads no KV cache", body.kind()))?;
        view.check()?;
        Ok(view)
    }

    /// The shape of one page in rows, `[num_layers, planes, kv_heads, page_size]`.
    pub fn page_rows(&self) -> [u64; 4] {
        [self.num_layers, self.planes, self.kv_heads, self.page_size]
    }

    /// Checks that every size is non-zero, the layer lies in the cache, rows of `head_dim`
    /// fit the dtype and a page's bytes fit in a `u64`; the message names the field.
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("num_layers", self.num_layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("page_size", self.page_size),
        ] {
            if v == 0 {
                return Err(format!("`{name}` is 0, expected at least 1"));
            }
        }
        if !(1..=2).contains(&self.planes) {
            return Err(format!("`planes` is {}, expected 1 or 2", self.planes));
        }
        if self.layer >= self.num_layers {
            return Err(format!(
                "`layer` is {}, expected below `num_layers` = {}",
                self.layer, self.num_layers
            ));
        }
        self.dtype.check_head_dim(self.head_dim)?;
        self.page_rows()
            .iter()
            .chain(&[self.head_dim, 4])
            .try_fold(1u64, |acc, &v| acc.checked_mul(v))
            .map(|_| ())
            .ok_or_else(|| {
                "bytes per cache page (num_layers × planes × page_size × kv_heads × head_dim × 4) overflow u64"
                    .to_string()
            })
    }

    /// Bytes of one row (one token's keys or values of one KV head).
    pub fn row_bytes(&self) -> u64 {
        self.dtype.row_bytes(self.head_dim)
    }

    /// Bytes from one position's row of a KV head to the next position's in a page: the rows
    /// of one head lie back to back.
    pub fn pos_stride(&self) -> u64 {
        self.row_bytes()
    }

    /// Bytes of one KV head's rows in a layer's keys (or values) of a page, and so the distance
    /// from one head's rows to the next head's.
    pub fn head_stride(&self) -> u64 {
        self.page_size * self.row_bytes()
    }

    /// Bytes of one layer's keys (or values) in a page.
    pub fn block_bytes(&self) -> u64 {
        self.kv_heads * self.head_stride()
    }

    /// Bytes of one page (every layer's planes).
    pub fn page_bytes(&self) -> u64 {
        self.num_layers * self.planes * self.block_bytes()
    }

    /// Offset in a page of this layer's keys (`which = 0`) or values (`which = 1`); with one
    /// plane the values are read from the keys' block.
    pub fn block_offset(&self, which: u64) -> u64 {
        (self.layer * self.planes + which.min(self.planes - 1)) * self.block_bytes()
    }

    /// Offset in the cache of the keys (`which = 0`) or values (`which = 1`) of KV head `kvh`
    /// at token `pos` of `page` (`pos < page_size`).
    pub fn offset(&self, page: u64, which: u64, pos: u64, kvh: u64) -> u64 {
        page * self.page_bytes()
            + self.block_offset(which)
            + kvh * self.head_stride()
            + pos * self.pos_stride()
    }
}

impl KernelBody {
    /// The KV cache view of a KV store or attention kernel (`None` for the others).
    pub fn kv_view(&self) -> Option<KvView> {
        match *self {
            KernelBody::KvStore {
                layer,
                num_layers,
                kv_heads,
                head_dim,
                page_size,
                planes,
                kv_dtype,
            }
            | KernelBody::Attention {
                layer,
                num_layers,
                kv_heads,
                head_dim,
                page_size,
                planes,
                kv_dtype,
                ..
            } => Some(KvView {
                layer,
                num_layers,
                kv_heads,
                head_dim,
                page_size,
                planes,
                dtype: kv_dtype,
            }),
            KernelBody::DecompressedAttention {
                layer,
                num_layers,
                head_dim,
                page_size,
                kv_dtype,
                ..
            } => Some(KvView {
                layer,
                num_layers,
                kv_heads: 1,
                head_dim,
                page_size,
                planes: 1,
                dtype: kv_dtype,
            }),
            _ => None,
        }
    }

    /// The kernel kind's short name.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelBody::Gather { .. } => "gather",
            KernelBody::Positions => "positions",
            KernelBody::RmsNorm { .. } => "rms_norm",
            KernelBody::Elementwise { .. } => "elementwise",
            KernelBody::Rope { .. } => "rope",
            KernelBody::KvStore { .. } => "kv_store",
            KernelBody::Attention { .. } => "attention",
            KernelBody::Softmax { .. } => "softmax",
            KernelBody::TopK { .. } => "top_k",
            KernelBody::Matmul { .. } => "matmul",
            KernelBody::MoeExperts { .. } => "moe_experts",
            KernelBody::Zeros { .. } => "zeros",
            KernelBody::RankExperts { .. } => "rank_experts",
            KernelBody::AllReduce { .. } => "all_reduce",
            KernelBody::AllGather { .. } => "all_gather",
            KernelBody::Concat { .. } => "concat",
            KernelBody::DecompressedAttention { .. } => "decompressed_attention",
            KernelBody::HeadMatmul { .. } => "head_matmul",
            KernelBody::MoeRouter { .. } => "moe_router",
        }
    }

    /// The extent of the parallel range for the step sizes `dims`.
    pub fn parallel_extent(&self, dims: &[u64; StepDim::COUNT]) -> u64 {
        let rows = |r: &Rows| match r {
            Rows::Step(d) => dims[*d as usize],
            Rows::Fixed(n) => *n,
        };
        let t = dims[StepDim::TotalSeqLen as usize];
        match self {
            KernelBody::Gather { rows: r, .. }
            | KernelBody::RmsNorm { rows: r, .. }
            | KernelBody::Elementwise { rows: r, .. }
            | KernelBody::Softmax { rows: r, .. }
            | KernelBody::TopK { rows: r, .. }
            | KernelBody::Concat { rows: r, .. }
            | KernelBody::AllReduce { rows: r, .. }
            | KernelBody::AllGather { rows: r, .. }
            | KernelBody::MoeRouter { rows: r, .. } => rows(r),
            KernelBody::HeadMatmul { heads, .. }
            | KernelBody::DecompressedAttention { heads, .. } => *heads,
            KernelBody::Positions => dims[StepDim::BatchSize as usize],
            KernelBody::Rope { .. } | KernelBody::KvStore { .. } => t,
            KernelBody::Attention { kv_heads, .. } => t.saturating_mul(*kv_heads),
            KernelBody::Matmul { n, .. } => *n,
            KernelBody::MoeExperts { experts, .. } => *experts,
            KernelBody::Zeros { elements, .. } => *elements,
            KernelBody::RankExperts { experts_per_rank } => *experts_per_rank,
        }
    }

    /// A rough count of the elements the kernel touches at these step sizes, to decide whether
    /// splitting its parallel range across threads pays.
    pub fn work(&self, dims: &[u64; StepDim::COUNT]) -> u64 {
        let t = dims[StepDim::TotalSeqLen as usize];
        let width = match self {
            KernelBody::Gather { cols, .. }
            | KernelBody::RmsNorm { cols, .. }
            | KernelBody::Elementwise { cols, .. }
            | KernelBody::Softmax { cols, .. }
            | KernelBody::TopK { cols, .. }
            | KernelBody::AllReduce { cols, .. } => *cols,
            KernelBody::AllGather { cols, ranks, .. } => cols * ranks,
            KernelBody::Concat { groups, a, b, .. } => groups * (a + b),
            KernelBody::DecompressedAttention {
                head_dim,
                nope,
                value,
                page_size,
                ..
            } => t * head_dim * (nope + value) * page_size,
            KernelBody::MoeRouter { experts, .. } => experts * 4,
            KernelBody::HeadMatmul { rows, n, k, .. } => {
                n * k
                    * match rows {
                        Rows::Step(d) => dims[*d as usize],
                        Rows::Fixed(r) => *r,
                    }
            }
            KernelBody::Positions => t / dims[StepDim::BatchSize as usize].max(1),
            KernelBody::Rope {
                heads, head_dim, ..
            } => heads * head_dim,
            KernelBody::KvStore {
                kv_heads,
                head_dim,
                planes,
                ..
            } => planes * kv_heads * head_dim,
            // Each row reads its whole context: assume a page's worth at least.
            KernelBody::Attention {
                heads,
                head_dim,
                page_size,
                ..
            } => heads * head_dim * page_size,
            KernelBody::Matmul { rows, k, .. } => {
                k * match rows {
                    Rows::Step(d) => dims[*d as usize],
                    Rows::Fixed(n) => *n,
                }
            }
            KernelBody::MoeExperts { hidden, ffn, .. } => hidden * ffn * t,
            KernelBody::Zeros { .. } | KernelBody::RankExperts { .. } => 1,
        };
        self.parallel_extent(dims).saturating_mul(width)
    }

    /// sha256 of [`KERNEL_CONTRACT`] and the body's bincode encoding: what native code records
    /// of the body (and the contract) it was compiled from.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::Digest;
        let bytes =
            bincode::serde::encode_to_vec(self, crate::bincode_config()).unwrap_or_default();
        let mut h = sha2::Sha256::new();
        h.update(KERNEL_CONTRACT.as_bytes());
        h.update(&bytes);
        h.finalize().into()
    }

    /// Whether the kernel reads weights stored in a GGUF block type.
    pub fn reads_blocks(&self) -> bool {
        match self {
            KernelBody::Gather { src_dtype: d, .. }
            | KernelBody::Matmul {
                weight_dtype: d, ..
            }
            | KernelBody::MoeExperts {
                weight_dtype: d, ..
            } => d.is_quantized(),
            _ => false,
        }
    }

    /// Whether the CPU backend always runs this kernel as generated native code. Matmuls run
    /// generated or as a library kernel as the CPU module says; the MoE experts and router, the
    /// per-head matmuls and every kernel that reads blocks run as library kernels of the
    /// runtime.
    pub fn is_generated_on_cpu(&self) -> bool {
        !matches!(
            self,
            KernelBody::Matmul { .. }
                | KernelBody::MoeExperts { .. }
                | KernelBody::HeadMatmul { .. }
                | KernelBody::MoeRouter { .. }
                | KernelBody::DecompressedAttention { .. }
                | KernelBody::AllReduce { .. }
                | KernelBody::AllGather { .. }
        ) && !self.reads_blocks()
    }
}

/// One dimension of a CUDA launch grid, computed per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GridExtent {
    /// A constant number of blocks.
    Fixed(u64),
    /// `ceil(rows / by)` blocks, with `rows` a step dim or constant (at least one block is not
    /// guaranteed: zero rows launch nothing).
    CeilDiv {
        /// What is divided.
        rows: Rows,
        /// Items per block.
        by: u64,
    },
}

/// How a CUDA kernel is launched. Kernel parameters are the kernel's buffers as device
/// pointers, in the order its [`KernelBody`] variant documents, followed by the step dims as
/// five `unsigned long long` values in [`StepDim`] slot order. Every kernel guards its indices
/// against those dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaLaunch {
    /// Blocks in x, y, z.
    pub grid: [GridExtent; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}
