//! AVX-512 register tiles for `out[rows, n] = x[rows, k] · wᵀ` with weight rows read as stored
//! (f32, bf16, f16) or from a dequantized f32 panel, without packing either operand.
//!
//! Both operands are contiguous along `k`, so a tile of `MR` activation rows by `NR` weight rows
//! keeps `MR × NR` sixteen-lane accumulators in registers: per sixteen columns of `k` it loads
//! `MR + NR` vectors and issues `MR × NR` FMAs (4 × 6: 10 loads for 24 FMAs, so the FMA units
//! are the limit), and sums each accumulator's lanes once at the end. A weight tile is reused for
//! every activation tile of a block of rows while it is in L1; the activations stay in L2.
//! The last `k % 16` columns are read with masked loads, so any `k` works.
//!
//! Accumulation is f32 throughout (the same values as the generic kernels in another order).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

/// Activation rows per tile.
const MR: usize = 4;
/// Weight rows per tile.
pub(crate) const NR: usize = 6;
/// Activation rows per block: a weight tile is reused across a block while it stays in L1.
const ROW_BLOCK: usize = 64;

/// Weight rows `0..`, each `k` values, sixteen at a time as f32.
pub(crate) trait Rows: Copy {
    /// Values `i..i + 16` of row `j`.
    ///
    /// # Safety
    /// AVX-512F/BW/VL; the values lie in the row.
    unsafe fn load(self, j: usize, i: usize) -> __m512;
    /// Values `i..` of row `j` where `mask` has a bit, zero elsewhere.
    ///
    /// # Safety
    /// AVX-512F/BW/VL; the masked values lie in the row.
    unsafe fn load_mask(self, j: usize, i: usize, mask: __mmask16) -> __m512;
    /// Where row `j` starts.
    fn row(self, j: usize) -> *const u8;
    /// Bytes from one row's start to the next's.
    fn row_bytes(self) -> usize;
    /// Values from one row's start to the next's.
    fn stride(self) -> usize;
}

/// A float element type tiles read, widened to f32 sixteen at a time.
pub(crate) trait Elem: Copy {
    /// Elements `p..p + 16`.
    ///
    /// # Safety
    /// AVX-512F/BW/VL; the elements are readable.
    unsafe fn load16(p: *const Self) -> __m512;
    /// The elements of `p..` where `mask` has a bit, zero elsewhere.
    ///
    /// # Safety
    /// AVX-512F/BW/VL; the masked elements are readable.
    unsafe fn load16_mask(p: *const Self, mask: __mmask16) -> __m512;
}

/// bf16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Bf16(pub u16);

/// f16 (IEEE binary16) bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct F16(pub u16);

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: as the trait requires.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load16_mask(p: *const Self, mask: __mmask16) -> __m512 {
        // SAFETY: as the trait requires; masked lanes are not read.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }
}

impl Elem for Bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: as the trait requires; bf16 widens to f32 by a 16-bit shift.
        unsafe {
            let raw = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
        }
    }
    #[inline(always)]
    unsafe fn load16_mask(p: *const Self, mask: __mmask16) -> __m512 {
        // SAFETY: as the trait requires; masked lanes are not read.
        unsafe {
            let raw = _mm256_maskz_loadu_epi16(mask, p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
        }
    }
}

impl Elem for F16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: as the trait requires.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load16_mask(p: *const Self, mask: __mmask16) -> __m512 {
        // SAFETY: as the trait requires; masked lanes are not read.
        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())) }
    }
}

/// Rows of `E` values, `stride` values apart.
#[derive(Clone, Copy)]
pub(crate) struct Strided<E> {
    pub ptr: *const E,
    pub stride: usize,
}

/// f32 rows.
pub(crate) type F32Rows = Strided<f32>;
/// bf16 rows.
pub(crate) type Bf16Rows = Strided<Bf16>;
/// f16 rows.
pub(crate) type F16Rows = Strided<F16>;

