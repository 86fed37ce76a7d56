//! Block-format matmuls with 16-bit activations (AVX2 and AVX-512), for steps of a few rows:
//! each 32 activations of a row quantized to 16-bit integers with one f32 scale
//! (`d = max|x| / 32767`, `q = round(x / d)`), each weight group's integers widened once to
//! 16 bits and multiplied with them in pairs (`vpmaddwd`: 32-bit sums), then scaled in f32.
//!
//! The rounding moves each activation by at most `max|x| / 65534` of its group: 258 times
//! less than the 8-bit activations of [`int8`](super::int8) (`max|x| / 254`), which moved
//! SmolLM2's logits up to 1.9; here they stay within a few thousandths of the exact f32
//! product (measured in the README), while the weights are never converted to f32: a group
//! of 32 is one or two widening moves, not eight conversions.
//!
//! The K formats' sub-block scales are integers (6 bits; Q6_K's 8 bits per 16 values): they
//! multiply the widened weights in 16 bits (at most `63·31` for Q5_K, `128·32` for Q6_K), so
//! a super-block's eight group sums take one f32 scale, `d`, applied once per super-block
//! per row; each group's own factor is the activations' scale. Sums stay within 32 bits: a
//! pair of products is at most `2·4096·32767`, a group's sixteen pairs summed in two halves
//! at most `2^29`.
//!
//! Offsets (Q4_1's and Q5_1's `m`, the K formats' `−dmin·m`) meet the rounded activations'
//! sum (`d·Σ q`, computed when they are quantized), as in the 8-bit kernels: the rounding
//! meets the weights, centred near 0. Q4_0's and Q5_0's `− 8` and `− 16` are applied to the
//! integers instead (signed words, no offset).
#![allow(clippy::needless_range_loop)]

use super::avx2::hsum;
use super::int8::Bytes;
use maxc_schema::blocks::{
    as_blocks, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
    QK,
};
use std::arch::x86_64::*;

/// A step's activations quantized per 32 values, row after row: `q` (rows·k words), per
/// group its scale `d` and its rounded sum `h = d·Σ q` (rows·k/32 each, group `g` of row `r`
/// at `r·k/32 + g`).
pub struct I16Rows<'a> {
    pub q: &'a [i16],
    pub d: &'a [f32],
    pub h: &'a [f32],
}

/// Quantized activations' buffers, kept between calls.
#[derive(Default)]
pub struct I16Buffers {
    q: Vec<i16>,
    d: Vec<f32>,
    h: Vec<f32>,
}

impl I16Buffers {
    /// The rows last quantized.
    pub fn rows(&self) -> I16Rows<'_> {
        I16Rows {
            q: &self.q,
            d: &self.d,
            h: &self.h,
        }
    }
}

/// A kernel on 16-bit activations: columns `cols` of `out[rows, n] = x[rows, k] · wᵀ`, `out`
/// starting at column `cols.start` of row 0 (row stride `n`).
pub type I16Fn = unsafe fn(
    x: &I16Rows,
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
);

/// The largest magnitude of the 16-bit activations.
const LEVELS: f32 = 32767.0;

/// Quantizes `x[rows, k]` (k a multiple of 32) into `buf`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize(x: &[f32], rows: usize, k: usize, buf: &mut I16Buffers) {
    let groups = rows * k / QK;
    let I16Buffers { q, d, h } = buf;
    q.resize(rows * k, 0);
    d.resize(groups, 0.0);
    h.resize(groups, 0.0);
    let x = &x[..rows * k];
    for (((xg, qg), dg), hg) in x
        .chunks_exact(QK)
        .zip(q.chunks_exact_mut(QK))
        .zip(d.iter_mut())
        .zip(h.iter_mut())
    {
        // SAFETY: 32 values read and 32 words written, unaligned; this function's features.
        unsafe {
            let p = xg.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let sign = _mm256_set1_ps(-0.0);
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for v in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *v));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            *dg = amax / LEVELS;
            let inv = _mm256_set1_ps(if amax > 0.0 { LEVELS / amax } else { 0.0 });
            // Rounded to nearest (even on ties), within ±32767.
            let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)));
            // The packs interleave the 128-bit lanes' eight-byte pieces: put them in order.
            let order = |a, b| _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0b11_01_10_00);
            _mm256_storeu_si256(qg.as_mut_ptr().cast(), order(i[0], i[1]));
            _mm256_storeu_si256(qg.as_mut_ptr().add(16).cast(), order(i[2], i[3]));
            // Σ q, exact in 32 bits and in f32 (at most 32·32767 < 2^24).
            let sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            *hg = *dg * hsum(_mm256_cvtepi32_ps(sums));
        }
    }
}

