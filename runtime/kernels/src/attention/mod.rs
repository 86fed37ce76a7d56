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

mod avx2;
mod avx512;
mod kernels;

use crate::matmul::tile::{self, F32Rows};
use kernels::{Half, Kernels};
use maxc_schema::{KvDtype, KvView};

/// Query rows of one sequence per work item.
const ROW_BLOCK: usize = 16;

/// The fewest keys a split decode row gives one thread: a few pages' worth, so that merging
/// the partial results stays a small share of the work.
const MIN_SPAN: usize = 512;

/// The shape of one attention launch.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// The layer's view of the cache.
    pub cache: KvView,
    /// Query heads (a multiple of the cache's KV heads).
    pub heads: usize,
    /// Score scale.
    pub scale: f32,
    /// Sliding window: a row at position `p` sees positions `p + 1 - window ..= p` only.
    pub window: Option<usize>,
    /// Elements of a value: the head dim with two planes; with one (a latent, multi-head
    /// latent attention), the first `value_dim` elements of the key are its value.
    pub value_dim: usize,
}

impl Shape {
    /// Elements per head.
    fn head_dim(&self) -> usize {
        self.cache.head_dim as usize
    }
    /// KV heads.
    fn kv_heads(&self) -> usize {
        self.cache.kv_heads as usize
    }
    /// Tokens per page.
    fn page_size(&self) -> usize {
        self.cache.page_size as usize
    }
}

/// The step's sequence bookkeeping (validated by `StepInputs::checked_dims`).
pub struct Seqs<'a> {
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
    /// A decode row's keys split across threads: this item's positions `lo..hi` and its
    /// slot in the partial results (`None`: every key, the output written whole).
    span: Option<(usize, usize, usize)>,
}

