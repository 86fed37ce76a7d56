//! Causal attention over the paged KV cache on AVX-512 or AVX2 + FMA, blocked for prefill: the
//! library version of [`maxc_schema::KernelBody::Attention`], which the executor prefers where
//! either runs ([`available`]).
//!
//! Work items are (sequence, KV head, block of up to [`ROW_BLOCK`] query rows): the block's
//! query heads of the KV head's group are gathered into one matrix, their scores against every
//! key they can see are one tiled matmul per cache page (each key row read once for all of
//! them), the softmax is exact (max, then `exp` in sixteen lanes, then the sum; a row's keys
//! after its position are masked to zero), and the weighted values are summed with the
//! accumulators in registers. Small steps (decode) split KV groups into single heads so that
//! every thread has work.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::tile::{self, lane_mask, F32Rows};

/// Query rows of one sequence per work item.
const ROW_BLOCK: usize = 16;

/// The shape of one attention launch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub layer: usize,
    pub num_layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
    pub scale: f32,
}

/// The step's sequence bookkeeping (validated by `StepInputs::checked_dims`).
pub(crate) struct Seqs<'a> {
    /// `input_row_offsets [B + 1]`.
    pub offsets: &'a [i32],
    /// `cache_lengths [B]`.
    pub cache_lengths: &'a [i32],
    /// `kv_lookup_table [B, pages_per_seq]`.
    pub lookup: &'a [i32],
    /// The lookup table's row length.
    pub pages_per_seq: usize,
}

#[derive(Clone, Copy)]
struct Item {
    seq: usize,
    /// First query row (global) and row count.
    row: usize,
    rows: usize,
    /// Query heads `head..head + group`.
    head: usize,
    group: usize,
}

#[derive(Clone, Copy)]
struct Ptrs {
    q: *const f32,
    cache: *const f32,
    out: *mut f32,
}
// SAFETY: items write disjoint (row, head) slices of `out`; `q` and the cache are only read.
unsafe impl Send for Ptrs {}
unsafe impl Sync for Ptrs {}

/// A thread's working memory, kept between calls.
#[derive(Default)]
struct Scratch {
    /// Gathered queries `[nq, head_dim]`.
    qs: Vec<f32>,
    /// Scores, then weights, `[nq, keys rounded up to 16]`.
    scores: Vec<f32>,
    /// Each query's sum of weights.
    sums: Vec<f32>,
    /// Weighted values `[nq, head_dim]`.
    acc: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// `out[r, h, :] = softmax(q[r, h, :] · K[..=p]ᵀ · scale) · V[..=p]` for every token row `r`
/// (position `p` in its sequence) and query head `h`, keys and values of KV head
/// `h / (heads / kv_heads)` read from the paged cache.
///
/// # Safety
/// [`tile::available`] holds; `q` and `out` hold `rows × heads × head_dim` values; `cache` is
/// the whole cache, and every page the sequences use (checked by `StepInputs::checked_dims`)
/// lies inside it.
pub(crate) unsafe fn attention(
    q: *const f32,
    cache: *const f32,
    out: *mut f32,
    seqs: &Seqs,
    shape: Shape,
    threads: usize,
) {
    let group = shape.heads / shape.kv_heads;
    let mut items = Vec::new();
    for b in 0..seqs.cache_lengths.len() {
        let (r0, r1) = (seqs.offsets[b] as usize, seqs.offsets[b + 1] as usize);
        let mut r = r0;
        while r < r1 {
            let rows = ROW_BLOCK.min(r1 - r);
            for kvh in 0..shape.kv_heads {
                items.push(Item {
                    seq: b,
                    row: r,
                    rows,
                    head: kvh * group,
                    group,
                });
            }
            r += rows;
        }
    }
    let threads = threads.max(1);
    if items.len() < 2 * threads && group > 1 {
        items = items
            .iter()
            .flat_map(|it| {
                (0..it.group).map(move |g| Item {
                    head: it.head + g,
                    group: 1,
                    ..*it
                })
            })
            .collect();
    }
    // Later blocks of a sequence see more keys: dealing items round-robin balances them. A
    // step of single rows (decode) instead gives each thread consecutive items, a sequence's
    // KV heads together: their keys and values interleave in the same pages, so the lines the
    // hardware fetches beside one head's are the next head's (measured: 8% less attention
    // time at 1800 tokens of context, batch 4).
    let chunks = threads.min(items.len());
    let single_rows = items.iter().all(|it| it.rows == 1);
    let p = &Ptrs { q, cache, out };
    let items = &items;
    super::pool::run(chunks, &|c| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            // (first item, stride, count) of this thread's share.
            let (first, stride, count) = if single_rows {
                let (a, b) = (items.len() * c / chunks, items.len() * (c + 1) / chunks);
                (a, 1, b - a)
            } else {
                (c, chunks, items.len())
            };
            let avx512 = tile::available();
            for it in items.iter().skip(first).step_by(stride).take(count) {
                // SAFETY: as this function's contract (the CPU has AVX-512 where `avx512`,
                // else AVX2 + FMA); items are in bounds by construction.
                unsafe {
                    if avx512 {
                        attend_avx512(*p, seqs, shape, *it, &mut s)
                    } else {
                        attend_avx2(*p, seqs, shape, *it, &mut s)
                    }
                };
            }
        });
    });
}