/// A block's 32-value groups as 16-bit words for the dot products with 16-bit activations:
/// the integers of [`Bytes`], less a constant where the format has one (Q4_0, Q5_0), times
/// the integer sub-block scales where the format has them (the K formats).
pub(super) trait Words: Bytes {
    /// What the block's groups share, read once per block.
    type Sc: Copy;
    /// Subtracted from every byte (Q4_0's 8, Q5_0's 16; 0 elsewhere).
    const BIAS: i8 = 0;
    /// Whether the words are multiplied by [`Words::mults`].
    const SCALED: bool = false;
    /// Whether the block's groups have offsets ([`Words::offset`] for 32-value blocks,
    /// [`Words::offsets8`] for the K super-blocks).
    const SHIFTED: bool = false;
    /// # Safety
    /// F16C (and AVX2) must be available.
    unsafe fn sc(&self) -> Self::Sc;
    /// The f32 scale of the block's integer sums.
    fn d(s: &Self::Sc) -> f32;
    /// The integer scales of group `g`'s first and last 16 words.
    #[inline(always)]
    fn mults(_: &Self::Sc, _: usize) -> (i16, i16) {
        (1, 1)
    }
    /// A 32-value block's offset.
    #[inline(always)]
    fn offset(_: &Self::Sc) -> f32 {
        0.0
    }
    /// A K super-block's eight group offsets.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn offsets8(_: &Self::Sc) -> __m256 {
        // SAFETY: the caller has AVX2.
        unsafe { _mm256_setzero_ps() }
    }
}

/// Group `g`'s bytes, less the format's bias; whether the result is signed.
///
/// # Safety
/// AVX2 must be available; `g < GROUPS`.
#[inline(always)]
unsafe fn biased<B: Words>(blk: &B, g: usize) -> __m256i {
    // SAFETY: as the function's contract.
    unsafe {
        let b = blk.bytes(g);
        if B::BIAS != 0 {
            _mm256_sub_epi8(b, _mm256_set1_epi8(B::BIAS))
        } else {
            b
        }
    }
}

/// Whether `B`'s words come from signed bytes.
const fn signed<B: Words>() -> bool {
    B::SIGNED || B::BIAS != 0
}

/// Group `g`'s 32 words as two vectors of sixteen (AVX2).
///
/// # Safety
/// AVX2 must be available; `g < GROUPS`.
#[inline(always)]
unsafe fn words2<B: Words>(blk: &B, s: &B::Sc, g: usize) -> [__m256i; 2] {
    // SAFETY: as the function's contract.
    unsafe {
        let b = biased(blk, g);
        let (l, h) = (_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        let (mut l, mut h) = if signed::<B>() {
            (_mm256_cvtepi8_epi16(l), _mm256_cvtepi8_epi16(h))
        } else {
            (_mm256_cvtepu8_epi16(l), _mm256_cvtepu8_epi16(h))
        };
        if B::SCALED {
            let (a, c) = B::mults(s, g);
            l = _mm256_mullo_epi16(l, _mm256_set1_epi16(a));
            h = _mm256_mullo_epi16(h, _mm256_set1_epi16(c));
        }
        [l, h]
    }
}

/// Group `g`'s 32 words as one vector (AVX-512).
///
/// # Safety
/// AVX-512F/BW must be available; `g < GROUPS`.
#[inline(always)]
unsafe fn words512<B: Words>(blk: &B, s: &B::Sc, g: usize) -> __m512i {
    // SAFETY: as the function's contract.
    unsafe {
        let b = biased(blk, g);
        let w = if signed::<B>() {
            _mm512_cvtepi8_epi16(b)
        } else {
            _mm512_cvtepu8_epi16(b)
        };
        if B::SCALED {
            let (a, c) = B::mults(s, g);
            let m = if a == c {
                _mm512_set1_epi16(a)
            } else {
                _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set1_epi16(a)),
                    _mm256_set1_epi16(c),
                    1,
                )
            };
            _mm512_mullo_epi16(w, m)
        } else {
            w
        }
    }
}