#[derive(Clone, Copy)]
struct Ptrs {
    q: *const f32,
    cache: *const u8,
    out: *mut f32,
    /// Split decode rows' partial results: per span, `group × (value_dim + 2)` values (each
    /// query's unnormalised weighted values, then its max and sum).
    parts: *mut f32,
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
    /// Each query's largest scaled score.
    maxes: Vec<f32>,
    /// Weighted values `[nq, head_dim]`.
    acc: Vec<f32>,
    /// A bf16 or q8_0 cache: one page's rows widened to f32 `[page_size, head_dim]`.
    rows: Vec<f32>,
    /// A bf16 or q8_0 cache: one page's weighted values `[nq, value_dim]`.
    page_acc: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// `out[r, h, :] = softmax(q[r, h, :] · K[..=p]ᵀ · scale) · V[..=p]` for every token row `r`
/// (position `p` in its sequence) and query head `h`, keys and values of KV head
/// `h / (heads / kv_heads)` read from the paged cache.
///
/// The cache holds rows in `shape.cache.dtype` ([`KvView`]); f32 and bf16 rows are read where
/// they lie (bf16 widened in registers), q8_0 rows (and bf16 at head sizes the vector kernels do
/// not cover) widened to f32 a page at a time, into a tile of the thread's scratch that the f32
/// kernels then read. The next page's keys (while a page is scored) and values (while a page is
/// summed) are fetched into L2 ahead of the kernels.
///
/// # Safety
/// [`tile::available`] holds; `q` and `out` hold `rows × heads × head_dim` values; `cache` is
/// the whole cache, and every page the sequences use (checked by `StepInputs::checked_dims`)
/// lies inside it.
pub unsafe fn attention(
    q: *const f32,
    cache: *const u8,
    out: *mut f32,
    seqs: &Seqs,
    shape: Shape,
    threads: usize,
) {
    // SAFETY: the caller's contract; AVX-512 kernels only where the CPU runs them.
    unsafe { attention_on(q, cache, out, seqs, shape, threads, tile::available()) }
}

/// [`attention`] on the AVX-512 kernels (`avx512`) or the AVX2 ones: the tests run both on a
/// CPU that has both.
///
/// # Safety
/// As [`attention`]; the CPU has AVX-512 where `avx512`, else AVX2 + FMA.
unsafe fn attention_on(
    q: *const f32,
    cache: *const u8,
    out: *mut f32,
    seqs: &Seqs,
    shape: Shape,
    threads: usize,
    avx512: bool,
) {
    let group = shape.heads / shape.kv_heads();
    let mut items = Vec::new();
    for b in 0..seqs.cache_lengths.len() {
        let (r0, r1) = (seqs.offsets[b] as usize, seqs.offsets[b + 1] as usize);
        let mut r = r0;
        while r < r1 {
            let rows = ROW_BLOCK.min(r1 - r);
            for kvh in 0..shape.kv_heads() {
                items.push(Item {
                    seq: b,
                    row: r,
                    rows,
                    head: kvh * group,
                    group,
                    span: None,
                });
            }
            r += rows;
        }
    }
    let threads = threads.max(1);
    let single_rows = items.iter().all(|it| it.rows == 1);
    // Too few items for the threads. Decode rows over long contexts split their keys (each
    // KV head's keys and values then read once, by one thread, for every query head of its
    // group); short ones split their groups into single query heads.
    let mut parts = Vec::new();
    // Each split row: the item it was, and its spans' partial-result slots.
    let mut whole: Vec<(Item, std::ops::Range<usize>)> = Vec::new();
    if items.len() < 2 * threads {
        let keys = |it: &Item| seqs.cache_lengths[it.seq] as usize + 1;
        // (Not in a co-driven step: the spans' partial results are this call's own memory,
        // which another thread's chunks would not fill.)
        let long = single_rows
            && !crate::pool::driving()
            && items.iter().any(|it| keys(it) >= 2 * MIN_SPAN);
        if long {
            let want = (2 * threads).div_ceil(items.len());
            let ps = shape.page_size();
            // (sequence, span index, item) of each span, to order them by.
            let mut split = Vec::new();
            let mut slot = 0;
            for it in &items {
                let n = keys(it);
                let lo = shape.window.map_or(0, |w| n.saturating_sub(w));
                let spans = want.min((n - lo) / MIN_SPAN).max(1);
                // Span edges on page boundaries (each span reads whole pages of its own).
                let step = (n - lo).div_ceil(spans).next_multiple_of(ps);
                let (first, mut a, mut s) = (slot, lo, 0);
                while a < n {
                    let b = (a / ps * ps + step).min(n);
                    let span = Item {
                        span: Some((a, b, slot)),
                        ..*it
                    };
                    split.push(((it.seq, s), span));
                    slot += 1;
                    s += 1;
                    a = b;
                }
                whole.push((*it, first..slot));
            }
            // A sequence's spans at the same keys next to each other, every KV head's: a
            // thread's consecutive items then read one stretch of the cache's pages, each
            // page's block (all KV heads' rows) whole, rather than one head's part of it.
            split.sort_by_key(|(key, _)| *key);
            items = split.into_iter().map(|(_, it)| it).collect();
            parts = vec![0f32; items.len() * group * (shape.value_dim + 2)];
        } else if group > 1 {
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
    }
    // Later blocks of a sequence see more keys: dealing items round-robin balances them. A
    // step of single rows (decode) instead gives each thread consecutive items, a sequence's
    // KV heads together: their keys and values interleave in the same pages, so the lines the
    // hardware fetches beside one head's are the next head's.
    let chunks = if single_rows {
        threads.min(items.len())
    } else {
        crate::pool::long_chunks(threads, items.len())
    };
    let p = &Ptrs {
        q,
        cache,
        out,
        parts: parts.as_mut_ptr(),
    };
    let items = &items;
    crate::pool::run(chunks, &|c| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            // (first item, stride, count) of this thread's share.
            let (first, stride, count) = if single_rows {
                let (a, b) = (items.len() * c / chunks, items.len() * (c + 1) / chunks);
                (a, 1, b - a)
            } else {
                (c, chunks, items.len())
            };
            let mut mine = items
                .iter()
                .skip(first)
                .step_by(stride)
                .take(count)
                .peekable();
            if single_rows {
                if let Some(it) = mine.peek() {
                    prefetch_item(p, seqs, shape, it);
                }
            }
            while let Some(it) = mine.next() {
                // A decode row's keys and values are short runs on pages anywhere in the
                // cache, which the hardware does not see coming: the next item's are fetched
                // while this one computes (unless
                // it reads the same rows: another query head of the same group).
                if let (true, Some(next)) = (single_rows, mine.peek()) {
                    let group = shape.heads / shape.kv_heads();
                    let same = next.seq == it.seq
                        && next.head / group == it.head / group
                        && next.span == it.span;
                    if !same {
                        prefetch_item(p, seqs, shape, next);
                    }
                }
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
    if !parts.is_empty() {
        merge(&whole, &parts, out, shape);
    }
}

/// The most rows of each plane [`prefetch_item`] fetches: 128 KiB of f32 keys and values
/// at a head dim of 64, well inside L2 beside the item in hand.
const PREFETCH_ROWS: usize = 256;

/// Prefetches into L2 the key and value rows item `it` reads (its first
/// [`PREFETCH_ROWS`] of each plane).
fn prefetch_item(p: &Ptrs, seqs: &Seqs, shape: Shape, it: &Item) {
    let ps = shape.page_size();
    let first_pos = seqs.cache_lengths[it.seq] as usize + it.row - seqs.offsets[it.seq] as usize;
    let (mut k0, keys) = it.span.map_or((0, first_pos + it.rows), |(a, b, _)| (a, b));
    if let Some(w) = shape.window {
        k0 = k0.max((first_pos + 1).saturating_sub(w));
    }
    let kvh = (it.head / (shape.heads / shape.kv_heads())) as u64;
    let row_bytes = shape.cache.row_bytes() as usize;
    let stride = shape.cache.pos_stride() as usize;
    let end = keys.min(k0 + PREFETCH_ROWS);
    for which in 0..shape.cache.planes {
        // A page at a time: a head's rows lie back to back in a page, the pages anywhere.
        let mut pos = k0;
        while pos < end {
            let page = seqs.lookup[it.seq * seqs.pages_per_seq + pos / ps] as u64;
            let n = (ps - pos % ps).min(end - pos);
            let base = p
                .cache
                .wrapping_add(shape.cache.offset(page, which, (pos % ps) as u64, kvh) as usize);
            prefetch_rows(base, stride, n, row_bytes);
            pos += n;
        }
    }
}

/// Prefetches into L2 `rows` rows of `row_bytes`, `stride` bytes apart from `base`.
#[inline(always)]
fn prefetch_rows(base: *const u8, stride: usize, rows: usize, row_bytes: usize) {
    let lines = row_bytes.div_ceil(64);
    for r in 0..rows {
        for line in 0..lines {
            // SAFETY: SSE is baseline on x86-64; prefetches never fault.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    base.wrapping_add(r * stride + line * 64).cast(),
                )
            }
        }
    }
}

/// Combines the spans of each split decode row (`whole`: the row's item and its spans'
/// slots): `out = Σ acc·e^(m - M) / Σ l·e^(m - M)` over its spans' partial results, `M` their
/// largest max.
fn merge(whole: &[(Item, std::ops::Range<usize>)], parts: &[f32], out: *mut f32, shape: Shape) {
    let vd = shape.value_dim;
    let width = vd + 2;
    for (it, slots) in whole {
        let part = |slot: usize, g: usize| &parts[(slot * it.group + g) * width..][..width];
        for g in 0..it.group {
            let m = slots
                .clone()
                .map(|k| part(k, g)[vd])
                .fold(f32::NEG_INFINITY, f32::max);
            let scales: Vec<f32> = slots.clone().map(|k| (part(k, g)[vd] - m).exp()).collect();
            let l: f32 = slots
                .clone()
                .zip(&scales)
                .map(|(k, sc)| part(k, g)[vd + 1] * sc)
                .sum();
            let inv = 1.0 / l;
            // SAFETY: row `it.row`, head `it.head + g` lies in `out` (the caller's contract).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    out.add(it.row * shape.heads * vd + (it.head + g) * vd),
                    vd,
                )
            };
            for (d, o) in dst.iter_mut().enumerate() {
                let a: f32 = slots
                    .clone()
                    .zip(&scales)
                    .map(|(k, sc)| part(k, g)[d] * sc)
                    .sum();
                *o = a * inv;
            }
        }
    }
}