/// Whether [`attention`] runs on this CPU (AVX-512, or AVX2 + FMA).
pub(crate) fn available() -> bool {
    matches!(
        super::weights::isa(),
        super::weights::Isa::Avx512 | super::weights::Isa::Avx2
    )
}

/// What an instruction set gives [`attend`]: the scores matmul, the softmax of a row and the
/// weighted sum of the values.
pub(crate) trait Kernels {
    /// `out[i·ld + j] = Σ_d q[i·hd + d] · k[j·stride + d]` for `i < nq`, `j < n`; `next` is
    /// the next page's first key rows, to prefetch.
    ///
    /// # Safety
    /// The instruction set is available; the operands hold what the indices reach.
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores(
        q: *const f32,
        nq: usize,
        hd: usize,
        k: F32Rows,
        n: usize,
        out: *mut f32,
        ld: usize,
        next: (F32Rows, usize),
    );
    /// As [`softmax_row`].
    ///
    /// # Safety
    /// The instruction set is available; `row.len()` is a multiple of 16.
    unsafe fn softmax(row: &mut [f32], valid: usize, scale: f32) -> f32;
    /// As [`weighted_values`].
    ///
    /// # Safety
    /// The instruction set is available; as [`weighted_values`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn values(
        scores: &[f32],
        ld: usize,
        nq: usize,
        hd: usize,
        keys: usize,
        page_size: usize,
        slot: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    );
}

struct Avx512;