impl<E: Elem> Rows for Strided<E> {
    #[inline(always)]
    unsafe fn load(self, j: usize, i: usize) -> __m512 {
        // SAFETY: as the trait requires.
        unsafe { E::load16(self.ptr.add(j * self.stride + i)) }
    }
    #[inline(always)]
    unsafe fn load_mask(self, j: usize, i: usize, mask: __mmask16) -> __m512 {
        // SAFETY: as the trait requires.
        unsafe { E::load16_mask(self.ptr.add(j * self.stride + i), mask) }
    }
    #[inline(always)]
    fn row(self, j: usize) -> *const u8 {
        self.ptr.wrapping_add(j * self.stride).cast()
    }
    #[inline(always)]
    fn row_bytes(self) -> usize {
        self.stride * std::mem::size_of::<E>()
    }
    #[inline(always)]
    fn stride(self) -> usize {
        self.stride
    }
}

/// Prefetches line `line` of the weight tile after next into L2, where `next` is the next
/// tile's first byte and length (tiles of one matmul are the same size; past the weight's end
/// a prefetch loads the following bytes or nothing, and never faults). A tile's loop issues
/// its lines a few per step, so they arrive as one sequential run. Two tiles ahead and into L2,
/// not the next tile into L1: one-row f32 decode (`cargo bench --bench weights`, rows 1, on
/// huge pages) streams at 0.98 of the bandwidth probe this way and at 0.84 the other (whose
/// L1 fills compete with the demand loads).
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(next: (*const u8, usize), line: usize) {
    // SAFETY: the caller has SSE; prefetches never fault.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(next.0.wrapping_add(next.1 + line * 64).cast()) }
}

/// Prefetches (into L2) the row of `bytes` bytes that starts `rows` rows of that size after
/// `row`: row-streaming kernels call it once per weight row they start, so that the rows a
/// little ahead are on their way before the hardware's prefetchers would start on them.
#[inline(always)]
pub(crate) fn prefetch_row(row: *const u8, bytes: usize, rows: usize) {
    let at = row.wrapping_add(rows * bytes);
    for line in 0..bytes.div_ceil(64) {
        // SAFETY: SSE is baseline on x86-64; prefetches never fault.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(line * 64).cast())
        }
    }
}

/// Rows ahead of the tile in hand that [`prefetch_strided`] fetches: a tile of short strided
/// rows (attention's keys, 64 to 128 values of one KV head among several) computes in far less
/// time than memory takes to answer, so the distance is several tiles.
pub(crate) const STRIDED_AHEAD: usize = 24;

/// Prefetches rows `j..j + count` of `w` (`k` values each, whatever the stride) into L1: rows
/// that are not contiguous get no help from the tiles' own prefetch or, as the hardware
/// streamer follows consecutive lines, from the hardware.
#[inline(always)]
pub(crate) unsafe fn prefetch_strided<L: Rows>(w: L, k: usize, j: usize, count: usize) {
    let bytes = k * w.row_bytes() / w.stride().max(1);
    for r in j..j + count {
        let p = w.row(r);
        for line in 0..bytes.div_ceil(64) {
            // SAFETY: the caller has SSE; prefetches never fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line * 64).cast()) }
        }
    }
}

/// The sums of sixteen vectors' lanes, as one vector: lane `i` is the sum of `v[i]`'s lanes.
/// A tree of 128-bit-block shuffles, then in-block ones, and adds: 45 instructions, where
/// summing each vector on its own takes about 8.
#[inline(always)]
pub(crate) unsafe fn sums16(v: [__m512; 16]) -> __m512 {
    // SAFETY: the caller has AVX-512F.
    unsafe {
        // The tree leaves lane i holding the sum of input (i % 4) · 4 + i / 4 (a 4 × 4
        // transpose, its own inverse): feed it in that order.
        let at = |i: usize| v[(i % 4) * 4 + i / 4];
        // Each of 8 vectors: two inputs' halves added, [a.0 + a.2, a.1 + a.3, b.0 + b.2, b.1 +
        // b.3] in 128-bit blocks.
        let mut c = [_mm512_setzero_ps(); 8];
        for (i, c) in c.iter_mut().enumerate() {
            let (a, b) = (at(2 * i), at(2 * i + 1));
            *c = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        // Each of 4 vectors: one block of four lanes per input.
        let mut d = [_mm512_setzero_ps(); 4];
        for (i, d) in d.iter_mut().enumerate() {
            let (a, b) = (c[2 * i], c[2 * i + 1]);
            *d = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            );
        }
        let e0 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(d[0], d[1]),
            _mm512_shuffle_ps::<0xEE>(d[0], d[1]),
        );
        let e1 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(d[2], d[3]),
            _mm512_shuffle_ps::<0xEE>(d[2], d[3]),
        );
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(e0, e1),
            _mm512_shuffle_ps::<0xDD>(e0, e1),
        )
    }
}

