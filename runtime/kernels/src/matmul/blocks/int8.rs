//! Block-format matmuls with 8-bit activations (AVX2), for steps of a few rows when
//! [`Activations::Q8`](crate::options::Activations) asks for them: each 32 activations of a
//! row quantized to signed bytes with one f32 scale (`d = max|x| / 127`, `q = round(x / d)`),
//! each weight group's integers multiplied with them in 16-bit pairs (`vpmaddubsw`) and summed
//! to 32 bits (`vpmaddwd`), then scaled in f32: `Σ x̂·(s·q_w + o) = s·d·Σ q_w·q_x + o·d·Σ q_x`
//! (`x̂ = d·q_x`), the dot product of the weights with the rounded activations, as llama.cpp
//! computes it.
//!
//! Its deviation from the exact product is `Σ w·(x̂ − x)`: the rounding meets the weights, which
//! are centred near 0. (With the exact `Σ x` for the offset half, `o·Σ x`, the rounding meets
//! `s·q_w` instead, all of one sign for the unsigned formats and twice the size: SmolLM2's Q4_1
//! logits moved up to 5.5 from the reference, 0.64 on average, against 1.6 and 0.28 this way,
//! on one 16-token prompt.)
//!
//! Unsigned weight integers (4 and 5 bits, and Q4_K's and Q5_K's) meet the signed activations
//! directly; signed ones (Q8_0's `q`, Q6_K's `q − 32`) give their sign to the activations
//! (`vpsignb`) and their magnitude to the unsigned operand. Products of two bytes summed in
//! pairs stay within 16 bits: at most `2·128·127`.

use super::avx2::{hsum, Unpack};
use super::{k_bytes, q6_bytes};
use maxc_schema::blocks::{
    as_blocks, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
    QK,
};
use std::arch::x86_64::*;

/// A step's activations quantized per 32 values: `q` (rows·k bytes), per group its scale `d`
/// (rows·k/32) and its rounded sum `h = d·Σ q`, laid out for eight rows at a time (one
/// vector): group `g` of row `r` at [`Q8Rows::at`], rows past the last 0.
pub struct Q8Rows<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub h: &'a [f32],
}

/// Quantized activations' buffers, kept between calls.
#[derive(Default)]
pub struct Q8Buffers {
    q: Vec<i8>,
    d: Vec<f32>,
    h: Vec<f32>,
}

impl Q8Rows<'_> {
    /// Where `h` holds group `g` of row `r` (rows of `k` values).
    pub fn at(k: usize, r: usize, g: usize) -> usize {
        (r / 8) * 8 * (k / QK) + 8 * g + r % 8
    }
}

impl Q8Buffers {
    /// The rows last quantized.
    pub fn rows(&self) -> Q8Rows<'_> {
        Q8Rows {
            q: &self.q,
            d: &self.d,
            h: &self.h,
        }
    }
}

/// A kernel on 8-bit activations: columns `cols` of `out[rows, n] = x[rows, k] · wᵀ`, `out`
/// starting at column `cols.start` of row 0 (row stride `n`).
pub type Q8Fn = unsafe fn(
    x: &Q8Rows,
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
);

/// Quantizes `x[rows, k]` (k a multiple of 32) into `buf`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize(x: &[f32], rows: usize, k: usize, buf: &mut Q8Buffers) {
    let groups = rows * k / QK;
    let Q8Buffers { q, d, h } = buf;
    q.resize(rows * k, 0);
    d.resize(groups, 0.0);
    h.clear();
    h.resize(rows.div_ceil(8) * 8 * (k / QK), 0.0);
    let x = &x[..rows * k];
    for (i, ((xg, qg), dg)) in x
        .chunks_exact(QK)
        .zip(q.chunks_exact_mut(QK))
        .zip(d.iter_mut())
        .enumerate()
    {
        let at = Q8Rows::at(k, i / (k / QK), i % (k / QK));
        // SAFETY: 32 values read and 32 bytes written, unaligned; this function's features.
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
            *dg = amax / 127.0;
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            // Rounded to nearest (even on ties), within ±127.
            let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)));
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            // The packs interleave the 128-bit lanes' four-byte pieces: put them in order.
            let ordered =
                _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qg.as_mut_ptr().cast(), ordered);
            // Σ q, exact in 32 bits (and in f32: at most 32·127).
            let sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            h[at] = *dg * hsum(_mm256_cvtepi32_ps(sums));
        }
    }
}