impl Kernels for Avx512 {
    #[inline(always)]
    unsafe fn scores(
        q: *const f32,
        nq: usize,
        hd: usize,
        k: F32Rows,
        n: usize,
        out: *mut f32,
        ld: usize,
        next: (F32Rows, usize),
    ) {
        // SAFETY: as the trait's contract. The matmul prefetches its own rows ahead; the next
        // page's first ones here.
        unsafe {
            if next.1 > 0 {
                tile::prefetch_strided(next.0, hd, 0, next.1);
            }
            tile::matmul(q, nq, hd, k, n, out, ld)
        }
    }
    #[inline(always)]
    unsafe fn softmax(row: &mut [f32], valid: usize, scale: f32) -> f32 {
        // SAFETY: as the trait's contract.
        unsafe { softmax_row(row, valid, scale) }
    }
    #[inline(always)]
    unsafe fn values(
        scores: &[f32],
        ld: usize,
        nq: usize,
        hd: usize,
        keys: usize,
        page_size: usize,
        slot: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    ) {
        // SAFETY: as the trait's contract.
        unsafe { weighted_values(scores, ld, nq, hd, keys, page_size, slot, values, acc) }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attend_avx512(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { attend::<Avx512>(p, seqs, shape, it, scratch) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { attend::<super::attend_avx2::Avx2>(p, seqs, shape, it, scratch) }
}

#[inline(always)]
unsafe fn attend<K: Kernels>(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    let hd = shape.head_dim;
    let hstride = shape.heads * hd;
    let slot = shape.kv_heads * hd;
    let block = shape.page_size * slot;
    let page_floats = shape.num_layers * 2 * block;
    let kvh = it.head / (shape.heads / shape.kv_heads);
    let first_pos = seqs.cache_lengths[it.seq] as usize + it.row - seqs.offsets[it.seq] as usize;
    let keys = first_pos + it.rows;
    let nq = it.rows * it.group;
    let ld = keys.next_multiple_of(16);
    let Scratch {
        qs,
        scores,
        sums,
        acc,
    } = scratch;
    qs.resize(nq * hd, 0.0);
    scores.resize(nq * ld, 0.0);
    sums.resize(nq, 0.0);
    let scores = &mut scores[..nq * ld];
    // SAFETY (pointer arithmetic below): rows, heads and pages in bounds as the caller
    // guarantees; a page's keys and values for this layer and KV head are `slot` apart.
    unsafe {
        for r in 0..it.rows {
            for g in 0..it.group {
                let src = p.q.add((it.row + r) * hstride + (it.head + g) * hd);
                let dst = &mut qs[(r * it.group + g) * hd..][..hd];
                std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), hd);
            }
        }
        let page_ptr = |pg: usize, which: usize| {
            let page = seqs.lookup[it.seq * seqs.pages_per_seq + pg] as usize;
            p.cache
                .add(page * page_floats + (shape.layer * 2 + which) * block + kvh * hd)
        };
        let pages = keys.div_ceil(shape.page_size);
        let rows_of = |pg: usize, which: usize| F32Rows {
            ptr: page_ptr(pg, which),
            stride: slot,
        };
        for pg in 0..pages {
            let t0 = pg * shape.page_size;
            let n = shape.page_size.min(keys - t0);
            let next = if pg + 1 < pages {
                let first = tile::STRIDED_AHEAD.min(keys - t0 - n);
                (rows_of(pg + 1, 0), first)
            } else {
                (rows_of(pg, 0), 0)
            };
            K::scores(
                qs.as_ptr(),
                nq,
                hd,
                rows_of(pg, 0),
                n,
                scores.as_mut_ptr().add(t0),
                ld,
                next,
            );
        }
        // Softmax: each query sees keys 0..=its position.
        for r in 0..it.rows {
            let valid = first_pos + r + 1;
            for g in 0..it.group {
                let qi = r * it.group + g;
                let row = &mut scores[qi * ld..][..ld];
                sums[qi] = K::softmax(row, valid, shape.scale);
            }
        }
        // Values: out = (scores · V) / sum.
        let values = |pg: usize| page_ptr(pg, 1);
        K::values(
            scores,
            ld,
            nq,
            hd,
            keys,
            shape.page_size,
            slot,
            &values,
            acc,
        );
        for r in 0..it.rows {
            for g in 0..it.group {
                let qi = r * it.group + g;
                let inv = 1.0 / sums[qi];
                let dst = p.out.add((it.row + r) * hstride + (it.head + g) * hd);
                for d in 0..hd {
                    *dst.add(d) = acc[qi * hd + d] * inv;
                }
            }
        }
    }
}

/// Scales `row[..valid]`, replaces it with `exp(s - max)` and zeroes `row[valid..]`; returns
/// the sum of the exponentials.
#[inline(always)]
unsafe fn softmax_row(row: &mut [f32], valid: usize, scale: f32) -> f32 {
    // SAFETY: the caller has AVX-512F; every access is within `row` (whole vectors up to
    // `row.len()`, a multiple of 16, masked past `valid`).
    unsafe {
        let sc = _mm512_set1_ps(scale);
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < valid {
            let mask = lane_mask(valid - i);
            let v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr().add(i)), sc);
            m = _mm512_mask_max_ps(m, mask, m, v);
            i += 16;
        }
        let mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < row.len() {
            let mask = if i < valid { lane_mask(valid - i) } else { 0 };
            let v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr().add(i)), sc);
            let e = _mm512_maskz_mov_ps(mask, exp(_mm512_sub_ps(v, mx)));
            _mm512_storeu_ps(row.as_mut_ptr().add(i), e);
            sum = _mm512_add_ps(sum, e);
            i += 16;
        }
        _mm512_reduce_add_ps(sum)
    }
}

