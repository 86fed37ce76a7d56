//! The interpreter's kernels: plain f32 loops, written to be obviously right, not fast.

use crate::ir::KvLayout;

/// `out[m, n] = Σ_k x[m, k] · w[n, k]`.
pub fn linear(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
    let n = w.len() / k;
    let mut out = Vec::with_capacity(x.len() / k * n);
    for row in x.chunks_exact(k) {
        for wrow in w.chunks_exact(k) {
            out.push(row.iter().zip(wrow).map(|(a, b)| a * b).sum());
        }
    }
    out
}

/// Elementwise `f(a, b)`, `b` repeated over `a`'s leading dims.
pub fn broadcast(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    a.iter()
        .enumerate()
        .map(|(i, &x)| f(x, b[i % b.len()]))
        .collect()
}

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// RMSNorm over rows of `w.len()`.
/// GELU, tanh approximation, as transformers' `gelu_pytorch_tanh` writes it.
pub fn gelu_tanh(x: f32) -> f32 {
    let inner = (2.0f32 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

pub fn rms_norm(x: &[f32], w: &[f32], (eps, offset): (f32, f32)) -> Vec<f32> {
    let h = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(h) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| (g + offset) * (v * r)));
    }
    out
}

/// Softmax over rows of `n`.
pub fn softmax(x: &[f32], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = row.iter().map(|v| (v - m).exp()).collect();
        let s: f32 = e.iter().sum();
        out.extend(e.iter().map(|v| v / s));
    }
    out
}

/// Keeps each row's `k` largest entries (ties: lower index), optionally renormalized.
pub fn top_k(x: &[f32], n: usize, k: usize, renormalize: bool) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (row, orow) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let sum: f32 = idx[..k].iter().map(|&i| row[i]).sum();
        for &i in &idx[..k] {
            orow[i] = if renormalize { row[i] / sum } else { row[i] };
        }
    }
    out
}

/// Rotary embedding, rotate-half layout, on `x [T, H, D]`.
pub fn rope(
    x: &[f32],
    positions: &[i64],
    heads: usize,
    table: &maxc_schema::RopeTable,
) -> Vec<f32> {
    let half = table.half();
    // Heads of `d` values, their first `2 · half` rotated (the rest as they are).
    let d = x.len() / positions.len().max(1) / heads.max(1);
    let mut out = x.to_vec();
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * d;
            for i in 0..half {
                let (cos, sin) = table.cos_sin(pos as u64, i);
                let (x1, x2) = (x[base + i], x[base + half + i]);
                out[base + i] = x1 * cos - x2 * sin;
                out[base + half + i] = x2 * cos + x1 * sin;
            }
        }
    }
    out
}

/// The per-step view of a ragged batch over a paged KV cache.
pub struct PagedBatch<'a> {
    /// Row offsets of each sequence, `B + 1` of them.
    pub row_offsets: &'a [i64],
    /// Tokens already cached per sequence.
    pub cache_lengths: &'a [i64],
    /// Columns of each page group's `[B, pages_per_seq]` lookup table.
    pub pages_per_seq: usize,
}

impl PagedBatch<'_> {
    /// The sequence of each row, and its position.
    pub fn rows(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.cache_lengths.len()).flat_map(move |b| {
            let (start, end) = (
                self.row_offsets[b] as usize,
                self.row_offsets[b + 1] as usize,
            );
            (start..end).map(move |r| (r, b, self.cache_lengths[b] as usize + (r - start)))
        })
    }
}

/// One layer's place in the paged cache: its page group's lookup table and its page slot.
struct LayerView<'a> {
    l: &'a KvLayout,
    lookup: &'a [i64],
    pages_per_seq: usize,
    slot: usize,
}

impl LayerView<'_> {
    /// The flat cache offset of (plane `kv`: k or v, token `pos` of sequence `b`, kv head `h`).
    fn at(&self, kv: usize, b: usize, pos: usize, h: usize) -> usize {
        let l = self.l;
        let page = self.lookup[b * self.pages_per_seq + pos / l.page_size] as usize;
        ((((page * l.num_layers + self.slot) * l.planes + kv) * l.num_kv_heads + h) * l.page_size
            + pos % l.page_size)
            * l.head_dim
    }
}