/// Each vector's lane sum, handed to `put(i, sum)` for vector `i`: sixteen vectors at a time
/// summed together ([`sums16`]).
#[inline(always)]
pub(crate) unsafe fn each_sum(acc: &[__m512], mut put: impl FnMut(usize, f32)) {
    // SAFETY: the caller has AVX-512F; 16 values per store.
    unsafe {
        for (b, chunk) in acc.chunks(16).enumerate() {
            let mut v = [_mm512_setzero_ps(); 16];
            v[..chunk.len()].copy_from_slice(chunk);
            let mut sums = [0.0f32; 16];
            _mm512_storeu_ps(sums.as_mut_ptr(), sums16(v));
            for (i, &s) in sums.iter().take(chunk.len()).enumerate() {
                put(b * 16 + i, s);
            }
        }
    }
}

/// The sums of four vectors' lanes, as one 128-bit vector.
#[inline(always)]
unsafe fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // SAFETY: the caller has AVX-512F.
    unsafe {
        let fold = |v: __m512| {
            let h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
            _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
        };
        let (a, b, c, d) = (fold(a), fold(b), fold(c), fold(d));
        _mm_hadd_ps(_mm_hadd_ps(a, b), _mm_hadd_ps(c, d))
    }
}

/// One tile: `out[r * ldo + j] = Σ_i x[r * ldx + i] · w_j[i]` for `r < R`, `j < C`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<L: Rows, const R: usize, const C: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    w: L,
    j0: usize,
    out: *mut f32,
    ldo: usize,
    next: (*const u8, usize),
) {
    // SAFETY: the caller has AVX-512 and in-bounds rows, columns and outputs; prefetches
    // never fault.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        // Cache lines of a weight tile to prefetch per step ([`prefetch_ahead`]).
        let lines = next.1.div_ceil(64).div_ceil(k.div_ceil(16).max(1));
        let mut line = 0;
        let mut i = 0;
        while i + 16 <= k {
            for _ in 0..lines {
                prefetch_ahead(next, line);
                line += 1;
            }
            let mut xv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                xv[r] = _mm512_loadu_ps(x.add(r * ldx + i));
            }
            for j in 0..C {
                let wv = w.load(j0 + j, i);
                for r in 0..R {
                    acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
                }
            }
            i += 16;
        }
        if i < k {
            let mask = ((1u32 << (k - i)) - 1) as __mmask16;
            let mut xv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                xv[r] = _mm512_maskz_loadu_ps(mask, x.add(r * ldx + i));
            }
            for j in 0..C {
                let wv = w.load_mask(j0 + j, i, mask);
                for r in 0..R {
                    acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
                }
            }
        }
        for r in 0..R {
            let o = out.add(r * ldo);
            let mut j = 0;
            while j + 4 <= C {
                let s = hsum4(acc[r][j], acc[r][j + 1], acc[r][j + 2], acc[r][j + 3]);
                _mm_storeu_ps(o.add(j), s);
                j += 4;
            }
            while j < C {
                *o.add(j) = _mm512_reduce_add_ps(acc[r][j]);
                j += 1;
            }
        }
    }
}

/// Eight activation rows by `C ≤ 3` weight rows: each weight vector is loaded (and widened or
/// dequantized) once for eight rows, where two 4-row tiles would do it twice.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile8<L: Rows, const C: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    w: L,
    j0: usize,
    out: *mut f32,
    ldo: usize,
    next: (*const u8, usize),
) {
    // SAFETY: the caller has AVX-512 and in-bounds rows, columns and outputs; prefetches
    // never fault.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; 8];
        let lines = next.1.div_ceil(64).div_ceil(k.div_ceil(16).max(1));
        let mut line = 0;
        let mut i = 0;
        while i < k {
            for _ in 0..lines {
                prefetch_ahead(next, line);
                line += 1;
            }
            let mask = lane_mask(k - i);
            let mut wv = [_mm512_setzero_ps(); C];
            for j in 0..C {
                wv[j] = if mask == 0xFFFF {
                    w.load(j0 + j, i)
                } else {
                    w.load_mask(j0 + j, i, mask)
                };
            }
            for r in 0..8 {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(r * ldx + i));
                for j in 0..C {
                    acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
                }
            }
            i += 16;
        }
        // (Summed a row at a time: the float paths' sums keep the order the backends
        // suite's cache-dtype bounds were set on.)
        for r in 0..8 {
            let s = hsum4(
                acc[r][0],
                if C > 1 {
                    acc[r][1 % C]
                } else {
                    _mm512_setzero_ps()
                },
                if C > 2 {
                    acc[r][2 % C]
                } else {
                    _mm512_setzero_ps()
                },
                _mm512_setzero_ps(),
            );
            _mm_mask_storeu_ps(out.add(r * ldo), ((1u32 << C) - 1) as __mmask8, s);
        }
    }
}