/// The 32-value formats: `d` and the offset of [`super::avx2::Unpack`]'s one group.
macro_rules! block32_words {
    ($($block:ty $(=> bias $bias:literal)?;)*) => {$(
        impl Words for $block {
            type Sc = (f32, f32);
            $(const BIAS: i8 = $bias;)?
            const SHIFTED: bool = <$block as Bytes>::OFFSET && Self::BIAS == 0;
            #[inline(always)]
            unsafe fn sc(&self) -> (f32, f32) {
                use super::avx2::Unpack;
                // SAFETY: the caller has F16C.
                unsafe { <$block as Unpack>::group(&self.scales(), 0) }
            }
            #[inline(always)]
            fn d(s: &(f32, f32)) -> f32 {
                s.0
            }
            #[inline(always)]
            fn offset(s: &(f32, f32)) -> f32 {
                s.1
            }
        }
    )*};
}

block32_words! {
    BlockQ8_0;
    BlockQ4_0 => bias 8;
    BlockQ4_1;
    BlockQ5_0 => bias 16;
    BlockQ5_1;
}

/// A Q4_K or Q5_K super-block: `d`, each group's 6-bit scale, each group's `−dmin·m`.
#[derive(Clone, Copy)]
pub(super) struct KSc {
    d: f32,
    sc: [u8; 8],
    m: [f32; 8],
}

/// [`KSc`] of a super-block starting with `d` and `dmin`, with packed scales `q`.
///
/// # Safety
/// F16C and AVX2 must be available.
#[inline(always)]
unsafe fn k_sc<B: maxc_schema::blocks::Block>(blk: &B, q: &[u8; 12]) -> KSc {
    let bytes = super::k_scale_bytes(q);
    // SAFETY: K blocks start with the f16 `d` and `dmin`; sixteen bytes read; the caller's
    // F16C and AVX2.
    unsafe {
        let w = std::ptr::read_unaligned((blk as *const B).cast::<i32>());
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
        let (d, dmin) = (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)));
        let b = _mm_loadu_si128(bytes.as_ptr().cast());
        let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
        let mut out = KSc {
            d,
            sc: [0; 8],
            m: [0.0; 8],
        };
        _mm_storel_epi64(out.sc.as_mut_ptr().cast(), b);
        _mm256_storeu_ps(out.m.as_mut_ptr(), _mm256_mul_ps(m, _mm256_set1_ps(-dmin)));
        out
    }
}

macro_rules! k_words {
    ($($block:ty;)*) => {$(
        impl Words for $block {
            type Sc = KSc;
            const SCALED: bool = true;
            const SHIFTED: bool = true;
            #[inline(always)]
            unsafe fn sc(&self) -> KSc {
                // SAFETY: the caller has F16C and AVX2.
                unsafe { k_sc(self, &self.scales) }
            }
            #[inline(always)]
            fn d(s: &KSc) -> f32 {
                s.d
            }
            #[inline(always)]
            fn mults(s: &KSc, g: usize) -> (i16, i16) {
                (s.sc[g] as i16, s.sc[g] as i16)
            }
            #[inline(always)]
            unsafe fn offsets8(s: &KSc) -> __m256 {
                // SAFETY: eight floats read; the caller's AVX2.
                unsafe { _mm256_loadu_ps(s.m.as_ptr()) }
            }
        }
    )*};
}

k_words! {
    BlockQ4K;
    BlockQ5K;
}

/// Q6_K: `d`, and a signed 8-bit scale per 16 values.
impl Words for BlockQ6K {
    type Sc = (f32, [i8; 16]);
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn sc(&self) -> (f32, [i8; 16]) {
        // SAFETY: the caller has F16C.
        let d = unsafe { super::half_to_f32(u16::from_le_bytes(self.d)) };
        (d, self.scales)
    }
    #[inline(always)]
    fn d(s: &(f32, [i8; 16])) -> f32 {
        s.0
    }
    #[inline(always)]
    fn mults(s: &(f32, [i8; 16]), g: usize) -> (i16, i16) {
        (s.1[2 * g] as i16, s.1[2 * g + 1] as i16)
    }
}