/// Writes the step's `k` and `v` (`[T, Hkv, D]`) into decoder layer `layer`'s slot of the
/// cache, through its page group's `lookup` table (`[B, pages_per_seq]`), then computes causal
/// attention of every row of `q` (`[T, Hq, D]`) over its sequence's positions `0..=pos` (the
/// last `window` of them).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (cache, lookup): (&mut [f32], &[i64]),
    hq: usize,
    l: &KvLayout,
    (layer, window): (usize, Option<usize>),
    scale: f32,
    batch: &PagedBatch<'_>,
) -> Vec<f32> {
    let (hkv, d) = (l.num_kv_heads, l.head_dim);
    let view = LayerView {
        l,
        lookup,
        pages_per_seq: batch.pages_per_seq,
        slot: l.slot(layer).map_or(layer, |s| s.slot),
    };
    for (r, b, pos) in batch.rows() {
        for h in 0..hkv {
            let src = (r * hkv + h) * d;
            let ks = view.at(0, b, pos, h);
            cache[ks..ks + d].copy_from_slice(&k[src..src + d]);
            l.dtype.round_row(&mut cache[ks..ks + d]);
            let vs = view.at(1, b, pos, h);
            cache[vs..vs + d].copy_from_slice(&v[src..src + d]);
            l.dtype.round_row(&mut cache[vs..vs + d]);
        }
    }
    let group = hq / hkv;
    let mut out = vec![0.0; q.len()];
    for (r, b, pos) in batch.rows() {
        for h in 0..hq {
            let qv = &q[(r * hq + h) * d..][..d];
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let scores: Vec<f32> = (first..=pos)
                .map(|j| {
                    let ks = view.at(0, b, j, h / group);
                    qv.iter()
                        .zip(&cache[ks..ks + d])
                        .map(|(a, c)| a * c)
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let probs = softmax(&scores, scores.len());
            let o = &mut out[(r * hq + h) * d..][..d];
            for (j, p) in (first..).zip(&probs) {
                let vs = view.at(1, b, j, h / group);
                for (acc, val) in o.iter_mut().zip(&cache[vs..vs + d]) {
                    *acc += p * val;
                }
            }
        }
    }
    out
}

/// `a [rows, wa]` and `b [rows, wb]` side by side: `[rows, wa + wb]`.
pub fn concat(a: &[f32], b: &[f32], wa: usize, wb: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    for (ra, rb) in a.chunks_exact(wa).zip(b.chunks_exact(wb)) {
        out.extend_from_slice(ra);
        out.extend_from_slice(rb);
    }
    out
}

/// `out[t, h] = w[h] · x[t, h]` for `x [T, H, K]`, `w [H, N, K]`.
pub fn head_linear(x: &[f32], w: &[f32], heads: usize, k: usize) -> Vec<f32> {
    let n = w.len() / heads / k;
    let mut out = Vec::with_capacity(x.len() / k * n);
    for row in x.chunks_exact(heads * k) {
        for (h, xh) in row.chunks_exact(k).enumerate() {
            out.extend(linear(xh, &w[h * n * k..(h + 1) * n * k], k));
        }
    }
    out
}

/// Writes each row's latent slot of `kv [T, 1, D]` into decoder layer `layer`'s slot of a
/// one-plane cache; returns the layer's view.
fn store_latents<'a>(
    kv: &[f32],
    (cache, lookup): (&mut [f32], &'a [i64]),
    l: &'a KvLayout,
    layer: usize,
    batch: &PagedBatch<'_>,
) -> LayerView<'a> {
    let d = l.head_dim;
    let view = LayerView {
        l,
        lookup,
        pages_per_seq: batch.pages_per_seq,
        slot: l.slot(layer).map_or(layer, |s| s.slot),
    };
    for (r, b, pos) in batch.rows() {
        let at = view.at(0, b, pos, 0);
        cache[at..at + d].copy_from_slice(&kv[r * d..(r + 1) * d]);
        l.dtype.round_row(&mut cache[at..at + d]);
    }
    view
}

/// Writes each row's latent `kv [T, 1, D]` into decoder layer `layer`'s slot of a one-plane
/// cache, then attends every head of `q [T, H, D]` over its sequence's latents `0..=pos`:
/// keys the whole latent, values its first `value_dim` elements. Out `[T, H, value_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn latent_attention(
    q: &[f32],
    kv: &[f32],
    (cache, lookup): (&mut [f32], &[i64]),
    heads: usize,
    l: &KvLayout,
    (layer, value_dim): (usize, usize),
    scale: f32,
    batch: &PagedBatch<'_>,
) -> Vec<f32> {
    let d = l.head_dim;
    let view = store_latents(kv, (cache, lookup), l, layer, batch);
    let mut out = vec![0.0; q.len() / d * value_dim];
    for (r, b, pos) in batch.rows() {
        for h in 0..heads {
            let qv = &q[(r * heads + h) * d..][..d];
            let scores: Vec<f32> = (0..=pos)
                .map(|j| {
                    let at = view.at(0, b, j, 0);
                    qv.iter()
                        .zip(&cache[at..at + d])
                        .map(|(a, c)| a * c)
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let probs = softmax(&scores, scores.len());
            let o = &mut out[(r * heads + h) * value_dim..][..value_dim];
            for (j, p) in probs.iter().enumerate() {
                let at = view.at(0, b, j, 0);
                for (acc, v) in o.iter_mut().zip(&cache[at..at + value_dim]) {
                    *acc += p * v;
                }
            }
        }
    }
    out
}

/// Multi-head latent attention decompressed (see `Op::DecompressedLatentAttention`): stores
/// each row's latent `kv [T, 1, C + R]`, then per head keys `[W_UK_h c_j | k_rope_j]` and
/// values `W_UV_h c_j`, plain softmax attention. `w_uk [H, C, N]`, `w_uv [H, V, C]`.
#[allow(clippy::too_many_arguments)]
pub fn decompressed_latent_attention(
    (q_nope, q_rope): (&[f32], &[f32]),
    kv: &[f32],
    (w_uk, w_uv): (&[f32], &[f32]),
    (cache, lookup): (&mut [f32], &[i64]),
    (heads, nope, value): (usize, usize, usize),
    l: &KvLayout,
    layer: usize,
    scale: f32,
    batch: &PagedBatch<'_>,
) -> Vec<f32> {
    let d = l.head_dim;
    let lat = w_uv.len() / heads / value;
    let rope = d - lat;
    let view = store_latents(kv, (cache, lookup), l, layer, batch);
    let rows = q_nope.len() / heads / nope;
    let mut out = vec![0.0; rows * heads * value];
    for (r, b, pos) in batch.rows() {
        for h in 0..heads {
            let qn = &q_nope[(r * heads + h) * nope..][..nope];
            let qr = &q_rope[(r * heads + h) * rope..][..rope];
            let uk = &w_uk[h * lat * nope..(h + 1) * lat * nope];
            let uv = &w_uv[h * value * lat..(h + 1) * value * lat];
            let latent = |j: usize| {
                let at = view.at(0, b, j, 0);
                cache[at..at + d].to_vec()
            };
            let scores: Vec<f32> = (0..=pos)
                .map(|j| {
                    let c = latent(j);
                    // k_nope[n] = Σ_c W_UK[n, c] · latent[c], W_UK[n, c] = w_uk[h][c][n].
                    let k_nope: f32 = (0..nope)
                        .map(|n| qn[n] * (0..lat).map(|i| uk[i * nope + n] * c[i]).sum::<f32>())
                        .sum();
                    let k_rope: f32 = qr.iter().zip(&c[lat..]).map(|(a, b)| a * b).sum();
                    (k_nope + k_rope) * scale
                })
                .collect();
            let probs = softmax(&scores, scores.len());
            let o = &mut out[(r * heads + h) * value..][..value];
            for (j, p) in probs.iter().enumerate() {
                let c = latent(j);
                for (v, acc) in o.iter_mut().enumerate() {
                    *acc += p * uv[v * lat..(v + 1) * lat]
                        .iter()
                        .zip(&c)
                        .map(|(a, b)| a * b)
                        .sum::<f32>();
                }
            }
        }
    }
    out
}

/// Group-limited top-k routing of `logits [T, E]` (see `Op::MoeRouter`).
pub fn moe_router(logits: &[f32], bias: &[f32], op: &crate::ir::Op) -> Vec<f32> {
    use crate::ir::{GroupScore, Op, RouterScoring};
    let Op::MoeRouter {
        top_k,
        n_group,
        topk_group,
        scoring,
        group_score,
        renormalize,
        scale,
    } = *op
    else {
        unreachable!("moe_router runs Op::MoeRouter")
    };
    let e = bias.len();
    let per = e / n_group;
    let mut out = vec![0.0; logits.len()];
    for (row, orow) in logits.chunks_exact(e).zip(out.chunks_exact_mut(e)) {
        let s: Vec<f32> = match scoring {
            RouterScoring::Sigmoid => row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
            RouterScoring::Softmax => softmax(row, e),
        };
        let c: Vec<f32> = s.iter().zip(bias).map(|(s, b)| s + b).collect();
        let group: Vec<f32> = (0..n_group)
            .map(|g| {
                let members = g * per..(g + 1) * per;
                match group_score {
                    GroupScore::Max => s[members].iter().copied().fold(f32::NEG_INFINITY, f32::max),
                    GroupScore::TopTwoSum => {
                        let mut m: Vec<f32> = c[members].to_vec();
                        m.sort_by(|a, b| b.total_cmp(a));
                        m.iter().take(2).sum()
                    }
                }
            })
            .collect();
        let mut groups: Vec<usize> = (0..n_group).collect();
        groups.sort_by(|&a, &b| group[b].total_cmp(&group[a]).then(a.cmp(&b)));
        let kept = &groups[..topk_group];
        let mut experts: Vec<usize> = (0..e).filter(|x| kept.contains(&(x / per))).collect();
        experts.sort_by(|&a, &b| c[b].total_cmp(&c[a]).then(a.cmp(&b)));
        let chosen = &experts[..top_k];
        let sum: f32 = chosen.iter().map(|&x| s[x]).sum::<f32>() + 1e-20;
        for &x in chosen {
            orow[x] = if renormalize { s[x] / sum } else { s[x] } * scale;
        }
    }
    out
}