/// The lanes below `n` (all sixteen when `n ≥ 16`).
#[inline(always)]
pub(crate) fn lane_mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// `tile::<L, R, C>` for run-time `r ≤ MR`, `c ≤ NR`.
macro_rules! dispatch {
    ($r:expr, $c:expr, $args:tt) => {
        match $r {
            1 => dispatch!(@c 1, $c, $args),
            2 => dispatch!(@c 2, $c, $args),
            3 => dispatch!(@c 3, $c, $args),
            _ => dispatch!(@c 4, $c, $args),
        }
    };
    (@c $r:literal, $c:expr, ($($a:expr),*)) => {
        match $c {
            1 => tile::<_, $r, 1>($($a),*),
            2 => tile::<_, $r, 2>($($a),*),
            3 => tile::<_, $r, 3>($($a),*),
            4 => tile::<_, $r, 4>($($a),*),
            5 => tile::<_, $r, 5>($($a),*),
            _ => tile::<_, $r, 6>($($a),*),
        }
    };
}

/// `out[r * ldo + j] = Σ_i x[r * k + i] · w_j[i]` for `r < rows`, `j < cols`.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL and F16C; `x` holds `rows × k` values, `w` has `cols` rows of `k`
/// values, `out` has room for `rows` rows of `ldo` values, of which this writes the first `cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn matmul<L: Rows>(
    x: *const f32,
    rows: usize,
    k: usize,
    w: L,
    cols: usize,
    out: *mut f32,
    ldo: usize,
) {
    // Whole groups of eight rows first (steps of 8 to 31 rows: batched decode), three weight
    // rows at a time; the rest in 4 × 6 tiles.
    let tall = if rows >= 8 { rows / 8 * 8 } else { 0 };
    let mut r = 0;
    while r < tall {
        let mut j = 0;
        while j < cols {
            let c = 3.min(cols - j);
            let next = if r == 0 && j + c < cols && w.stride() == k {
                (w.row(j + c), 3.min(cols - j - c) * w.row_bytes())
            } else {
                (std::ptr::null(), 0)
            };
            // SAFETY: rows r..r + 8 and weight rows j..j + c are in bounds.
            unsafe {
                let (xr, o) = (x.add(r * k), out.add(r * ldo + j));
                match c {
                    1 => tile8::<_, 1>(xr, k, k, w, j, o, ldo, next),
                    2 => tile8::<_, 2>(xr, k, k, w, j, o, ldo, next),
                    _ => tile8::<_, 3>(xr, k, k, w, j, o, ldo, next),
                }
            }
            j += c;
        }
        r += 8;
    }
    let mut r0 = tall;
    while r0 < rows {
        let r1 = rows.min(r0 + ROW_BLOCK);
        let mut j = 0;
        while j < cols {
            let c = NR.min(cols - j);
            if w.stride() != k && r0 == tall {
                // SAFETY: prefetches never fault.
                unsafe { prefetch_strided(w, k, j + STRIDED_AHEAD, c) };
            }
            let mut r = r0;
            while r < r1 {
                let m = MR.min(r1 - r);
                // The next tile's weights are prefetched during the first row group, when
                // rows are contiguous.
                let next = if r == r0 && j + c < cols && w.stride() == k {
                    (w.row(j + c), NR.min(cols - j - c) * w.row_bytes())
                } else {
                    (std::ptr::null(), 0)
                };
                // SAFETY: rows r..r + m and weight rows j..j + c are in bounds.
                unsafe {
                    dispatch!(
                        m,
                        c,
                        (x.add(r * k), k, k, w, j, out.add(r * ldo + j), ldo, next)
                    )
                };
                r += m;
            }
            j += c;
        }
        r0 = r1;
    }
}