/// The smallest input of the vector `exp`s (smaller ones are clamped to it).
pub(crate) const EXP_MIN: f32 = -87.336_55;
/// `ln 2` in two parts, for `r = x − n·ln2` without cancellation.
pub(crate) const EXP_LN2: (f32, f32) = (0.693_359_4, -2.121_944_4e-4);
/// Cephes' expf polynomial in `r`, highest degree first (then `r²·p + r + 1`).
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x` in sixteen lanes (Cephes' expf: `x = n·ln2 + r`, a degree-6 polynomial in `r`, then
/// `2^n` by `scalef`), within about one ulp; below -87.3 the input is clamped (a result of about
/// 1e-38), above 88.7 the result is infinite.
#[inline(always)]
pub(crate) unsafe fn exp(x: __m512) -> __m512 {
    // SAFETY: the caller has AVX-512F.
    unsafe {
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
        let n = _mm512_roundscale_ps(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2.0), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2.1), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(
            p,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_scalef_ps(y, n)
    }
}

/// `acc[q, :] = Σ_t scores[q, t] · V[t, :]` for `q < nq`, `t < keys`, value rows of page `pg`
/// at `values(pg)`, `slot` apart (AVX-512).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn weighted_values(
    scores: &[f32],
    ld: usize,
    nq: usize,
    hd: usize,
    keys: usize,
    page_size: usize,
    slot: usize,
    values: &dyn Fn(usize) -> *const f32,
    acc: &mut Vec<f32>,
) {
    acc.clear();
    acc.resize(nq * hd, 0.0);
    // SAFETY: the caller has AVX-512F; value rows hold `hd` values.
    unsafe {
        match hd {
            64 => values_in_registers::<4, 6>(scores, ld, nq, keys, page_size, slot, values, acc),
            128 => values_in_registers::<8, 3>(scores, ld, nq, keys, page_size, slot, values, acc),
            _ => values_scalar(scores, ld, nq, hd, keys, page_size, slot, values, acc),
        }
    }
}

/// [`weighted_values`] one value at a time (head sizes the vector kernels do not cover), into
/// `acc` zeroed.
///
/// # Safety
/// As [`weighted_values`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn values_scalar(
    scores: &[f32],
    ld: usize,
    nq: usize,
    hd: usize,
    keys: usize,
    page_size: usize,
    slot: usize,
    values: &dyn Fn(usize) -> *const f32,
    acc: &mut [f32],
) {
    for t in 0..keys {
        // SAFETY: as the function's contract: value rows hold `hd` values.
        let v = unsafe { values(t / page_size).add((t % page_size) * slot) };
        for q in 0..nq {
            let w = scores[q * ld + t];
            if w != 0.0 {
                for d in 0..hd {
                    // SAFETY: as above.
                    acc[q * hd + d] = w.mul_add(unsafe { *v.add(d) }, acc[q * hd + d]);
                }
            }
        }
    }
}

/// [`weighted_values`] for `head_dim = 16·D`, up to `Q` queries' accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn values_in_registers<const D: usize, const Q: usize>(
    scores: &[f32],
    ld: usize,
    nq: usize,
    keys: usize,
    page_size: usize,
    slot: usize,
    values: &dyn Fn(usize) -> *const f32,
    acc: &mut [f32],
) {
    let mut q0 = 0;
    while q0 < nq {
        let qn = Q.min(nq - q0);
        // One instance per query count, so that every accumulator is a register (a count
        // known only at run time kept them on the stack).
        let args = (scores, ld, q0, keys, page_size, slot, values);
        // SAFETY: the caller's contract; rows `q0..q0 + qn` exist.
        unsafe {
            match qn {
                1 => values_block::<D, 1>(args, acc),
                2 => values_block::<D, 2>(args, acc),
                3 => values_block::<D, 3>(args, acc),
                4 => values_block::<D, 4>(args, acc),
                5 => values_block::<D, 5>(args, acc),
                _ => values_block::<D, 6>(args, acc),
            }
        }
        q0 += qn;
    }
}

/// Scores, their row length, the first query, keys, page size, value row stride, pages.
type ValuesArgs<'a> = (
    &'a [f32],
    usize,
    usize,
    usize,
    usize,
    usize,
    &'a dyn Fn(usize) -> *const f32,
);

/// Queries `q0..q0 + Q` of [`values_in_registers`].
#[inline(always)]
unsafe fn values_block<const D: usize, const Q: usize>(args: ValuesArgs, acc: &mut [f32]) {
    let (scores, ld, q0, keys, page_size, slot, values) = args;
    let hd = 16 * D;
    // SAFETY: the caller has AVX-512F; rows `q0..q0 + Q` and keys `..keys` in bounds.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); D]; Q];
        let mut t0 = 0;
        while t0 < keys {
            let base = values(t0 / page_size);
            let n = page_size.min(keys - t0);
            let next = if t0 + n < keys {
                values(t0 / page_size + 1)
            } else {
                std::ptr::null()
            };
            for s in 0..n {
                let v = base.add(s * slot);
                // Value rows are one KV head's among several (strided): prefetched a few
                // dozen rows ahead, into the next page near the end of this one.
                let ahead = s + tile::STRIDED_AHEAD;
                let pv = if ahead < n {
                    base.add(ahead * slot)
                } else {
                    next.wrapping_add((ahead - n) * slot)
                };
                if ahead < n || (!next.is_null() && t0 + ahead < keys) {
                    for d in 0..D {
                        _mm_prefetch::<_MM_HINT_T0>(pv.add(16 * d).cast());
                    }
                }
                let mut vv = [_mm512_setzero_ps(); D];
                for d in 0..D {
                    vv[d] = _mm512_loadu_ps(v.add(16 * d));
                }
                for q in 0..Q {
                    let w = _mm512_set1_ps(*scores.get_unchecked((q0 + q) * ld + t0 + s));
                    for d in 0..D {
                        a[q][d] = _mm512_fmadd_ps(w, vv[d], a[q][d]);
                    }
                }
            }
            t0 += n;
        }
        for q in 0..Q {
            for d in 0..D {
                _mm512_storeu_ps(acc.as_mut_ptr().add((q0 + q) * hd + 16 * d), a[q][d]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain attention over the same paged cache, in f64.
    fn reference(q: &[f32], cache: &[f32], seqs: &Seqs, shape: Shape, rows: usize) -> Vec<f32> {
        let (hd, h) = (shape.head_dim, shape.heads);
        let slot = shape.kv_heads * hd;
        let block = shape.page_size * slot;
        let page_floats = shape.num_layers * 2 * block;
        let mut out = vec![0.0; rows * h * hd];
        for b in 0..seqs.cache_lengths.len() {
            for r in seqs.offsets[b] as usize..seqs.offsets[b + 1] as usize {
                let pos = seqs.cache_lengths[b] as usize + r - seqs.offsets[b] as usize;
                for head in 0..h {
                    let kvh = head / (h / shape.kv_heads);
                    let at = |t: usize, which: usize| {
                        let page =
                            seqs.lookup[b * seqs.pages_per_seq + t / shape.page_size] as usize;
                        page * page_floats
                            + (shape.layer * 2 + which) * block
                            + (t % shape.page_size) * slot
                            + kvh * hd
                    };
                    let qv = &q[(r * h + head) * hd..][..hd];
                    let s: Vec<f64> = (0..=pos)
                        .map(|t| {
                            let k = &cache[at(t, 0)..][..hd];
                            qv.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>()
                                * shape.scale as f64
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let v: f64 = (0..=pos).map(|t| e[t] * cache[at(t, 1) + d] as f64).sum();
                        out[(r * h + head) * hd + d] = (v / sum) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn blocked_attention_matches_plain_attention_over_pages_and_sequences() {
        if !available() {
            eprintln!("skipped: neither AVX-512 nor AVX2 on this CPU");
            return;
        }
        // (head_dim, heads, kv_heads): the register paths (64, 128) and the generic one.
        for (hd, heads, kv_heads) in [(64, 9, 3), (128, 4, 4), (24, 6, 2)] {
            let shape = Shape {
                layer: 1,
                num_layers: 2,
                heads,
                kv_heads,
                head_dim: hd,
                page_size: 16,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            // Three sequences: a 40-row prefill after 5 cached tokens, one decode row after
            // 37, a 17-row chunk from scratch; pages scattered through the cache.
            let cache_lengths = [5, 37, 0];
            let offsets = [0, 40, 41, 58];
            let pages_per_seq = 4;
            let lookup = [7, 2, 9, 0, 1, 5, 3, 0, 4, 8, 0, 0];
            let seqs = Seqs {
                offsets: &offsets,
                cache_lengths: &cache_lengths,
                lookup: &lookup,
                pages_per_seq,
            };
            let rows = 58;
            let page_floats = shape.num_layers * 2 * shape.page_size * kv_heads * hd;
            let cache: Vec<f32> = (0..10 * page_floats)
                .map(|i| (((i * 2654435761usize) >> 7) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let q: Vec<f32> = (0..rows * heads * hd)
                .map(|i| (((i * 40503usize) >> 3) % 1999) as f32 / 400.0 - 2.5)
                .collect();
            let want = reference(&q, &cache, &seqs, shape, rows);
            for threads in [1, 2, 5] {
                let mut out = vec![f32::NAN; rows * heads * hd];
                // SAFETY: available() checked; buffers sized as the contract says.
                unsafe {
                    attention(
                        q.as_ptr(),
                        cache.as_ptr(),
                        out.as_mut_ptr(),
                        &seqs,
                        shape,
                        threads,
                    )
                };
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                        "head_dim {hd} threads {threads} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