/// What the kernels below do per vector width: the widened words, the dot product of 32
/// words with 32 activations (32-bit sums), and the f32 arithmetic on them.
trait Lanes {
    /// A group's words.
    type W: Copy;
    /// f32 accumulators.
    type F: Copy;
    /// # Safety
    /// The width's features; `g < GROUPS`.
    unsafe fn words<B: Words>(blk: &B, s: &B::Sc, g: usize) -> Self::W;
    /// `Σ w·x` over the group (in lanes), as f32.
    ///
    /// # Safety
    /// The width's features; 32 words readable at `x`.
    unsafe fn dot(w: Self::W, x: *const i16) -> Self::F;
    /// # Safety
    /// The width's features.
    unsafe fn zero() -> Self::F;
    /// `a·s + c`, `s` broadcast.
    ///
    /// # Safety
    /// The width's features.
    unsafe fn fma(a: Self::F, s: f32, c: Self::F) -> Self::F;
    /// # Safety
    /// The width's features.
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    /// The sum of the lanes.
    ///
    /// # Safety
    /// The width's features.
    unsafe fn sum(a: Self::F) -> f32;
}

/// Sixteen words to a vector, two vectors a group (AVX2).
struct Avx2;

impl Lanes for Avx2 {
    type W = [__m256i; 2];
    type F = __m256;
    #[inline(always)]
    unsafe fn words<B: Words>(blk: &B, s: &B::Sc, g: usize) -> [__m256i; 2] {
        // SAFETY: the caller has AVX2.
        unsafe { words2(blk, s, g) }
    }
    #[inline(always)]
    unsafe fn dot(w: [__m256i; 2], x: *const i16) -> __m256 {
        // SAFETY: the caller has AVX2; 32 words at x, read unaligned.
        unsafe {
            _mm256_cvtepi32_ps(_mm256_add_epi32(
                _mm256_madd_epi16(w[0], _mm256_loadu_si256(x.cast())),
                _mm256_madd_epi16(w[1], _mm256_loadu_si256(x.add(16).cast())),
            ))
        }
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller has AVX2.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, s: f32, c: __m256) -> __m256 {
        // SAFETY: the caller has FMA.
        unsafe { _mm256_fmadd_ps(a, _mm256_set1_ps(s), c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller has AVX2.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sum(a: __m256) -> f32 {
        // SAFETY: the caller has AVX2.
        unsafe { hsum(a) }
    }
}

/// 32 words to a vector, one a group (AVX-512).
struct Avx512;

impl Lanes for Avx512 {
    type W = __m512i;
    type F = __m512;
    #[inline(always)]
    unsafe fn words<B: Words>(blk: &B, s: &B::Sc, g: usize) -> __m512i {
        // SAFETY: the caller has AVX-512F/BW.
        unsafe { words512(blk, s, g) }
    }
    #[inline(always)]
    unsafe fn dot(w: __m512i, x: *const i16) -> __m512 {
        // SAFETY: the caller has AVX-512F/BW; 32 words at x, read unaligned.
        unsafe { _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x.cast()))) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller has AVX-512F.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, s: f32, c: __m512) -> __m512 {
        // SAFETY: the caller has AVX-512F.
        unsafe { _mm512_fmadd_ps(a, _mm512_set1_ps(s), c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller has AVX-512F.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sum(a: __m512) -> f32 {
        // SAFETY: the caller has AVX-512F.
        unsafe { _mm512_reduce_add_ps(a) }
    }
}

/// Rows `row0..row0 + R` of columns `cols`, each group's words widened once for the `R` rows.
/// Up to two rows take even and odd groups into separate accumulators, so that each chain
/// waits on every other group only. Each column prefetches the one [`super::AHEAD`] after
/// it: the rows are streamed once, and faster than the hardware's prefetchers start on them.
///
/// # Safety
/// `L`'s features, AVX2, FMA and F16C; rows `row0..row0 + R` of `x` exist.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn columns<L: Lanes, B: Words, const R: usize>(
    x: &I16Rows,
    w: &[B],
    out: &mut [f32],
    row0: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    let nb = k / B::ELEMS;
    let groups = k / QK;
    let xq = x.q[row0 * k..].as_ptr();
    let xd = x.d[row0 * groups..].as_ptr();
    let xh = x.h[row0 * groups..].as_ptr();
    let two = R <= 2;
    // SAFETY: as the function's contract; every read of x is within its rows.
    unsafe {
        for j in cols.clone() {
            let blocks = &w[j * nb..(j + 1) * nb];
            crate::matmul::tile::prefetch_row(
                blocks.as_ptr().cast(),
                std::mem::size_of_val(blocks),
                super::AHEAD,
            );
            let mut acc = [[L::zero(); R]; 2];
            let mut offs = [_mm256_setzero_ps(); R];
            let mut offs1 = [0.0f32; R];
            if B::GROUPS == 1 {
                // Blocks in pairs, so that each block's accumulator set is a constant.
                let mut b = 0;
                while b < nb {
                    for u in 0..2 {
                        if b + u == nb {
                            break;
                        }
                        let at = b + u;
                        let blk = &blocks[at];
                        let s = blk.sc();
                        let set = if two { u } else { 0 };
                        let wv = L::words(blk, &s, 0);
                        for r in 0..R {
                            let dot = L::dot(wv, xq.add(r * k + at * QK));
                            let scale = B::d(&s) * *xd.add(r * groups + at);
                            acc[set][r] = L::fma(dot, scale, acc[set][r]);
                            if B::SHIFTED {
                                offs1[r] =
                                    B::offset(&s).mul_add(*xh.add(r * groups + at), offs1[r]);
                            }
                        }
                    }
                    b += 2;
                }
            } else {
                for (b, blk) in blocks.iter().enumerate() {
                    let s = blk.sc();
                    // Each group's sums times its activations' scale, times the block's `d`
                    // once per block.
                    let mut part = [[L::zero(); R]; 2];
                    for g in 0..B::GROUPS {
                        let at = b * B::GROUPS + g;
                        let set = if two { g % 2 } else { 0 };
                        let wv = L::words(blk, &s, g);
                        for r in 0..R {
                            let dot = L::dot(wv, xq.add(r * k + at * QK));
                            part[set][r] = L::fma(dot, *xd.add(r * groups + at), part[set][r]);
                        }
                    }
                    let d = B::d(&s);
                    for r in 0..R {
                        acc[0][r] = L::fma(L::add(part[0][r], part[1][r]), d, acc[0][r]);
                        if B::SHIFTED {
                            let h = _mm256_loadu_ps(xh.add(r * groups + b * B::GROUPS));
                            offs[r] = _mm256_fmadd_ps(B::offsets8(&s), h, offs[r]);
                        }
                    }
                }
            }
            for r in 0..R {
                let sum = L::sum(L::add(acc[0][r], acc[1][r])) + hsum(offs[r]);
                out[(row0 + r) * n + j - cols.start] = sum + offs1[r];
            }
        }
    }
}

/// [`columns`] on AVX2 vectors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn columns2<B: Words, const R: usize>(
    x: &I16Rows,
    w: &[B],
    out: &mut [f32],
    row0: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    // SAFETY: as `columns`, with AVX2.
    unsafe { columns::<Avx2, B, R>(x, w, out, row0, n, k, cols) }
}

/// [`columns`] on AVX-512 vectors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn columns512<B: Words, const R: usize>(
    x: &I16Rows,
    w: &[B],
    out: &mut [f32],
    row0: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    // SAFETY: as `columns`, with AVX-512F/BW.
    unsafe { columns::<Avx512, B, R>(x, w, out, row0, n, k, cols) }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `rows` quantized rows of `k` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn stream2<B: Words>(
    x: &I16Rows,
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    let Some(w) = as_blocks::<B>(w) else { return };
    row_groups!(rows, n, k, cols, columns2 [B,] (x, w, out) [1, 2, 3; 4]);
}

/// # Safety
/// The CPU has AVX-512F/BW, AVX2, FMA and F16C; `x` holds `rows` quantized rows of `k`
/// values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn stream512<B: Words>(
    x: &I16Rows,
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    let Some(w) = as_blocks::<B>(w) else { return };
    row_groups!(rows, n, k, cols, columns512 [B,] (x, w, out) [1, 2, 3, 4, 5, 6, 7; 8]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use maxc_schema::DType;

    fn host_has(isa: Isa) -> bool {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        match isa {
            Isa::Avx512 => {
                avx2 && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
            }
            Isa::Avx2 => avx2,
            Isa::Baseline => false,
        }
    }

    use super::super::int8::tests::weights;

    fn run(
        isa: Isa,
        dtype: DType,
        x: &[f32],
        w: &[u8],
        rows: usize,
        n: usize,
        k: usize,
    ) -> Vec<f32> {
        let mut buf = I16Buffers::default();
        let f = super::super::HandKernels::of(dtype, k, isa).i16.unwrap();
        let mut out = vec![f32::NAN; rows * n];
        // SAFETY: the host has the ISA's features (checked by the callers).
        unsafe {
            quantize(x, rows, k, &mut buf);
            f(&buf.rows(), w, &mut out, rows, n, k, 0..n);
        }
        out
    }

    #[test]
    fn activations_are_rounded_to_the_nearest_step_of_their_groups_largest_magnitude() {
        if !host_has(Isa::Avx2) {
            return;
        }
        let (rows, k) = (3, 96);
        let mut x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 300.0 - 1.7)
            .collect();
        x[32..64].fill(0.0);
        let mut buf = I16Buffers::default();
        // SAFETY: checked above.
        unsafe { quantize(&x, rows, k, &mut buf) };
        let I16Rows { q, d, h } = buf.rows();
        for (g, xg) in x.chunks_exact(QK).enumerate() {
            let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(d[g], amax / 32767.0, "group {g}'s scale");
            for (i, v) in xg.iter().enumerate() {
                let want = if amax > 0.0 {
                    (v * (32767.0 / amax)).round_ties_even() as i16
                } else {
                    0
                };
                assert_eq!(q[g * QK + i], want, "group {g} value {i} ({v})");
            }
            let rounded: f32 = q[g * QK..(g + 1) * QK].iter().map(|&v| v as f32).sum();
            assert_eq!(h[g], d[g] * rounded, "group {g}'s rounded sum");
        }
    }

    #[test]
    fn activations_on_the_16_bit_grid_give_the_dequantized_reference() {
        // Each group of x is d·(integers within ±32767, one of them ±32767) with d a power of
        // two: quantizing it loses nothing, so the kernels must give the f32 product (to
        // f32 rounding), on every format, row count and instruction set.
        let (n, k) = (9, 512);
        let x: Vec<f32> = (0..10 * k)
            .map(|i| {
                let d = [2f32.powi(-10), 2f32.powi(-17), 2f32.powi(-15)][(i / QK) % 3];
                let q = if i % QK == 5 {
                    -32767
                } else {
                    ((i * 7919) % 65535) as i32 - 32767
                };
                d * q as f32
            })
            .collect();
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !host_has(isa) {
                continue;
            }
            for dtype in DType::block_formats() {
                let w = weights(dtype, n, k);
                let wf = maxc_schema::blocks::dequantize(dtype, &w).unwrap();
                for rows in 1..=10 {
                    let got = run(isa, dtype, &x, &w, rows, n, k);
                    for r in 0..rows {
                        for j in 0..n {
                            let terms = (0..k).map(|i| x[r * k + i] as f64 * wf[j * k + i] as f64);
                            let want: f64 = terms.clone().sum();
                            let size: f64 = terms.map(f64::abs).sum();
                            let g = got[r * n + j] as f64;
                            assert!(
                                (g - want).abs() <= 1e-5 * size + 1e-6,
                                "{isa:?} {dtype} rows {rows} ({r}, {j}): {g} vs {want} (Σ|w·x| {size})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn any_activations_stay_within_the_rounding_of_their_groups() {
        // Each activation moves by at most half its group's step (max|x| / 65534): the
        // product moves by less than 1e-4 of Σ|w·x| (a kernel that mixed up values, groups,
        // scales or rows would be off by the whole of it).
        let (n, k) = (9, 512);
        let x: Vec<f32> = (0..10 * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !host_has(isa) {
                continue;
            }
            for dtype in DType::block_formats() {
                let w = weights(dtype, n, k);
                let wf = maxc_schema::blocks::dequantize(dtype, &w).unwrap();
                for rows in 1..=10 {
                    let got = run(isa, dtype, &x, &w, rows, n, k);
                    for r in 0..rows {
                        for j in 0..n {
                            let terms = (0..k).map(|i| (x[r * k + i] as f64, wf[j * k + i] as f64));
                            let want: f64 = terms.clone().map(|(a, b)| a * b).sum();
                            let size: f64 = terms.map(|(a, b)| (a * b).abs()).sum();
                            let g = got[r * n + j] as f64;
                            assert!(
                                (g - want).abs() <= 1e-4 * size + 1e-6,
                                "{isa:?} {dtype} rows {rows} ({r}, {j}): {g} vs {want} (Σ|w·x| {size})"
                            );
                        }
                    }
                }
            }
        }
    }
}