/// Activation rows per panel of the packed kernel (two vectors).
const MP: usize = 32;
/// Weight rows per packed-kernel tile.
const NP: usize = 12;
/// Weight rows per block of the packed kernel (a multiple of [`NP`]).
const PACKED_COL_BLOCK: usize = 48;

/// `x[rows, k]` transposed into panels of [`MP`] rows, `[panel][k][MP]` (missing rows zero), for
/// [`matmul_packed`]; panels are packed in parallel on the executor's threads.
pub(crate) fn pack_transposed(x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    let panels = rows.div_ceil(MP);
    let mut xt = vec![0.0f32; panels * k * MP];
    let chunks = crate::pool::threads().min(panels).max(1);
    let base = crate::pool::OutPtr(xt.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        for p in (c..panels).step_by(chunks) {
            // SAFETY: panel p's `k × MP` values, written by this call only.
            let panel =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(p * k * MP), k * MP) };
            let n = MP.min(rows - p * MP);
            let src = &x[p * MP * k..(p * MP + n) * k];
            // Column by column: the panel is written in order, the rows read from L1.
            for (i, out) in panel.chunks_exact_mut(MP).enumerate() {
                for (r, o) in out[..n].iter_mut().enumerate() {
                    *o = src[r * k + i];
                }
            }
        }
    });
    xt
}

/// [`packed_tile`]'s multiply-adds for one value of `k`, `i`.
#[inline(always)]
unsafe fn packed_step<const C: usize, const LD: usize>(
    acc: &mut [[__m512; 2]; C],
    xt: *const f32,
    k: usize,
    w: *const f32,
    i: usize,
) {
    // SAFETY: as `packed_tile`'s caller guarantees, for `i < k`.
    unsafe {
        let a0 = _mm512_loadu_ps(xt.add(i * MP));
        let a1 = _mm512_loadu_ps(xt.add(i * MP + 16));
        for j in 0..C {
            let at = if LD > 0 { i * LD + j } else { j * k + i };
            let b = _mm512_set1_ps(*w.add(at));
            acc[j][0] = _mm512_fmadd_ps(a0, b, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(a1, b, acc[j][1]);
        }
    }
}

/// One tile of the packed kernel: `out[m * ldo + j] = Σ_i xt[i][m] · w[j * k + i]` for
/// `m < mrows`, `j < C`: 32 rows in two vectors times `C` broadcast weights per `i`, `2·C`
/// accumulators, no horizontal sums. With `LD > 0` the weights lie the other way round:
/// `w[i * LD + j]`.
#[inline(always)]
unsafe fn packed_tile<const C: usize, const LD: usize>(
    xt: *const f32,
    k: usize,
    w: *const f32,
    out: *mut f32,
    ldo: usize,
    mrows: usize,
) {
    // SAFETY: the caller has AVX-512; `xt` holds k × 32 values, `w` C rows of k, `out` mrows
    // rows of C values at stride ldo.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; C];
        // Two values of k per pass (the loop's own instructions halved: on the Intel guest a
        // 32 × 12 tile from L1 ran at 0.94 of the FMA peak this way, 0.86 one at a time).
        let mut i = 0;
        while i + 2 <= k {
            packed_step::<C, LD>(&mut acc, xt, k, w, i);
            packed_step::<C, LD>(&mut acc, xt, k, w, i + 1);
            i += 2;
        }
        if i < k {
            packed_step::<C, LD>(&mut acc, xt, k, w, i);
        }
        let mut buf = [[0.0f32; MP]; C];
        for j in 0..C {
            _mm512_storeu_ps(buf[j].as_mut_ptr(), acc[j][0]);
            _mm512_storeu_ps(buf[j].as_mut_ptr().add(16), acc[j][1]);
        }
        for m in 0..mrows {
            let o = out.add(m * ldo);
            for j in 0..C {
                *o.add(j) = buf[j][m];
            }
        }
    }
}

/// `out[r * ldo + j] = Σ_i x[r, i] · w[j * k + i]` for `r < rows`, `j < cols`, with `xt` the
/// activations packed by [`pack_transposed`] and `w` f32 weight rows of `k` values: for steps
/// of many rows, where packing the activations once pays for itself.
///
/// # Safety
/// The CPU has AVX-512F; `xt` is `pack_transposed(x, rows, k)`, `w` holds `cols` rows of `k`
/// values, `out` has room for `rows` rows of `ldo` values, of which this writes the first `cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_packed(
    xt: &[f32],
    rows: usize,
    k: usize,
    w: *const f32,
    cols: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: as the function says.
    unsafe { matmul_packed_as::<0>(xt, rows, k, w, cols, out, ldo) }
}