/// Whether [`attention`] runs on this CPU (AVX-512, or AVX2 + FMA).
pub fn available() -> bool {
    matches!(
        crate::isa::isa(),
        crate::isa::Isa::Avx512 | crate::isa::Isa::Avx2
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attend_avx512(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { attend::<avx512::Avx512>(p, seqs, shape, it, scratch) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { attend::<avx2::Avx2>(p, seqs, shape, it, scratch) }
}

/// `dst[r·width + d]` = value `d` of row `r` (`rows` rows, `stride` bytes apart from `src`,
/// `head_dim` values each in `dtype`), widened to f32, for `d < width`.
///
/// # Safety
/// The rows lie inside the cache; `dst` holds `rows × width` values.
#[inline(always)]
unsafe fn widen(
    dtype: KvDtype,
    src: *const u8,
    stride: usize,
    rows: usize,
    head_dim: usize,
    width: usize,
    dst: &mut [f32],
) {
    for r in 0..rows {
        let out = &mut dst[r * width..][..width];
        // SAFETY: as the contract: row `r`'s bytes lie inside the cache.
        unsafe {
            let row = src.add(r * stride);
            match dtype {
                KvDtype::F32 => {
                    std::ptr::copy_nonoverlapping(row.cast::<f32>(), out.as_mut_ptr(), width)
                }
                KvDtype::F16 => {
                    let h = std::slice::from_raw_parts(row.cast::<[u8; 2]>(), width);
                    for (o, h) in out.iter_mut().zip(h) {
                        *o = half::f16::from_le_bytes(*h).to_f32();
                    }
                }
                KvDtype::Bf16 => {
                    let h = std::slice::from_raw_parts(row.cast::<[u8; 2]>(), width);
                    for (o, h) in out.iter_mut().zip(h) {
                        *o = f32::from_bits(u32::from(u16::from_le_bytes(*h)) << 16);
                    }
                }
                KvDtype::Q8_0 => {
                    let q = std::slice::from_raw_parts(row.cast::<i8>(), width);
                    let scales = row.add(head_dim).cast::<[u8; 4]>();
                    for (b, (o, q)) in out.chunks_mut(32).zip(q.chunks(32)).enumerate() {
                        let d = f32::from_le_bytes(*scales.add(b));
                        for (o, &q) in o.iter_mut().zip(q) {
                            *o = d * f32::from(q);
                        }
                    }
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn attend<K: Kernels>(p: Ptrs, seqs: &Seqs, shape: Shape, it: Item, scratch: &mut Scratch) {
    let hd = shape.head_dim();
    let vd = shape.value_dim;
    let hstride = shape.heads * hd;
    let ostride = shape.heads * vd;
    let dtype = shape.cache.dtype;
    let wide = dtype == KvDtype::F32;
    let half = match dtype {
        KvDtype::Bf16 => Some(Half::Bf16),
        KvDtype::F16 => Some(Half::F16),
        KvDtype::F32 | KvDtype::Q8_0 => None,
    };
    // Rows of one KV head at consecutive positions of a page are this far apart.
    let stride = shape.cache.pos_stride() as usize;
    let kvh = it.head / (shape.heads / shape.kv_heads());
    let first_pos = seqs.cache_lengths[it.seq] as usize + it.row - seqs.offsets[it.seq] as usize;
    // The keys read: every one up to the last row's position, or a split row's span.
    let (k0, keys) = it.span.map_or((0, first_pos + it.rows), |(a, b, _)| (a, b));
    let nq = it.rows * it.group;
    let ld = keys.next_multiple_of(16);
    let Scratch {
        qs,
        scores,
        sums,
        maxes,
        acc,
        rows,
        page_acc,
    } = scratch;
    qs.resize(nq * hd, 0.0);
    scores.resize(nq * ld, 0.0);
    sums.resize(nq, 0.0);
    if !wide {
        rows.resize(shape.page_size() * hd, 0.0);
    }
    let scores = &mut scores[..nq * ld];
    // SAFETY (pointer arithmetic below): rows, heads and pages in bounds as the caller
    // guarantees; a page's keys and values for this layer and KV head are `stride` apart.
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
                .add(shape.cache.offset(page as u64, which as u64, 0, kvh as u64) as usize)
        };
        let pages = keys.div_ceil(shape.page_size());
        // An f32 cache's rows, read where they are.
        let rows_of = |pg: usize, which: usize| F32Rows {
            ptr: page_ptr(pg, which).cast::<f32>(),
            stride: stride / 4,
        };
        // The first position row `r` sees; pages before the block's first are not read.
        let lo = |r: usize| {
            shape
                .window
                .map_or(0, |w| (first_pos + r + 1).saturating_sub(w))
                .max(k0)
        };
        let first_page = lo(0) / shape.page_size();
        let from = first_page * shape.page_size();
        let row_bytes = shape.cache.row_bytes() as usize;
        for pg in first_page..pages {
            let t0 = pg * shape.page_size();
            let n = shape.page_size().min(keys - t0);
            // The next page's keys fetched into L2 while this one's are scored (a page's rows
            // are one run the hardware prefetchers follow, but the next page lies anywhere).
            if pg + 1 < pages {
                let n1 = shape.page_size().min(keys - t0 - n);
                prefetch_rows(page_ptr(pg + 1, 0), stride, n1, row_bytes);
            }
            let (k, next) = if wide {
                let next = if pg + 1 < pages {
                    let first = tile::STRIDED_AHEAD.min(keys - t0 - n);
                    (rows_of(pg + 1, 0), first)
                } else {
                    (rows_of(pg, 0), 0)
                };
                (rows_of(pg, 0), next)
            } else {
                // 16-bit keys read where they are, where the instruction set can.
                let k16 = tile::Strided::<u16> {
                    ptr: page_ptr(pg, 0).cast(),
                    stride: stride / 2,
                };
                let out = scores.as_mut_ptr().add(t0);
                if let Some(half) = half {
                    if K::scores_half(qs.as_ptr(), nq, hd, half, k16, n, out, ld) {
                        continue;
                    }
                }
                widen(dtype, page_ptr(pg, 0), stride, n, hd, hd, rows);
                let k = F32Rows {
                    ptr: rows.as_ptr(),
                    stride: hd,
                };
                (k, (k, 0))
            };
            K::scores(
                qs.as_ptr(),
                nq,
                hd,
                k,
                n,
                scores.as_mut_ptr().add(t0),
                ld,
                next,
            );
        }
        // Softmax: each query sees keys lo(r)..=its position. Inside a window it runs from the
        // 16-aligned start of those keys, the ones before them masked; every weight before
        // them is then 0.
        maxes.resize(nq, 0.0);
        for r in 0..it.rows {
            let valid = (first_pos + r + 1).min(keys);
            let (lo, start) = (lo(r), lo(r) / 16 * 16);
            for g in 0..it.group {
                let qi = r * it.group + g;
                let row = &mut scores[qi * ld..][..ld];
                row[start..lo].fill(f32::NEG_INFINITY);
                (sums[qi], maxes[qi]) = K::softmax(&mut row[start..], valid - start, shape.scale);
                row[start.min(from)..lo].fill(0.0);
            }
        }
        // Page `pg`'s values, the next page's fetched into L2 as they are read (the kernels
        // read the values a page at a time).
        let value_page = |pg: usize| {
            if pg + 1 < pages {
                let t1 = (pg + 1) * shape.page_size();
                let n1 = shape.page_size().min(keys - t1);
                prefetch_rows(page_ptr(pg + 1, 1), stride, n1, row_bytes);
            }
            page_ptr(pg, 1)
        };
        // Values: out = (scores · V) / sum, from page `first_page` on (the scores and the
        // pages shifted by it). With one plane the value block is the key block. 16-bit
        // values are read where they are where the kernels can (called outside any closure:
        // a closure's body does not inherit the instruction set, its intrinsics would not
        // inline).
        let in_place = match half {
            Some(h) => K::values_half(
                &scores[from..],
                ld,
                nq,
                vd,
                keys - from,
                shape.page_size(),
                stride / 2,
                h,
                &|pg: usize| value_page(pg + first_page).cast::<u16>(),
                acc,
            ),
            None => false,
        };
        if wide {
            let values = |pg: usize| value_page(pg + first_page).cast::<f32>();
            K::values(
                &scores[from..],
                ld,
                nq,
                vd,
                keys - from,
                shape.page_size(),
                stride / 4,
                &values,
                acc,
            );
        } else if !in_place {
            // A page at a time: its value rows widened, their weighted sum added.
            acc.clear();
            acc.resize(nq * vd, 0.0);
            for pg in first_page..pages {
                let t0 = pg * shape.page_size();
                let n = shape.page_size().min(keys - t0);
                let v = value_page(pg);
                widen(dtype, v, stride, n, hd, vd, rows);
                let v = rows.as_ptr();
                K::values(&scores[t0..], ld, nq, vd, n, n, vd, &|_| v, page_acc);
                for (a, b) in acc.iter_mut().zip(page_acc.iter()) {
                    *a += b;
                }
            }
        }
        if let Some((_, _, slot)) = it.span {
            // A span of a split row: its unnormalised values, max and sum, merged later.
            for g in 0..it.group {
                let dst = p.parts.add((slot * it.group + g) * (vd + 2));
                std::ptr::copy_nonoverlapping(acc.as_ptr().add(g * vd), dst, vd);
                *dst.add(vd) = maxes[g];
                *dst.add(vd + 1) = sums[g];
            }
            return;
        }
        for r in 0..it.rows {
            for g in 0..it.group {
                let qi = r * it.group + g;
                let inv = 1.0 / sums[qi];
                let dst = p.out.add((it.row + r) * ostride + (it.head + g) * vd);
                for d in 0..vd {
                    *dst.add(d) = acc[qi * vd + d] * inv;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests_support {
    use super::*;

    /// The kernel sets this host runs, as [`attention_on`]'s `avx512`: AVX-512 where
    /// [`attention`] would choose it, and AVX2 wherever the CPU has it (so an AVX-512 host
    /// checks the kernels a CPU without it runs too).
    pub(super) fn isas() -> impl Iterator<Item = bool> {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        [tile::available().then_some(true), avx2.then_some(false)]
            .into_iter()
            .flatten()
    }

    /// Plain attention over the same paged cache, in f64.
    pub(super) fn reference(
        q: &[f32],
        cache: &[f32],
        seqs: &Seqs,
        shape: Shape,
        rows: usize,
    ) -> Vec<f32> {
        let (hd, h, vd) = (shape.head_dim(), shape.heads, shape.value_dim);
        let planes = shape.cache.planes as usize;
        // Pages head-major: a KV head's rows back to back.
        let run = shape.page_size() * hd;
        let block = shape.kv_heads() * run;
        let page_floats = (shape.cache.num_layers as usize) * planes * block;
        let mut out = vec![0.0; rows * h * vd];
        for b in 0..seqs.cache_lengths.len() {
            for r in seqs.offsets[b] as usize..seqs.offsets[b + 1] as usize {
                let pos = seqs.cache_lengths[b] as usize + r - seqs.offsets[b] as usize;
                for head in 0..h {
                    let kvh = head / (h / shape.kv_heads());
                    let at = |t: usize, which: usize| {
                        let page =
                            seqs.lookup[b * seqs.pages_per_seq + t / shape.page_size()] as usize;
                        page * page_floats
                            + ((shape.cache.layer as usize) * planes + which.min(planes - 1))
                                * block
                            + kvh * run
                            + (t % shape.page_size()) * hd
                    };
                    let qv = &q[(r * h + head) * hd..][..hd];
                    let lo = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let s: Vec<f64> = (lo..=pos)
                        .map(|t| {
                            let k = &cache[at(t, 0)..][..hd];
                            qv.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>()
                                * shape.scale as f64
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..vd {
                        let v: f64 = (lo..=pos)
                            .map(|t| e[t - lo] * cache[at(t, 1) + d] as f64)
                            .sum();
                        out[(r * h + head) * vd + d] = (v / sum) as f32;
                    }
                }
            }
        }
        out
    }

    /// A cache of `pages` pages of made-up values: the f32 values each row holds (rounded as
    /// the dtype stores them) and the cache's bytes.
    pub(super) fn filled_cache(shape: Shape, pages: usize) -> (Vec<f32>, Vec<u8>) {
        let hd = shape.head_dim();
        let page_floats = (shape.cache.num_layers as usize)
            * shape.cache.planes as usize
            * shape.page_size()
            * shape.kv_heads()
            * hd;
        let mut cache: Vec<f32> = (0..pages * page_floats)
            .map(|i| (((i * 2654435761usize) >> 7) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let dtype = shape.cache.dtype;
        let row_bytes = dtype.row_bytes(hd as u64) as usize;
        let mut bytes = vec![0u8; cache.len() / hd * row_bytes];
        for (row, out) in cache.chunks_mut(hd).zip(bytes.chunks_mut(row_bytes)) {
            dtype.encode_row(row, out);
            dtype.round_row(row);
        }
        (cache, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn blocked_attention_matches_plain_attention_over_pages_and_sequences() {
        if !available() {
            eprintln!("skipped: neither AVX-512 nor AVX2 on this CPU");
            return;
        }
        // (head_dim, heads, kv_heads): the register paths (64, 128) and the generic one; full
        // attention and sliding windows (within a page, across pages, longer than a context).
        // Then one-plane latents (multi-head latent attention): every head reading the one
        // latent, values its first value_dim (tiny-deepseek-v3's 80/64, DeepSeek-V3's 576/512).
        let cases = [(64, 9, 3, 2, 64), (128, 4, 4, 2, 128), (24, 6, 2, 2, 24)]
            .into_iter()
            .flat_map(|c| [None, Some(1), Some(7), Some(21), Some(100)].map(|w| (c, w)))
            .chain([((80, 4, 1, 1, 64), None), ((576, 3, 1, 1, 512), None)])
            // Every case with each KV dtype (q8_0 where head_dim is whole groups of 32).
            .flat_map(|c| KvDtype::ALL.map(|d| (c, d)))
            .filter(|(((hd, ..), _), d)| d.check_head_dim(*hd as u64).is_ok());
        for (((hd, heads, kv_heads, planes, vd), window), dtype) in cases {
            let shape = Shape {
                value_dim: vd,
                cache: KvView {
                    planes,
                    layer: 1,
                    num_layers: 2,
                    kv_heads: kv_heads as u64,
                    head_dim: hd as u64,
                    page_size: 16,
                    dtype,
                },
                heads,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
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
            let page_floats = (shape.cache.num_layers as usize)
                * planes as usize
                * shape.page_size()
                * kv_heads
                * hd;
            let mut cache: Vec<f32> = (0..10 * page_floats)
                .map(|i| (((i * 2654435761usize) >> 7) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            // The cache's bytes, row by row in the dtype; the reference reads what they hold.
            let row_bytes = dtype.row_bytes(hd as u64) as usize;
            let mut bytes = vec![0u8; cache.len() / hd * row_bytes];
            for (row, out) in cache.chunks_mut(hd).zip(bytes.chunks_mut(row_bytes)) {
                dtype.encode_row(row, out);
                dtype.round_row(row);
            }
            let q: Vec<f32> = (0..rows * heads * hd)
                .map(|i| (((i * 40503usize) >> 3) % 1999) as f32 / 400.0 - 2.5)
                .collect();
            let want = reference(&q, &cache, &seqs, shape, rows);
            for (threads, avx512) in [1, 2, 5]
                .into_iter()
                .flat_map(|t| isas().map(move |a| (t, a)))
            {
                let mut out = vec![f32::NAN; rows * heads * vd];
                // SAFETY: the host has the instruction set (`isas`); buffers sized as the
                // contract says.
                unsafe {
                    attention_on(
                        q.as_ptr(),
                        bytes.as_ptr(),
                        out.as_mut_ptr(),
                        &seqs,
                        shape,
                        threads,
                        avx512,
                    )
                };
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                        "{dtype} head_dim {hd} window {window:?} threads {threads} avx512 {avx512} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod split_tests {
    use super::tests_support::*;
    use super::*;

    /// Decode rows over long contexts split their keys across threads: the merged spans give
    /// plain attention, with and without a window, for every KV dtype.
    #[test]
    fn split_decode_rows_match_plain_attention() {
        if !available() {
            eprintln!("skipped: neither AVX-512 nor AVX2 on this CPU");
            return;
        }
        let (hd, heads, kv_heads) = (64, 6, 2);
        for dtype in KvDtype::ALL {
            for window in [None, Some(700), Some(5000)] {
                let shape = Shape {
                    value_dim: hd,
                    cache: KvView {
                        planes: 2,
                        layer: 0,
                        num_layers: 1,
                        kv_heads: kv_heads as u64,
                        head_dim: hd as u64,
                        page_size: 16,
                        dtype,
                    },
                    heads,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window,
                };
                // Two decode rows: after 1500 and after 2100 cached tokens, pages shuffled.
                let cache_lengths = [1500, 2100];
                let offsets = [0, 1, 2];
                let pages_per_seq = 132;
                let lookup: Vec<i32> = (0..2 * pages_per_seq as i32)
                    .map(|i| (i * 97) % (2 * pages_per_seq as i32))
                    .collect();
                let seqs = Seqs {
                    offsets: &offsets,
                    cache_lengths: &cache_lengths,
                    lookup: &lookup,
                    pages_per_seq,
                };
                let (cache, bytes) = filled_cache(shape, 2 * pages_per_seq);
                let q: Vec<f32> = (0..2 * heads * hd)
                    .map(|i| (((i * 40503usize) >> 3) % 1999) as f32 / 400.0 - 2.5)
                    .collect();
                let want = reference(&q, &cache, &seqs, shape, 2);
                for (threads, avx512) in [1, 2, 3, 8]
                    .into_iter()
                    .flat_map(|t| isas().map(move |a| (t, a)))
                {
                    let mut out = vec![f32::NAN; 2 * heads * hd];
                    // SAFETY: the host has the instruction set (`isas`); buffers sized as the
                    // contract says.
                    unsafe {
                        attention_on(
                            q.as_ptr(),
                            bytes.as_ptr(),
                            out.as_mut_ptr(),
                            &seqs,
                            shape,
                            threads,
                            avx512,
                        )
                    };
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                            "{dtype} window {window:?} threads {threads} avx512 {avx512} at {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