/// A block's 32-value groups as 32 integer bytes for the dot products with 8-bit activations.
pub(super) trait Bytes: Unpack {
    /// Whether the bytes are signed (Q8_0's `q`, Q6_K's `q − 32`) rather than unsigned
    /// (at most 63).
    const SIGNED: bool;
    /// Whether groups have an offset (`Unpack::group`'s second value is not always 0).
    const OFFSET: bool;
    /// Group `g`'s integers, in the order of its values.
    ///
    /// # Safety
    /// AVX2 must be available; `g < GROUPS`.
    unsafe fn bytes(&self, g: usize) -> __m256i;
    /// The scales of group `g`'s eight sums of four products (values `4i..4i + 4`).
    ///
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn lanes(s: &Self::Scales, g: usize) -> __m256 {
        // SAFETY: the caller has AVX2.
        unsafe { _mm256_set1_ps(Self::group(s, g).0) }
    }
}

/// The 32 nibbles of 16 bytes as bytes (low nibbles are values 0..16, high ones 16..32).
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
unsafe fn nibble_bytes(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes read unaligned; the caller's AVX2.
    unsafe {
        let q = _mm_loadu_si128(qs.as_ptr().cast());
        let both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }
}

impl Bytes for BlockQ8_0 {
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn bytes(&self, _: usize) -> __m256i {
        // SAFETY: 32 bytes read unaligned; the caller's AVX2.
        unsafe { _mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }
}

/// [`Bytes`] for the unsigned formats (all with offsets): `$this` the block, `$g` the group.
macro_rules! unsigned_bytes {
    ($($block:ty => |$this:ident, $g:ident| $bytes:expr;)*) => {$(
        impl Bytes for $block {
            const SIGNED: bool = false;
            const OFFSET: bool = true;
            #[inline(always)]
            unsafe fn bytes(&self, g: usize) -> __m256i {
                let ($this, $g) = (self, g);
                // SAFETY: the caller has AVX2 (the trait's contract); the helpers read within
                // the block.
                unsafe { $bytes }
            }
        }
    )*};
}

unsigned_bytes! {
    BlockQ4_0 => |b, _g| nibble_bytes(&b.qs);
    BlockQ4_1 => |b, _g| nibble_bytes(&b.qs);
    BlockQ5_0 => |b, _g| {
        let (lo, hi) = super::avx2::nibbles5(&b.qs, b.qh);
        _mm256_set_m128i(hi, lo)
    };
    BlockQ5_1 => |b, _g| {
        let (lo, hi) = super::avx2::nibbles5(&b.qs, b.qh);
        _mm256_set_m128i(hi, lo)
    };
    BlockQ4K => |b, g| k_bytes(&b.qs, None, g);
    BlockQ5K => |b, g| k_bytes(&b.qs, Some(&b.qh), g);
}

/// Each 16 values have their own scale (`Unpack::scales` gives them multiplied by `d`).
impl Bytes for BlockQ6K {
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn bytes(&self, g: usize) -> __m256i {
        // SAFETY: as `q6_bytes`.
        unsafe { q6_bytes(self, g) }
    }
    #[inline(always)]
    unsafe fn lanes(s: &[f32; 16], g: usize) -> __m256 {
        // SAFETY: the caller has AVX2.
        unsafe { _mm256_set_m128(_mm_set1_ps(s[2 * g + 1]), _mm_set1_ps(s[2 * g])) }
    }
}

/// Group `g` of `blk` (the `at`-th 32 values of its row) into rows `0..R` of `acc` and the
/// offsets: `acc += lanes·d·Σ q_w·q_x` (per four values), `offset·h` into `offs1` (one or two
/// rows) or, for the eight rows at once, into `offs` (lane `r`: row `r`).
///
/// # Safety
/// AVX2, FMA and F16C; rows `0..R` of `x` exist from `xq` (k bytes each) and `xd` (k / 32
/// each); `xh` points at their eight-row block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<B: Bytes, const R: usize>(
    blk: &B,
    scales: &B::Scales,
    g: usize,
    at: usize,
    xq: *const i8,
    xd: &[f32],
    xh: *const f32,
    k: usize,
    acc: &mut [__m256; R],
    offs: &mut __m256,
    offs1: &mut [f32; R],
) {
    let groups = k / QK;
    // SAFETY: as the function's contract.
    unsafe {
        let lanes = B::lanes(scales, g);
        let q = blk.bytes(g);
        let magnitude = if B::SIGNED { _mm256_sign_epi8(q, q) } else { q };
        let ones = _mm256_set1_epi16(1);
        for r in 0..R {
            let xv = _mm256_loadu_si256(xq.add(r * k + at * QK).cast());
            let xv = if B::SIGNED {
                _mm256_sign_epi8(xv, q)
            } else {
                xv
            };
            let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xv), ones);
            let scale = _mm256_mul_ps(lanes, _mm256_set1_ps(*xd.get_unchecked(r * groups + at)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
        if B::OFFSET {
            let offset = B::group(scales, g).1;
            if R <= 2 {
                for r in 0..R {
                    offs1[r] = offset.mul_add(*xh.add(8 * at + r), offs1[r]);
                }
            } else {
                let h = _mm256_loadu_ps(xh.add(8 * at));
                *offs = _mm256_fmadd_ps(_mm256_set1_ps(offset), h, *offs);
            }
        }
    }
}

/// Rows `row0..row0 + R` of columns `cols`. Up to two rows take even and odd groups into
/// separate accumulators (so that each chain waits on every other group only); more rows
/// are independent chains already.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn columns<B: Bytes, const R: usize>(
    x: &Q8Rows,
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
    let xd = &x.d[row0 * groups..];
    // (Row groups start at multiples of eight rows.)
    let xh = x.h[Q8Rows::at(k, row0, 0)..].as_ptr();
    let split = if R <= 2 { 2 } else { 1 };
    for j in cols.clone() {
        let blocks = &w[j * nb..(j + 1) * nb];
        crate::matmul::tile::prefetch_row(
            blocks.as_ptr().cast(),
            std::mem::size_of_val(blocks),
            super::AHEAD,
        );
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        let mut offs = [_mm256_setzero_ps(); 2];
        let mut offs1 = [[0.0f32; R]; 2];
        // SAFETY (the `group` calls): the caller has AVX2, FMA and F16C; rows row0..row0 + R
        // of x exist.
        let mut run = |blk: &B, scales: &B::Scales, g: usize, at: usize, set: usize| unsafe {
            group::<B, R>(
                blk,
                scales,
                g,
                at,
                xq,
                xd,
                xh,
                k,
                &mut acc[set],
                &mut offs[set],
                &mut offs1[set],
            )
        };
        if B::GROUPS == 1 {
            let mut b = 0;
            while b + split <= nb {
                for u in 0..split {
                    let blk = &blocks[b + u];
                    // SAFETY: the caller has F16C.
                    run(blk, &unsafe { blk.scales() }, 0, b + u, u);
                }
                b += split;
            }
            if b < nb {
                let blk = &blocks[b];
                // SAFETY: as above.
                run(blk, &unsafe { blk.scales() }, 0, b, 0);
            }
        } else {
            for (b, blk) in blocks.iter().enumerate() {
                // SAFETY: the caller has F16C.
                let scales = unsafe { blk.scales() };
                // (Constant trip counts, so that each group's index and parity is a constant.)
                for gp in 0..B::GROUPS / 2 {
                    for u in 0..2 {
                        let g = 2 * gp + u;
                        run(
                            blk,
                            &scales,
                            g,
                            b * B::GROUPS + g,
                            if split == 2 { u } else { 0 },
                        );
                    }
                }
            }
        }
        let mut o = [0.0f32; 8];
        // SAFETY: AVX2; eight floats written.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_add_ps(offs[0], offs[1])) };
        for r in 0..R {
            // SAFETY: AVX2.
            let sum = unsafe { hsum(_mm256_add_ps(acc[0][r], acc[1][r])) };
            out[(row0 + r) * n + j - cols.start] = sum + o[r] + (offs1[0][r] + offs1[1][r]);
        }
    }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `rows` quantized rows of `k` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn stream<B: Bytes>(
    x: &Q8Rows,
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    let Some(w) = as_blocks::<B>(w) else { return };
    row_groups!(rows, n, k, cols, columns [B,] (x, w, out) [1, 2, 3, 4, 5, 6, 7; 8]);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use maxc_schema::DType;

    fn host_has_avx2() -> bool {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }

    /// Blocks of `dtype` from a byte pattern, with small finite scales (as the f32 kernels'
    /// test makes them), Q6_K's sub-block scales at both ends of their range (−128 and 127)
    /// among others (also the 16-bit kernels' test weights).
    pub(crate) fn weights(dtype: DType, n: usize, k: usize) -> Vec<u8> {
        let (elems, size) = dtype.block();
        let mut w: Vec<u8> = (0..n * k / elems * size)
            .map(|i| ((i * 73) % 256) as u8)
            .collect();
        for (i, b) in w.chunks_exact_mut(size).enumerate() {
            let d = if dtype == DType::Q6K { size - 2 } else { 0 };
            b[d..d + 2]
                .copy_from_slice(&half::f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes());
            if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                b[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
            }
            if matches!(dtype, DType::Q4K | DType::Q5K) {
                b[2..4].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
            }
            if dtype == DType::Q6K {
                b[192..208].copy_from_slice(&[
                    0x80, 0x7F, 3, 0xFD, 0x80, 0x80, 0x7F, 0x7F, 1, 0, 0xFF, 64, 0xC0, 17, 0x81,
                    100,
                ]);
            }
        }
        w
    }

    fn run(dtype: DType, x: &[f32], w: &[u8], rows: usize, n: usize, k: usize) -> Vec<f32> {
        let mut buf = Q8Buffers::default();
        let f = super::super::HandKernels::of(dtype, k, crate::isa::Isa::Avx2)
            .q8
            .unwrap();
        let mut out = vec![f32::NAN; rows * n];
        // SAFETY: the host has AVX2, FMA and F16C (checked by the callers).
        unsafe {
            quantize(x, rows, k, &mut buf);
            f(&buf.rows(), w, &mut out, rows, n, k, 0..n);
        }
        out
    }

    #[test]
    fn activations_are_rounded_to_the_nearest_step_of_their_groups_largest_magnitude() {
        if !host_has_avx2() {
            return;
        }
        let (rows, k) = (11, 96);
        let mut x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 300.0 - 1.7)
            .collect();
        x[32..64].fill(0.0);
        let mut buf = Q8Buffers::default();
        // SAFETY: checked above.
        unsafe { quantize(&x, rows, k, &mut buf) };
        let Q8Rows { q, d, h } = buf.rows();
        for (g, xg) in x.chunks_exact(QK).enumerate() {
            let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(d[g], amax / 127.0, "group {g}'s scale");
            for (i, v) in xg.iter().enumerate() {
                let want = if amax > 0.0 {
                    (v * (127.0 / amax)).round_ties_even() as i8
                } else {
                    0
                };
                assert_eq!(q[g * QK + i], want, "group {g} value {i} ({v})");
            }
            let rounded: f32 = q[g * QK..(g + 1) * QK].iter().map(|&v| v as f32).sum();
            let at = Q8Rows::at(k, g / (k / QK), g % (k / QK));
            assert_eq!(h[at], d[g] * rounded, "group {g}'s rounded sum");
        }
        // Rows past the last (11 of 16) hold zeros.
        for r in rows..16 {
            for g in 0..k / QK {
                assert_eq!(h[Q8Rows::at(k, r, g)], 0.0, "row {r} group {g}");
            }
        }
    }

    #[test]
    fn activations_on_the_8_bit_grid_give_the_dequantized_reference_exactly() {
        if !host_has_avx2() {
            return;
        }
        // Each group of x is d·(integers within ±127, one of them ±127) with d a power of
        // two: quantizing it loses nothing, so the kernels must give the f32 product.
        let (n, k) = (9, 512);
        let x: Vec<f32> = (0..10 * k)
            .map(|i| {
                let d = [0.25f32, 0.0078125, 1.0][(i / QK) % 3];
                let q = if i % QK == 5 {
                    -127
                } else {
                    ((i * 37) % 255) as i32 - 127
                };
                d * q as f32
            })
            .collect();
        for dtype in DType::block_formats() {
            let w = weights(dtype, n, k);
            let wf = maxc_schema::blocks::dequantize(dtype, &w).unwrap();
            for rows in 1..=10 {
                let got = run(dtype, &x, &w, rows, n, k);
                for r in 0..rows {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|i| x[r * k + i] as f64 * wf[j * k + i] as f64)
                            .sum();
                        let g = got[r * n + j] as f64;
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{dtype} rows {rows} ({r}, {j}): {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn any_activations_stay_within_the_rounding_of_their_groups() {
        if !host_has_avx2() {
            return;
        }
        // Each activation moves by at most half its group's step (max|x| / 254): the product
        // moves by far less than 2% of Σ|w·x| (a kernel that mixed up values, groups or rows
        // would be off by the whole of it).
        let (n, k) = (9, 512);
        let x: Vec<f32> = (0..10 * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for dtype in DType::block_formats() {
            let w = weights(dtype, n, k);
            let wf = maxc_schema::blocks::dequantize(dtype, &w).unwrap();
            for rows in 1..=10 {
                let got = run(dtype, &x, &w, rows, n, k);
                for r in 0..rows {
                    for j in 0..n {
                        let terms = (0..k).map(|i| (x[r * k + i] as f64, wf[j * k + i] as f64));
                        let want: f64 = terms.clone().map(|(a, b)| a * b).sum();
                        let size: f64 = terms.map(|(a, b)| (a * b).abs()).sum();
                        let g = got[r * n + j] as f64;
                        assert!(
                            (g - want).abs() <= 0.02 * size + 1e-5,
                            "{dtype} rows {rows} ({r}, {j}): {g} vs {want} (Σ|w·x| {size})"
                        );
                    }
                }
            }
        }
    }
}