/// Values per line of [`matmul_packed_lines`]'s weights: a panel of 32 columns (its tiles 12, 12
/// and 8 columns wide). Three side by side, tiles of twelve throughout, measured slower at `k`
/// 2048: `k` lines of 96 f32 values and the packed activations no longer fit in L2.
const LINE: usize = 32;

/// [`matmul_packed`] on weights in lines: `w[i * LINE + j]` is column `j`'s value at `i`
/// (`cols <= LINE`), as a panel of 32 columns widened to f32 lies.
///
/// # Safety
/// As [`matmul_packed`]'s, `w` holding `k` lines of [`LINE`] values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_packed_lines(
    xt: &[f32],
    rows: usize,
    k: usize,
    w: *const f32,
    cols: usize,
    out: *mut f32,
    ldo: usize,
) {
    debug_assert!(cols <= LINE);
    // SAFETY: as the function says.
    unsafe { matmul_packed_as::<LINE>(xt, rows, k, w, cols, out, ldo) }
}

/// [`matmul_packed`] (`LD > 0`: [`matmul_packed_lines`], lines of `LD`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn matmul_packed_as<const LD: usize>(
    xt: &[f32],
    rows: usize,
    k: usize,
    w: *const f32,
    cols: usize,
    out: *mut f32,
    ldo: usize,
) {
    // Blocks of weight rows that stay in L2 while every activation panel passes over them,
    // each panel staying in L1/L2 while the block's tiles pass over it: weights are read from
    // memory once per call, activations from L2.
    // The next block's weights are prefetched into L2 while this block computes, a share
    // before each tile, so that the first panel's pass over a block does not wait on memory.
    let panels = rows.div_ceil(MP);
    let mut j0 = 0;
    while j0 < cols {
        let j1 = cols.min(j0 + PACKED_COL_BLOCK);
        // (Lines: one block, the whole panel.)
        let next_lines = if LD > 0 {
            0
        } else {
            (cols.min(j1 + PACKED_COL_BLOCK) - j1) * k * 4 / 64
        };
        let per_tile = next_lines.div_ceil(panels * (j1 - j0).div_ceil(NP));
        let next = w.wrapping_add(j1 * k).cast::<u8>();
        let mut line = 0;
        for p in 0..panels {
            let mrows = MP.min(rows - p * MP);
            let mut j = j0;
            while j < j1 {
                let c = NP.min(j1 - j);
                for _ in 0..per_tile.min(next_lines - line.min(next_lines)) {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(line * 64).cast());
                    line += 1;
                }
                // SAFETY: panel p, weight rows j..j + c and the outputs they write are in
                // bounds.
                unsafe {
                    let xp = xt.as_ptr().add(p * k * MP);
                    let wj = w.add(if LD > 0 { j } else { j * k });
                    let o = out.add(p * MP * ldo + j);
                    match c {
                        1 => packed_tile::<1, LD>(xp, k, wj, o, ldo, mrows),
                        2 => packed_tile::<2, LD>(xp, k, wj, o, ldo, mrows),
                        3 => packed_tile::<3, LD>(xp, k, wj, o, ldo, mrows),
                        4 => packed_tile::<4, LD>(xp, k, wj, o, ldo, mrows),
                        5 => packed_tile::<5, LD>(xp, k, wj, o, ldo, mrows),
                        6 => packed_tile::<6, LD>(xp, k, wj, o, ldo, mrows),
                        7 => packed_tile::<7, LD>(xp, k, wj, o, ldo, mrows),
                        8 => packed_tile::<8, LD>(xp, k, wj, o, ldo, mrows),
                        9 => packed_tile::<9, LD>(xp, k, wj, o, ldo, mrows),
                        10 => packed_tile::<10, LD>(xp, k, wj, o, ldo, mrows),
                        11 => packed_tile::<11, LD>(xp, k, wj, o, ldo, mrows),
                        _ => packed_tile::<12, LD>(xp, k, wj, o, ldo, mrows),
                    }
                }
                j += c;
            }
        }
        j0 = j1;
    }
}

/// Whether this CPU runs the tiles.
pub(crate) fn available() -> bool {
    crate::isa::tiles_available()
}

/// Output columns per chunk of [`packed_f32`]'s split.
const PACK_PANEL: usize = 48;

/// `out[rows, n] = x[rows, k] · wᵀ` for f32 weights and many rows: the activations packed
/// once, output columns split across threads.
pub fn packed_f32(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let xt = pack_transposed(x, rows, k);
    let chunks = crate::pool::long_chunks(threads, n.div_ceil(PACK_PANEL));
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        let (j0, j1) = (n * c / chunks, n * (c + 1) / chunks);
        // SAFETY: tile::available() held; `xt` packs x; w holds n rows of k; this call writes
        // columns j0..j1 of out, which no other call writes.
        unsafe {
            matmul_packed(
                &xt,
                rows,
                k,
                w.as_ptr().add(j0 * k),
                j1 - j0,
                optr.get().add(j0),
                n,
            )
        };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums16_puts_each_vectors_sum_in_its_lane() {
        if !available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        // Lane values that make every input's sum distinct and exact in f32.
        let vals: Vec<[f32; 16]> = (0..16)
            .map(|i| std::array::from_fn(|l| (i * 100 + l * 3) as f32 - 700.0))
            .collect();
        // SAFETY: AVX-512 checked; 16 values per load and store.
        let got = unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(vals[i].as_ptr()));
            let mut got = [0.0f32; 16];
            _mm512_storeu_ps(got.as_mut_ptr(), sums16(v));
            got
        };
        let want: Vec<f32> = vals.iter().map(|v| v.iter().sum()).collect();
        assert_eq!(got.to_vec(), want);
    }

    #[test]
    fn tiles_match_a_plain_dot_product_at_every_edge() {
        if !available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        for (rows, cols, k) in [
            (1, 1, 1),
            (3, 7, 15),
            (5, 13, 16),
            (9, 6, 33),
            (70, 20, 100),
            (20, 7, 600),
            (33, 25, 40),
            (8, 7, 100),
            (19, 5, 48),
        ] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 31) % 17) as f32 - 8.0)
                .collect();
            let w: Vec<f32> = (0..cols * k).map(|i| ((i * 7) % 11) as f32 * 0.5).collect();
            let wb: Vec<u16> = w
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let wh: Vec<u16> = w
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let ldo = cols + 3;
            let want: Vec<f32> = (0..rows * cols)
                .map(|t| {
                    (0..k)
                        .map(|i| x[t / cols * k + i] * w[t % cols * k + i])
                        .sum()
                })
                .collect();
            let mut outs = Vec::new();
            {
                let xt = pack_transposed(&x, rows, k);
                let mut out = vec![f32::NAN; rows * ldo];
                // SAFETY: AVX-512 checked; sizes as documented.
                unsafe { matmul_packed(&xt, rows, k, w.as_ptr(), cols, out.as_mut_ptr(), ldo) };
                outs.push(out);
            }
            for which in 0..3 {
                let mut out = vec![f32::NAN; rows * ldo];
                // SAFETY: AVX-512 checked above; sizes as documented.
                unsafe {
                    let o = out.as_mut_ptr();
                    match which {
                        0 => matmul(
                            x.as_ptr(),
                            rows,
                            k,
                            F32Rows {
                                ptr: w.as_ptr(),
                                stride: k,
                            },
                            cols,
                            o,
                            ldo,
                        ),
                        1 => matmul(
                            x.as_ptr(),
                            rows,
                            k,
                            Bf16Rows {
                                ptr: wb.as_ptr().cast(),
                                stride: k,
                            },
                            cols,
                            o,
                            ldo,
                        ),
                        _ => matmul(
                            x.as_ptr(),
                            rows,
                            k,
                            F16Rows {
                                ptr: wh.as_ptr().cast(),
                                stride: k,
                            },
                            cols,
                            o,
                            ldo,
                        ),
                    }
                }
                outs.push(out);
            }
            for out in outs {
                for r in 0..rows {
                    for j in 0..cols {
                        assert_eq!(
                            out[r * ldo + j],
                            want[r * cols + j],
                            "{rows}x{cols}x{k} at {r},{j}"
                        );
                    }
                    assert!(out[r * ldo + cols..(r + 1) * ldo]
                        .iter()
                        .all(|v| v.is_nan()));
                }
            }
        }
    }
}
