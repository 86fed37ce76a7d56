//! Hand-vectorized matmul kernels (`std::arch`) for the block formats and for bf16:
//! - AVX-512 register tiles on every block format (`avx512`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
//!   the K super-blocks Q4_K, Q5_K, Q6_K): each 32 values dequantized once into registers for up
//!   to eight rows (a super-block's packed scales unpacked once for its eight groups), and the
//!   same dequantizers for prefill's panels;
//! - row-streaming kernels for Q4_K and bf16 (AVX-512; Q4_K's is the baseline the weights bench
//!   compares the tiles with) and for every block format (AVX2 + FMA) that factor each 32-value
//!   group's scale out of the dot product (`Σ x·(d·q + m) = d·Σ x·q + m·Σ x`, with `Σ x` per
//!   group computed once per call), each weight block unpacked once for up to four rows; five
//!   to eight rows share each group dequantized once instead, and prefill's panels are
//!   dequantized by the same unpacking (scales converted with F16C, a block's pair at once).
//!
//! Values are widened to f32 and accumulated in f32: the same arithmetic as the generic kernels
//! in another order.
//!
//! Rows are indexed (`acc[r]`, `x[(row0 + r) * k ..]`) in loops of a constant count that the
//! compiler unrolls into registers.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use maxc_schema::blocks::{
    as_blocks, Block, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0, QK,
};

/// A streaming kernel: columns `cols` of `out[rows, n] = x[rows, k] · wᵀ`, `out` starting at
/// column `cols.start` of row 0 (row stride `n`).
pub type StreamFn = unsafe fn(
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
);

/// How many weight rows ahead the row-streaming kernels prefetch (see
/// [`prefetch_row`](crate::matmul::tile::prefetch_row)).
const AHEAD: usize = 2;

/// Calls `$columns::<[$gen,] R[, C]>($args.., row0, n, k, cols)` over the rows in groups, so
/// that each group's accumulators stay in registers: the arms list each group size `R` (with
/// the column count `C` its registers leave room for), the last one the largest, which every
/// longer remainder takes; with `min M`, it stops where fewer than `M` rows are left. Returns
/// the first row it left.
macro_rules! row_groups {
    ($rows:expr, $n:expr, $k:expr, $cols:expr, $columns:ident $gens:tt $args:tt
     [$($r:literal $(: $c:literal)?),* ; $max:literal $(: $cmax:literal)?]) => {
        row_groups!($rows, $n, $k, $cols, $columns $gens $args
            [$($r $(: $c)?),* ; $max $(: $cmax)?], min 1)
    };
    ($rows:expr, $n:expr, $k:expr, $cols:expr, $columns:ident $gens:tt $args:tt
     [$($r:literal $(: $c:literal)?),* ; $max:literal $(: $cmax:literal)?], min $min:literal) => {{
        let rows: usize = $rows;
        let mut r = 0;
        while rows - r >= $min {
            let left = rows - r;
            // SAFETY: the enclosing function's features; rows r..r + R exist.
            unsafe {
                match left {
                    $($r => row_groups!(@call $columns $gens $args ($r $(, $c)?) r, $n, $k, $cols),)*
                    _ => row_groups!(@call $columns $gens $args ($max $(, $cmax)?) r, $n, $k, $cols),
                }
            }
            r += left.min($max);
        }
        r
    }};
    (@call $columns:ident [$($gen:ty,)*] ($($arg:expr),*) ($($consts:tt)*) $row:ident, $n:expr, $k:expr, $cols:expr) => {
        $columns::<$($gen,)* $($consts)*>($($arg),*, $row, $n, $k, $cols.clone())
    };
}

/// Per row of `x` and per 32-value block, the sum of the block's values.
fn block_sums(x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    x[..rows * k]
        .chunks_exact(QK)
        .map(|c| c.iter().sum())
        .collect()
}

/// f16 bits to f32 with F16C.
///
/// # Safety
/// F16C must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn half_to_f32(bits: u16) -> f32 {
    // SAFETY: the caller has F16C (SSE2 is baseline).
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
}

/// Group `g` (0..8) of a Q6_K super-block, `q − 32` as 32 signed bytes: the low four bits
/// from `ql[64h + 32·(t % 2)..]` (low nibbles for `t < 2`, high ones after) and the top two
/// from bits `2t..2t + 2` of `qh[32h..]`, where `h = g / 4`, `t = g % 4` (as
/// `Block::dequantize`). Assembled as bytes with 16-bit shifts; the masks drop what crosses
/// from the neighbouring byte.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6_bytes(blk: &BlockQ6K, g: usize) -> __m256i {
    let (h, t) = (g / 4, g % 4);
    // SAFETY: 32 bytes of ql and of qh at these offsets, read unaligned; the caller's AVX2.
    unsafe {
        let l = _mm256_loadu_si256(blk.ql.as_ptr().add(64 * h + 32 * (t % 2)).cast());
        let l = if t < 2 { l } else { _mm256_srli_epi16(l, 4) };
        let hv = _mm256_loadu_si256(blk.qh.as_ptr().add(32 * h).cast());
        // Bits 2t..2t + 2 of qh moved to bits 4..6.
        let hv = match t {
            0 => _mm256_slli_epi16(hv, 4),
            1 => _mm256_slli_epi16(hv, 2),
            2 => hv,
            _ => _mm256_srli_epi16(hv, 2),
        };
        let q = _mm256_or_si256(
            _mm256_and_si256(l, _mm256_set1_epi8(0x0F)),
            _mm256_and_si256(hv, _mm256_set1_epi8(0x30)),
        );
        _mm256_sub_epi8(q, _mm256_set1_epi8(32))
    }
}

/// A K super-block's eight 6-bit scales, then its eight mins, as sixteen bytes (the bit layout
/// of `scale_min_k4`, four at a time).
#[inline(always)]
fn k_scale_bytes(q: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([q[i], q[i + 1], q[i + 2], q[i + 3]]);
    let (u0, u1, u2) = (word(0), word(4), word(8));
    [
        u0 & LOW6,
        (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4),
        u1 & LOW6,
        ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4),
    ]
}

/// Group `g` (0..8) of a K super-block's nibbles as 32 bytes (`2c`: the low nibbles of
/// `qs[32c..32c + 32]`, `2c + 1`: their high nibbles), with the fifth bit `g` of each `qh`
/// byte (Q5_K) where given.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn k_bytes(qs: &[u8; 128], qh: Option<&[u8; 32]>, g: usize) -> __m256i {
    // SAFETY: 32 bytes of qs at 32·(g / 2) and of qh, read unaligned; the caller's AVX2.
    unsafe {
        let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * (g / 2)).cast());
        let raw = if g.is_multiple_of(2) {
            raw
        } else {
            _mm256_srli_epi16(raw, 4)
        };
        let q = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
        match qh {
            None => q,
            Some(qh) => {
                let bit = _mm256_set1_epi8((1u8 << g) as i8);
                let h = _mm256_loadu_si256(qh.as_ptr().cast());
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
                _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
            }
        }
    }
}

/// Register tiles on blocks for steps of 1 to 21 rows (AVX-512): each 32 values of a block are
/// dequantized once (`d·q + m`, the values of `Block::dequantize`) into two f32 vectors held
/// in registers for every row of the tile, its scales converted once per block (the 4-bit
/// formats look their values up with `vpermps` in a table of the sixteen `d·q + m`, built once
/// per 32-value group: no conversion per value, the same bits); up to eight
/// rows by three weight rows (or one row by four) of sixteen-lane accumulators, summed once at
/// the end, sixteen at a time. Activations stay f32. (Eight rows by three: on the Intel guest,
/// whose two FMA ports also run the dequantization, the weights bench's 1536 × 576 Q8_0 at 8
/// rows took 64.5-68.1 µs against 71.3-74.3 by two, Q6_K at k 1536 193-199 against 210-215.)
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// A block's values as f32, 32 at a time: one group for the 32-value blocks, eight for
    /// the 256-value super-blocks of the K formats (whose scales are unpacked once per block
    /// and shared by its groups).
    pub(super) trait Dequant: Block {
        /// The block's scales as its groups use them.
        type Scales: Copy;
        /// 32-value groups per block.
        const GROUPS: usize;
        /// # Safety
        /// AVX-512F/BW and F16C must be available.
        unsafe fn scales(&self) -> Self::Scales;
        /// Values `32·g..32·g + 16` and `32·g + 16..32·g + 32`.
        ///
        /// # Safety
        /// AVX-512F/BW and F16C must be available; `g < GROUPS`.
        unsafe fn values(&self, scales: &Self::Scales, g: usize) -> (__m512, __m512);
        /// Whether the block's scales come from its first four bytes alone, read as an f16
        /// pair `d`, `m` (Q4_1 and Q5_1): [`tile`] then converts the heads of a run of blocks
        /// together (see [`Heads`]) and passes each block's to [`Dequant::head_values`].
        const HEAD: bool = false;
        /// The block's values (as [`Dequant::values`]) from its head's `d` and `m`, each
        /// broadcast; called only where [`Dequant::HEAD`].
        ///
        /// # Safety
        /// AVX-512F/BW must be available.
        #[inline(always)]
        unsafe fn head_values(&self, _d: __m512, _m: __m512) -> (__m512, __m512) {
            unreachable!("only the formats whose scales are their head")
        }
    }

    /// The f16 pair `a`, `b` as two broadcast f32 vectors, converted together.
    #[inline(always)]
    unsafe fn pair(a: [u8; 2], b: [u8; 2]) -> (__m512, __m512) {
        // SAFETY: the caller has AVX-512F and F16C.
        unsafe {
            let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
                a[0], a[1], b[0], b[1],
            ])));
            (
                _mm512_broadcastss_ps(v),
                _mm512_broadcastss_ps(_mm_movehdup_ps(v)),
            )
        }
    }

    /// [`pair`] of a block's first four bytes (its f16 `d` and `m`), read as one value (as the
    /// AVX2 kernels' `head`): passed field by field, the four bytes were assembled with scalar
    /// loads, shifts and ors in every block (weights bench, 1536 × 576 Q4_1, one thread: 69.4
    /// µs at one row against 61.4 read at once; two threads from memory 38.1 against 34.1).
    ///
    /// # Safety
    /// AVX-512F and F16C must be available; `B` is at least four bytes.
    #[inline(always)]
    unsafe fn pair_at<B: Block>(block: &B) -> (__m512, __m512) {
        // SAFETY: as the function's contract; read unaligned.
        unsafe {
            let bits = std::ptr::read_unaligned((block as *const B).cast::<i32>());
            let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            (
                _mm512_broadcastss_ps(v),
                _mm512_broadcastss_ps(_mm_movehdup_ps(v)),
            )
        }
    }

    /// `d·q + m` for `q` = 0..16: a 4-bit index's values, looked up with `vpermps` instead of
    /// converted and scaled per value (the same `fma(q, d, m)`, so the same bits). (The 5-bit
    /// formats keep converting: a second table's masked lookups measured slower than the
    /// conversion.)
    #[inline(always)]
    unsafe fn table(d: __m512, m: __m512) -> __m512 {
        // SAFETY: the caller has AVX-512F.
        unsafe {
            let q = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            _mm512_fmadd_ps(q, d, m)
        }
    }

    /// 16 bytes widened to 32-bit lanes: as indices, `vpermps` reads their low nibbles (bits
    /// 0..4), and after a shift right by 4 their high ones.
    #[inline(always)]
    unsafe fn widen(qs: &[u8; 16]) -> __m512i {
        // SAFETY: 16 bytes, read unaligned; the caller has AVX-512F.
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.as_ptr().cast())) }
    }

    /// The low and high nibbles of 16 bytes (elements 0..16 and 16..32) looked up in `t`.
    #[inline(always)]
    unsafe fn nibbles(qs: &[u8; 16], t: __m512) -> (__m512, __m512) {
        // SAFETY: the caller has AVX-512F.
        unsafe {
            let w = widen(qs);
            (
                _mm512_permutexvar_ps(w, t),
                _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), t),
            )
        }
    }

    impl Dequant for BlockQ4_1 {
        /// `d·q + m` for the sixteen `q`.
        type Scales = __m512;
        const GROUPS: usize = 1;
        #[inline(always)]
        unsafe fn scales(&self) -> __m512 {
            // SAFETY: the caller's features.
            unsafe {
                let (d, m) = pair_at(self);
                table(d, m)
            }
        }
        #[inline(always)]
        unsafe fn values(&self, t: &__m512, _: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe { nibbles(&self.qs, *t) }
        }
        const HEAD: bool = true;
        #[inline(always)]
        unsafe fn head_values(&self, d: __m512, m: __m512) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe { nibbles(&self.qs, table(d, m)) }
        }
    }

    impl Dequant for BlockQ4_0 {
        /// `d·q − 8·d` for the sixteen `q`.
        type Scales = __m512;
        const GROUPS: usize = 1;
        #[inline(always)]
        unsafe fn scales(&self) -> __m512 {
            // SAFETY: the caller's features.
            unsafe {
                let (d, _) = pair(self.d, [0, 0]);
                table(d, _mm512_mul_ps(d, _mm512_set1_ps(-8.0)))
            }
        }
        #[inline(always)]
        unsafe fn values(&self, t: &__m512, _: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe { nibbles(&self.qs, *t) }
        }
    }

    impl Dequant for BlockQ8_0 {
        type Scales = ();
        const GROUPS: usize = 1;
        #[inline(always)]
        unsafe fn scales(&self) {}
        #[inline(always)]
        unsafe fn values(&self, _: &(), _: usize) -> (__m512, __m512) {
            let p = self.qs.as_ptr().cast::<__m128i>();
            // SAFETY: 32 bytes of qs, read unaligned; the caller's features.
            unsafe {
                let (d, _) = pair(self.d, [0, 0]);
                (
                    _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))),
                        d,
                    ),
                    _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(1)))),
                        d,
                    ),
                )
            }
        }
    }

    /// Nibbles of 16 bytes with a fifth bit from `qh` (bit `j` for element `j`), as integers:
    /// elements 0..16 (low nibbles) and 16..32 (high nibbles).
    #[inline(always)]
    unsafe fn nibbles5(qs: &[u8; 16], qh: [u8; 4]) -> (__m512i, __m512i) {
        // SAFETY: 16 bytes, read unaligned; the caller has AVX-512F.
        unsafe {
            let qh = u32::from_le_bytes(qh);
            let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.as_ptr().cast()));
            let lo = _mm512_and_si512(w, _mm512_set1_epi32(0x0F));
            let hi = _mm512_srli_epi32(w, 4);
            let five = _mm512_set1_epi32(0x10);
            (
                _mm512_mask_or_epi32(lo, qh as __mmask16, lo, five),
                _mm512_mask_or_epi32(hi, (qh >> 16) as __mmask16, hi, five),
            )
        }
    }

    impl Dequant for BlockQ5_0 {
        type Scales = ();
        const GROUPS: usize = 1;
        #[inline(always)]
        unsafe fn scales(&self) {}
        #[inline(always)]
        unsafe fn values(&self, _: &(), _: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let (d, _) = pair(self.d, [0, 0]);
                // d·q − 16·d: the reference's d·(q − 16), rounded once either way.
                let m = _mm512_mul_ps(d, _mm512_set1_ps(-16.0));
                let (lo, hi) = nibbles5(&self.qs, self.qh);
                (
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m),
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m),
                )
            }
        }
    }

    impl Dequant for BlockQ5_1 {
        type Scales = ();
        const GROUPS: usize = 1;
        #[inline(always)]
        unsafe fn scales(&self) {}
        #[inline(always)]
        unsafe fn values(&self, _: &(), _: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let (d, m) = pair_at(self);
                self.head_values(d, m)
            }
        }
        const HEAD: bool = true;
        #[inline(always)]
        unsafe fn head_values(&self, d: __m512, m: __m512) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let (lo, hi) = nibbles5(&self.qs, self.qh);
                (
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m),
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m),
                )
            }
        }
    }

    /// `d·sc_g` for the eight groups of a K super-block, then `−dmin·m_g`, from its twelve
    /// bytes of packed 6-bit scales and mins (the bit layout of `scale_min_k4`, four at a time).
    #[inline(always)]
    unsafe fn k_scales(d: [u8; 2], dmin: [u8; 2], q: &[u8; 12]) -> [f32; 16] {
        let bytes = k_scale_bytes(q);
        let mut out = [0.0f32; 16];
        // SAFETY: sixteen bytes read, sixteen floats written; the caller has AVX-512F and F16C.
        unsafe {
            let v =
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr().cast())));
            let (d, dmin) = pair(d, dmin);
            let by = _mm512_mask_blend_ps(0xFF00, d, _mm512_sub_ps(_mm512_setzero_ps(), dmin));
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(v, by));
        }
        out
    }

    /// Group `g` of a K super-block's nibbles (`2c`: the low nibbles of `qs[32c..32c + 32]`,
    /// `2c + 1`: their high nibbles), values 0..16 and 16..32, as indices of a 16-entry table
    /// (`vpermps` reads bits 0..4 of each lane).
    #[inline(always)]
    unsafe fn k_nibbles(qs: &[u8; 128], g: usize) -> (__m512i, __m512i) {
        // SAFETY: 32 bytes of qs at 32·(g / 2), read unaligned; the caller has AVX-512F.
        unsafe {
            let p = qs.as_ptr().add(32 * (g / 2));
            let a = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16).cast()));
            if g.is_multiple_of(2) {
                (a, b)
            } else {
                (_mm512_srli_epi32(a, 4), _mm512_srli_epi32(b, 4))
            }
        }
    }

    /// As [`BlockQ4K`] with a fifth bit per value: bit `g` of `qh[l]` for element `l` of group
    /// `g`.
    impl Dequant for BlockQ5K {
        type Scales = [f32; 16];
        const GROUPS: usize = 8;
        #[inline(always)]
        unsafe fn scales(&self) -> [f32; 16] {
            // SAFETY: the caller's features.
            unsafe { k_scales(self.d, self.dmin, &self.scales) }
        }
        #[inline(always)]
        unsafe fn values(&self, s: &[f32; 16], g: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let q = k_bytes(&self.qs, Some(&self.qh), g);
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
                let (sc, m) = (_mm512_set1_ps(s[g]), _mm512_set1_ps(s[8 + g]));
                (_mm512_fmadd_ps(lo, sc, m), _mm512_fmadd_ps(hi, sc, m))
            }
        }
    }

    /// Sixteen groups of 16, `d·scales[i]·(q − 32)`, as eight groups of 32: group `g` of half
    /// `h = g / 4` (`t = g % 4`) takes its low four bits from `ql[64h + 32·(t % 2)..]` (low
    /// nibbles for `t < 2`, high ones after) and its top two from bits `2t..2t + 2` of
    /// `qh[32h..]`, scales `2g` and `2g + 1` (as `Block::dequantize`).
    impl Dequant for BlockQ6K {
        /// `d·scales[i]`.
        type Scales = [f32; 16];
        const GROUPS: usize = 8;
        #[inline(always)]
        unsafe fn scales(&self) -> [f32; 16] {
            let mut out = [0.0f32; 16];
            // SAFETY: sixteen scale bytes read, sixteen floats written; the caller's features.
            unsafe {
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    self.scales.as_ptr().cast(),
                )));
                let (d, _) = pair(self.d, [0, 0]);
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(v, d));
            }
            out
        }
        #[inline(always)]
        unsafe fn values(&self, s: &[f32; 16], g: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let q = q6_bytes(self, g);
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
                // s·(q − 32), rounded once as the reference's.
                (
                    _mm512_mul_ps(lo, _mm512_set1_ps(s[2 * g])),
                    _mm512_mul_ps(hi, _mm512_set1_ps(s[2 * g + 1])),
                )
            }
        }
    }

    /// Eight 32-value groups, `d·sc_g·q − dmin·m_g`; group `2c` is the low nibbles of
    /// `qs[32c..32c + 32]`, group `2c + 1` their high nibbles (as `Block::dequantize`).
    impl Dequant for BlockQ4K {
        /// `d·sc_g` for the eight groups, then `−dmin·m_g`.
        type Scales = [f32; 16];
        const GROUPS: usize = 8;
        #[inline(always)]
        unsafe fn scales(&self) -> [f32; 16] {
            // SAFETY: the caller's features.
            unsafe { k_scales(self.d, self.dmin, &self.scales) }
        }
        #[inline(always)]
        unsafe fn values(&self, s: &[f32; 16], g: usize) -> (__m512, __m512) {
            // SAFETY: the caller's features.
            unsafe {
                let (a, b) = k_nibbles(&self.qs, g);
                let t = table(_mm512_set1_ps(s[g]), _mm512_set1_ps(s[8 + g]));
                (_mm512_permutexvar_ps(a, t), _mm512_permutexvar_ps(b, t))
            }
        }
    }

    /// Blocks whose heads [`Heads`] converts at once.
    const HEAD_RUN: usize = 16;
    /// The most rows whose tiles convert their heads by runs ([`Heads`]); larger ones
    /// convert each block's own.
    const HEAD_ROWS: usize = 4;

    /// The heads (f16 `d`, `m`: [`Dequant::HEAD`]) of a run of up to [`HEAD_RUN`] blocks of
    /// `C` weight rows, gathered and converted to f32 together. One block's pair converted
    /// alone and broadcast took six shuffle-port instructions per block (the conversion, two
    /// broadcasts and a lane move), as many as its values' lookups: the pairs are written to
    /// memory here and read back as broadcasts, which the load ports do. Weights bench
    /// (1536 × 576, two threads, Intel guest, interleaved): Q4_1 at one row 34.8-37.7 µs →
    /// 29.6-32.7, at four 49.4-51.4 → 46.3-47.9; Q5_1 at one row 45.3-48.2 → 40.5-43.0. At
    /// eight rows no faster (those tiles are not bound by the shuffle port), nor Q4_0, Q5_0
    /// and Q8_0, whose head is a lone `d` (three instructions): they convert each block's.
    struct Heads<const C: usize> {
        /// Each block's `d` then `m`, sixteen values (eight blocks) a vector.
        f32s: [[__m512; HEAD_RUN / 8]; C],
    }

    impl<const C: usize> Heads<C> {
        #[inline(always)]
        unsafe fn new() -> Self {
            // SAFETY: AVX-512F, the caller's.
            Heads {
                f32s: [[unsafe { _mm512_setzero_ps() }; HEAD_RUN / 8]; C],
            }
        }

        /// Converts the heads of blocks `b0..b0 + len` of the `C` weight rows at `w` (rows
        /// `nb` blocks apart). (Stored one at a time and read back as a vector, the heads
        /// waited for the stores to reach the cache, a stall per run: they are gathered.)
        ///
        /// # Safety
        /// AVX-512F and F16C; the blocks exist and are at least four bytes each; `len <=
        /// HEAD_RUN`.
        #[inline(always)]
        unsafe fn convert<B: Block>(&mut self, w: *const B, nb: usize, b0: usize, len: usize) {
            const { assert!(HEAD_RUN == 16) };
            // SAFETY: as the contract: the mask reads only the run's blocks. The stores are
            // volatile so that the compiler keeps them and reads the values back from memory,
            // rather than extracting them from the registers with shuffles.
            unsafe {
                let size = std::mem::size_of::<B>() as i32;
                let at = _mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(size),
                );
                let mask = (((1u32 << len) - 1) & 0xFFFF) as __mmask16;
                for c in 0..C {
                    let base = w.add(c * nb + b0).cast::<u8>();
                    let raw = _mm512_mask_i32gather_epi32::<1>(
                        _mm512_setzero_si512(),
                        mask,
                        at,
                        base.cast(),
                    );
                    let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
                    let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(raw));
                    std::ptr::write_volatile(&mut self.f32s[c][0], lo);
                    std::ptr::write_volatile(&mut self.f32s[c][1], hi);
                }
            }
        }

        /// Block `i` of the run in weight row `c`: its `d` and `m`, broadcast.
        #[inline(always)]
        unsafe fn pair(&self, c: usize, i: usize) -> (__m512, __m512) {
            // SAFETY: the caller has AVX-512F.
            unsafe {
                let p = self.f32s[c].as_ptr().cast::<f32>().add(2 * i);
                (_mm512_set1_ps(*p), _mm512_set1_ps(*p.add(1)))
            }
        }
    }

    /// Block `b` of the tile's `C` weight rows (their scales `scales`) against `R` rows of
    /// `x`, into `acc`.
    #[inline(always)]
    unsafe fn block<B: Dequant, const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        w: *const B,
        nb: usize,
        b: usize,
        scales: &[B::Scales; C],
        acc: &mut [[__m512; C]; R],
    ) {
        // SAFETY: as `tile`'s contract.
        unsafe {
            for g in 0..B::GROUPS {
                let mut wv = [[_mm512_setzero_ps(); 2]; C];
                for c in 0..C {
                    let (lo, hi) = (*w.add(c * nb + b)).values(&scales[c], g);
                    wv[c] = [lo, hi];
                }
                fmas::<R, C>(x, k, b * B::ELEMS + g * QK, &wv, acc);
            }
        }
    }

    /// The values of block `b` of the tile's `C` weight rows, each from its head.
    #[inline(always)]
    unsafe fn head_values<B: Dequant, const C: usize>(
        w: *const B,
        nb: usize,
        b: usize,
        heads: &Heads<C>,
    ) -> [[__m512; 2]; C] {
        // SAFETY: as `tile`'s contract; B::HEAD, so one group.
        unsafe {
            let i = b % HEAD_RUN;
            let mut wv = [[_mm512_setzero_ps(); 2]; C];
            for c in 0..C {
                let (d, m) = heads.pair(c, i);
                let (lo, hi) = (*w.add(c * nb + b)).head_values(d, m);
                wv[c] = [lo, hi];
            }
            wv
        }
    }

    /// Block `b`'s values `wv` of the tile's `C` weight rows against `R` rows of `x`.
    #[inline(always)]
    unsafe fn fmas<const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        at: usize,
        wv: &[[__m512; 2]; C],
        acc: &mut [[__m512; C]; R],
    ) {
        // SAFETY: as `tile`'s contract: 32 values at `at` of each row.
        unsafe {
            for r in 0..R {
                let px = x.add(r * k + at);
                let (x0, x1) = (_mm512_loadu_ps(px), _mm512_loadu_ps(px.add(16)));
                for c in 0..C {
                    acc[r][c] = _mm512_fmadd_ps(x0, wv[c][0], acc[r][c]);
                    acc[r][c] = _mm512_fmadd_ps(x1, wv[c][1], acc[r][c]);
                }
            }
        }
    }

    /// `out[r·n + c] = Σ_i x[r·k + i] · w_c[i]` for `r < R`, `c < C`: `w` points at the first
    /// block of weight row 0 of the tile (rows `nb` blocks apart); `next` is the next tile's
    /// first byte and length, prefetched a little per block.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<B: Dequant, const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        w: *const B,
        nb: usize,
        out: *mut f32,
        n: usize,
        next: (*const u8, usize),
    ) {
        // SAFETY: the caller has AVX-512F/BW and F16C, R rows of k values at x, C weight rows
        // of nb blocks at w, and room for R rows of n outputs (C of them each) at out;
        // prefetches never fault.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let lines = next.1.div_ceil(64).div_ceil(nb.max(1));
            let mut line = 0;
            if B::HEAD && R <= HEAD_ROWS {
                // One loop over the blocks, converting a run's heads as it starts (as two
                // nested loops, the compiler kept the accumulators in memory).
                let mut heads = Heads::<C>::new();
                for b in 0..nb {
                    if b % HEAD_RUN == 0 {
                        heads.convert(w, nb, b, HEAD_RUN.min(nb - b));
                    }
                    for _ in 0..lines {
                        crate::matmul::tile::prefetch_ahead(next, line);
                        line += 1;
                    }
                    let wv = head_values::<B, C>(w, nb, b, &heads);
                    fmas::<R, C>(x, k, b * QK, &wv, &mut acc);
                }
            } else {
                for b in 0..nb {
                    for _ in 0..lines {
                        crate::matmul::tile::prefetch_ahead(next, line);
                        line += 1;
                    }
                    let mut scales = [(*w.add(b)).scales(); C];
                    for c in 1..C {
                        scales[c] = (*w.add(c * nb + b)).scales();
                    }
                    block::<B, R, C>(x, k, w, nb, b, &scales, &mut acc);
                }
            }
            if R * C < 8 {
                for r in 0..R {
                    for c in 0..C {
                        *out.add(r * n + c) = _mm512_reduce_add_ps(acc[r][c]);
                    }
                }
                return;
            }
            // Sixteen accumulators at a time summed together (45 shuffles and adds, where
            // one at a time takes 8 each).
            crate::matmul::tile::each_sum(acc.as_flattened(), |j, s| {
                *out.add(j / C * n + j % C) = s
            });
        }
    }

    /// Columns `cols` of rows `row0..row0 + R` in tiles of `C` weight rows (the last ones
    /// one at a time).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn columns<B: Dequant, const R: usize, const C: usize>(
        x: &[f32],
        w: &[B],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let nb = k / B::ELEMS;
        let bytes = nb * std::mem::size_of::<B>();
        let xr = x[row0 * k..].as_ptr();
        let o = out[row0 * n..].as_mut_ptr();
        let mut j = cols.start;
        // SAFETY: as `tile`'s contract: rows row0..row0 + R of x and out exist (the caller's
        // row groups), weight rows j..j + C lie in `cols` and in `w`.
        unsafe {
            while j + C <= cols.end {
                let ahead = C.min(cols.end - j - C);
                let next = (w.as_ptr().add((j + C) * nb).cast::<u8>(), ahead * bytes);
                tile::<B, R, C>(
                    xr,
                    k,
                    w.as_ptr().add(j * nb),
                    nb,
                    o.add(j - cols.start),
                    n,
                    next,
                );
                j += C;
            }
            while j < cols.end {
                let next = (std::ptr::null(), 0);
                tile::<B, R, 1>(
                    xr,
                    k,
                    w.as_ptr().add(j * nb),
                    nb,
                    o.add(j - cols.start),
                    n,
                    next,
                );
                j += 1;
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F/BW/VL and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    pub(super) unsafe fn tiles<B: Dequant>(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let Some(w) = as_blocks::<B>(w) else { return };
        row_groups!(rows, n, k, cols, columns [B,] (x, w, out) [1: 4, 2: 4, 3: 4, 4: 4, 5: 3, 6: 3, 7: 2; 8: 3]);
    }

    /// Weight rows `j0..j0 + panel.len() / k` as f32 into `panel`: the values of
    /// [`Dequant::values`], a block at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW/VL and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    pub(super) unsafe fn dequant<B: Dequant>(w: &[u8], k: usize, j0: usize, panel: &mut [f32]) {
        let Some(w) = as_blocks::<B>(w) else { return };
        let nb = k / B::ELEMS;
        for (i, prow) in panel.chunks_exact_mut(k).enumerate() {
            for (b, blk) in w[(j0 + i) * nb..(j0 + i + 1) * nb].iter().enumerate() {
                // SAFETY: the features above; the block's values lie in the row at b·ELEMS.
                unsafe {
                    let scales = blk.scales();
                    for g in 0..B::GROUPS {
                        let (lo, hi) = blk.values(&scales, g);
                        let o = prow.as_mut_ptr().add(b * B::ELEMS + g * QK);
                        _mm512_storeu_ps(o, lo);
                        _mm512_storeu_ps(o.add(16), hi);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod bf16_avx512 {
    use super::*;

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn columns<const R: usize>(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        for j in cols.clone() {
            let wrow = &w[j * k * 2..(j + 1) * k * 2];
            let mut acc = [_mm512_setzero_ps(); R];
            // SAFETY: the caller has AVX-512F/BW; 16 values (32 bytes) per step lie in the row
            // and in every x row (k is a multiple of 16 here).
            unsafe {
                for c in 0..k / 16 {
                    let raw = _mm256_loadu_si256(wrow.as_ptr().add(c * 32).cast());
                    let wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                    for r in 0..R {
                        let xv = _mm512_loadu_ps(x.as_ptr().add((row0 + r) * k + c * 16));
                        acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
                    }
                }
                for r in 0..R {
                    out[(row0 + r) * n + j - cols.start] = _mm512_reduce_add_ps(acc[r]);
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F/BW/VL; `k` is a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn stream(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        row_groups!(rows, n, k, cols, columns [] (x, w, out) [1, 2, 3; 4]);
    }
}

#[cfg(target_arch = "x86_64")]
mod q4k_avx512 {
    use super::*;
    use maxc_schema::blocks::QK_K;

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn columns<const R: usize>(
        x: &[f32],
        xs: &[f32],
        w: &[BlockQ4K],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let (nb, ng) = (k / QK_K, k / QK);
        for j in cols.clone() {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut offs = [0.0f32; R];
            for (b, blk) in w[j * nb..(j + 1) * nb].iter().enumerate() {
                // SAFETY: the caller has AVX-512F/BW and F16C; the block's 128 bytes of nibbles
                // and every x row's 256 values of this super-block are in bounds.
                unsafe {
                    let d = half_to_f32(u16::from_le_bytes(blk.d));
                    let dmin = half_to_f32(u16::from_le_bytes(blk.dmin));
                    let mask = _mm256_set1_epi8(0x0F);
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(blk.qs.as_ptr().add(c * 32).cast());
                        let lo = _mm256_and_si256(q, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                        let v = [
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(
                                lo, 1,
                            ))),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(
                                hi, 1,
                            ))),
                        ];
                        let (sc1, m1) = blk.scale_min(2 * c);
                        let (sc2, m2) = blk.scale_min(2 * c + 1);
                        let d1 = _mm512_set1_ps(d * sc1 as f32);
                        let d2 = _mm512_set1_ps(d * sc2 as f32);
                        let (m1, m2) = (dmin * m1 as f32, dmin * m2 as f32);
                        for r in 0..R {
                            let px = x.as_ptr().add((row0 + r) * k + b * QK_K + c * 64);
                            let p1 = _mm512_fmadd_ps(
                                v[1],
                                _mm512_loadu_ps(px.add(16)),
                                _mm512_mul_ps(v[0], _mm512_loadu_ps(px)),
                            );
                            let p2 = _mm512_fmadd_ps(
                                v[3],
                                _mm512_loadu_ps(px.add(48)),
                                _mm512_mul_ps(v[2], _mm512_loadu_ps(px.add(32))),
                            );
                            acc[r] = _mm512_fmadd_ps(d1, p1, acc[r]);
                            acc[r] = _mm512_fmadd_ps(d2, p2, acc[r]);
                            let g = (row0 + r) * ng + b * 8 + 2 * c;
                            offs[r] -= m1 * xs[g] + m2 * xs[g + 1];
                        }
                    }
                }
            }
            for r in 0..R {
                // SAFETY: AVX-512F.
                out[(row0 + r) * n + j - cols.start] =
                    unsafe { _mm512_reduce_add_ps(acc[r]) } + offs[r];
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F/BW/VL and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    pub(super) unsafe fn stream(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let Some(w) = as_blocks::<BlockQ4K>(w) else {
            return;
        };
        let xs = block_sums(x, rows, k);
        row_groups!(rows, n, k, cols, columns [] (x, &xs, w, out) [1, 2, 3; 4]);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::hsum;

#[cfg(target_arch = "x86_64")]
pub(crate) mod int16;
#[cfg(target_arch = "x86_64")]
pub(crate) mod int8;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    /// A block's values in 32-value groups, `scale_g · q + offset_g` with `q` integers the
    /// block stores (Q6_K, whose groups of 16 have their own scales, gives its values scaled,
    /// with scale 1).
    pub(super) trait Unpack: Block {
        /// 32-value groups per block.
        const GROUPS: usize;
        /// The block's scales, unpacked once for its groups.
        type Scales: Copy;
        /// # Safety
        /// F16C must be available.
        unsafe fn scales(&self) -> Self::Scales;
        /// Group `g`'s scale and offset.
        fn group(s: &Self::Scales, g: usize) -> (f32, f32);
        /// Group `g`'s `q` widened to f32, in four vectors of eight.
        ///
        /// # Safety
        /// AVX2 must be available; `g < GROUPS`.
        unsafe fn unpack(&self, scales: &Self::Scales, g: usize) -> [__m256; 4];
    }

    /// The two f16 values at the start of a block (a scale, and an offset or the first bytes
    /// of the values), read as one 32-bit word and converted together.
    ///
    /// # Safety
    /// F16C must be available; `B` is at least four bytes.
    #[inline(always)]
    unsafe fn head<B: Block>(blk: &B) -> (f32, f32) {
        // SAFETY: as the function's contract; read unaligned.
        unsafe {
            let w = std::ptr::read_unaligned((blk as *const B).cast::<i32>());
            let v = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
            (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
        }
    }

    /// A K super-block's eight groups: `d·sc_g` and `−dmin·m_g` (`blk` starts with `d` and
    /// `dmin`, `q` is its packed scales and mins).
    ///
    /// # Safety
    /// F16C must be available.
    #[inline(always)]
    unsafe fn k_groups<B: Block>(blk: &B, q: &[u8; 12]) -> ([f32; 8], [f32; 8]) {
        let bytes = k_scale_bytes(q);
        let mut s = ([0.0; 8], [0.0; 8]);
        // SAFETY: the caller has F16C (and AVX2); K blocks start with `d` and `dmin`; sixteen
        // bytes read, eight floats written to each half.
        unsafe {
            let (d, dmin) = head(blk);
            let b = _mm_loadu_si128(bytes.as_ptr().cast());
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
            let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
            _mm256_storeu_ps(s.0.as_mut_ptr(), _mm256_mul_ps(sc, _mm256_set1_ps(d)));
            _mm256_storeu_ps(s.1.as_mut_ptr(), _mm256_mul_ps(m, _mm256_set1_ps(-dmin)));
        }
        s
    }

    /// The scales of the 32-value formats.
    macro_rules! block32_scales {
        ($this:ident => $scales:expr) => {
            const GROUPS: usize = 1;
            type Scales = (f32, f32);
            #[inline(always)]
            unsafe fn scales(&self) -> (f32, f32) {
                let $this = self;
                // SAFETY: the caller has F16C.
                unsafe { $scales }
            }
            #[inline(always)]
            fn group(s: &(f32, f32), _: usize) -> (f32, f32) {
                *s
            }
        };
    }

    /// The scales of the K super-blocks with a 6-bit scale and min per group.
    macro_rules! k_scales {
        () => {
            const GROUPS: usize = 8;
            type Scales = ([f32; 8], [f32; 8]);
            #[inline(always)]
            unsafe fn scales(&self) -> ([f32; 8], [f32; 8]) {
                // SAFETY: the caller has F16C.
                unsafe { k_groups(self, &self.scales) }
            }
            #[inline(always)]
            fn group(s: &([f32; 8], [f32; 8]), g: usize) -> (f32, f32) {
                (s.0[g], s.1[g])
            }
        };
    }

    #[inline(always)]
    unsafe fn widen(q: __m128i) -> [__m256; 2] {
        // SAFETY: the caller has AVX2.
        unsafe {
            [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
            ]
        }
    }

    /// 32 signed bytes (two 16-byte halves) widened to f32.
    #[inline(always)]
    unsafe fn widen32(a: __m128i, b: __m128i) -> [__m256; 4] {
        // SAFETY: the caller has AVX2.
        unsafe {
            let [p, q] = widen(a);
            let [r, t] = widen(b);
            [p, q, r, t]
        }
    }

    /// Eight signed bytes at `p` as f32 (sign-extended as they are read).
    ///
    /// # Safety
    /// AVX2; eight bytes readable at `p`.
    #[inline(always)]
    unsafe fn bytes8(p: *const u8) -> __m256 {
        // SAFETY: as the function's contract.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }

    impl Unpack for BlockQ8_0 {
        block32_scales!(b => (head(b).0, 0.0));
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, _: usize) -> [__m256; 4] {
            let p = self.qs.as_ptr().cast::<u8>();
            // SAFETY: 32 bytes of qs, read unaligned eight at a time (each load sign-extended
            // as it is read).
            unsafe {
                [
                    bytes8(p),
                    bytes8(p.add(8)),
                    bytes8(p.add(16)),
                    bytes8(p.add(24)),
                ]
            }
        }
    }

    /// Low and high nibbles of 16 bytes, each with a fifth bit from `qh` (bit `j` for element
    /// `j`), as bytes 0..32 (Q5_0's `− 16` is its offset).
    #[inline(always)]
    pub(super) unsafe fn nibbles5(qs: &[u8; 16], qh: [u8; 4]) -> (__m128i, __m128i) {
        // SAFETY: 16 bytes, read unaligned; the caller has AVX2.
        unsafe {
            let q = _mm_loadu_si128(qs.as_ptr().cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            // Bit j of qh to byte j: each byte selects its bit, compared with it.
            let bits = _mm256_set1_epi32(u32::from_le_bytes(qh) as i32);
            let pick = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let spread = _mm256_shuffle_epi8(
                bits,
                _mm256_set_epi64x(
                    0x0303_0303_0303_0303,
                    0x0202_0202_0202_0202,
                    0x0101_0101_0101_0101,
                    0,
                ),
            );
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, pick), pick);
            let five = _mm256_and_si256(set, _mm256_set1_epi8(0x10));
            (
                _mm_or_si128(lo, _mm256_castsi256_si128(five)),
                _mm_or_si128(hi, _mm256_extracti128_si256(five, 1)),
            )
        }
    }

    /// The 32 nibbles of 16 bytes as f32 (low nibbles are elements 0..16, high 16..32): each
    /// eight bytes zero-extended to 32 bits as they are read, masked or shifted, converted.
    #[inline(always)]
    unsafe fn nibbles4(qs: &[u8; 16]) -> [__m256; 4] {
        // SAFETY: 16 bytes, read unaligned eight at a time; the caller has AVX2.
        unsafe {
            let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.as_ptr().cast()));
            let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.as_ptr().add(8).cast()));
            let m = _mm256_set1_epi32(0x0F);
            [
                _mm256_cvtepi32_ps(_mm256_and_si256(a, m)),
                _mm256_cvtepi32_ps(_mm256_and_si256(b, m)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)),
            ]
        }
    }

    /// `d·(q − 8)` as scale `d`, offset `−8·d`.
    impl Unpack for BlockQ4_0 {
        block32_scales!(b => {
            let d = head(b).0;
            (d, -8.0 * d)
        });
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, _: usize) -> [__m256; 4] {
            // SAFETY: as `nibbles4`.
            unsafe { nibbles4(&self.qs) }
        }
    }

    impl Unpack for BlockQ4_1 {
        block32_scales!(b => head(b));
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, _: usize) -> [__m256; 4] {
            // SAFETY: as `nibbles4`.
            unsafe { nibbles4(&self.qs) }
        }
    }

    /// `d·(q − 16)` as scale `d`, offset `−16·d`.
    impl Unpack for BlockQ5_0 {
        block32_scales!(b => {
            let d = head(b).0;
            (d, -16.0 * d)
        });
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, _: usize) -> [__m256; 4] {
            // SAFETY: as `nibbles`.
            unsafe {
                let (lo, hi) = nibbles5(&self.qs, self.qh);
                widen32(lo, hi)
            }
        }
    }

    impl Unpack for BlockQ5_1 {
        block32_scales!(b => head(b));
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, _: usize) -> [__m256; 4] {
            // SAFETY: as `nibbles`.
            unsafe {
                let (lo, hi) = nibbles5(&self.qs, self.qh);
                widen32(lo, hi)
            }
        }
    }

    /// [`k_bytes`] widened to f32.
    #[inline(always)]
    unsafe fn k_nibbles(qs: &[u8; 128], qh: Option<&[u8; 32]>, g: usize) -> [__m256; 4] {
        // SAFETY: the caller has AVX2.
        unsafe {
            let q = k_bytes(qs, qh, g);
            widen32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1))
        }
    }

    impl Unpack for BlockQ4K {
        k_scales!();
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, g: usize) -> [__m256; 4] {
            // SAFETY: 32 bytes of qs at 32·(g / 2), read unaligned eight at a time (each
            // zero-extended as it is read); the caller has AVX2. Even groups are the low
            // nibbles, odd ones the high.
            unsafe {
                let p = self.qs.as_ptr().add(32 * (g / 2));
                let mut q = [_mm256_setzero_ps(); 4];
                for (i, q) in q.iter_mut().enumerate() {
                    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8 * i).cast()));
                    let v = if g.is_multiple_of(2) {
                        _mm256_and_si256(v, _mm256_set1_epi32(0x0F))
                    } else {
                        _mm256_srli_epi32(v, 4)
                    };
                    *q = _mm256_cvtepi32_ps(v);
                }
                q
            }
        }
    }

    impl Unpack for BlockQ5K {
        k_scales!();
        #[inline(always)]
        unsafe fn unpack(&self, _: &Self::Scales, g: usize) -> [__m256; 4] {
            // SAFETY: as `k_nibbles`.
            unsafe { k_nibbles(&self.qs, Some(&self.qh), g) }
        }
    }

    /// Values scaled here (each 16 has its own scale, `d·scales[i]`, computed once per
    /// block): group scale 1, offset 0.
    impl Unpack for BlockQ6K {
        const GROUPS: usize = 8;
        type Scales = [f32; 16];
        #[inline(always)]
        unsafe fn scales(&self) -> [f32; 16] {
            let mut out = [0.0f32; 16];
            // SAFETY: the caller has F16C (and AVX2); sixteen bytes read, sixteen floats
            // written.
            unsafe {
                let d = _mm256_set1_ps(half_to_f32(u16::from_le_bytes(self.d)));
                let b = _mm_loadu_si128(self.scales.as_ptr().cast());
                let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(lo, d));
                _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(hi, d));
            }
            out
        }
        #[inline(always)]
        fn group(_: &[f32; 16], _: usize) -> (f32, f32) {
            (1.0, 0.0)
        }
        #[inline(always)]
        unsafe fn unpack(&self, s: &[f32; 16], g: usize) -> [__m256; 4] {
            // SAFETY: the caller has AVX2.
            unsafe {
                let q = q6_bytes(self, g);
                let s0 = _mm256_set1_ps(s[2 * g]);
                let s1 = _mm256_set1_ps(s[2 * g + 1]);
                let [a, b, c, e] =
                    widen32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                [
                    _mm256_mul_ps(a, s0),
                    _mm256_mul_ps(b, s0),
                    _mm256_mul_ps(c, s1),
                    _mm256_mul_ps(e, s1),
                ]
            }
        }
    }

    /// The sum of the lanes.
    ///
    /// # Safety
    /// AVX must be available.
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: the caller has AVX2.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn columns<B: Unpack, const R: usize>(
        x: &[f32],
        xs: &[f32],
        w: &[B],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let nb = k / B::ELEMS;
        let xr = x[row0 * k..].as_ptr();
        let xs = &xs[row0 * (k / QK)..];
        for j in cols.clone() {
            let blocks = &w[j * nb..(j + 1) * nb];
            crate::matmul::tile::prefetch_row(
                blocks.as_ptr().cast(),
                std::mem::size_of_val(blocks),
                AHEAD,
            );
            // Two sets of accumulators, for even and odd groups: each FMA chain waits on
            // every other group only.
            let mut acc = [[_mm256_setzero_ps(); R]; 2];
            let mut offs = [[0.0f32; R]; 2];
            // SAFETY (the `group` calls): the caller has AVX2, FMA and F16C; every x row
            // holds k values, every xs row k / 32.
            if B::GROUPS == 1 {
                let mut b = 0;
                while b + 2 <= nb {
                    for u in 0..2 {
                        let blk = &blocks[b + u];
                        unsafe {
                            group::<B, R>(
                                blk,
                                &blk.scales(),
                                0,
                                b + u,
                                xr,
                                xs,
                                k,
                                &mut acc[u],
                                &mut offs[u],
                            )
                        };
                    }
                    b += 2;
                }
                if b < nb {
                    let blk = &blocks[b];
                    unsafe {
                        group::<B, R>(
                            blk,
                            &blk.scales(),
                            0,
                            b,
                            xr,
                            xs,
                            k,
                            &mut acc[0],
                            &mut offs[0],
                        )
                    };
                }
            } else {
                for (b, blk) in blocks.iter().enumerate() {
                    // SAFETY: the caller has F16C.
                    let scales = unsafe { blk.scales() };
                    // (Constant trip counts, so that both loops unroll and each group's
                    // index, and its parity, is a constant.)
                    for gp in 0..B::GROUPS / 2 {
                        for u in 0..2 {
                            let g = 2 * gp + u;
                            let at = b * B::GROUPS + g;
                            unsafe {
                                group::<B, R>(
                                    blk,
                                    &scales,
                                    g,
                                    at,
                                    xr,
                                    xs,
                                    k,
                                    &mut acc[u],
                                    &mut offs[u],
                                )
                            };
                        }
                    }
                }
            }
            for r in 0..R {
                // SAFETY: AVX2.
                let sum = unsafe { hsum(_mm256_add_ps(acc[0][r], acc[1][r])) };
                out[(row0 + r) * n + j - cols.start] = sum + (offs[0][r] + offs[1][r]);
            }
        }
    }

    /// Group `g` of `blk` (the `at`-th 32 values of its row) into rows `0..R` of `acc` and
    /// `offs`: `acc += scale · Σ x·q`, `offs += offset · Σ x` (`xs`: the rows' group sums,
    /// `k / 32` per row).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; rows `0..R` of `x` (k values each) and `xs` exist.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group<B: Unpack, const R: usize>(
        blk: &B,
        scales: &B::Scales,
        g: usize,
        at: usize,
        x: *const f32,
        xs: &[f32],
        k: usize,
        acc: &mut [__m256; R],
        offs: &mut [f32; R],
    ) {
        let (scale, offset) = B::group(scales, g);
        // SAFETY: as the function's contract.
        unsafe {
            let d = _mm256_set1_ps(scale);
            let q = blk.unpack(scales, g);
            for r in 0..R {
                let px = x.add(r * k + at * QK);
                let mut p = _mm256_mul_ps(q[0], _mm256_loadu_ps(px));
                p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(px.add(8)), p);
                p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(px.add(16)), p);
                p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(px.add(24)), p);
                acc[r] = _mm256_fmadd_ps(d, p, acc[r]);
                offs[r] = offset.mul_add(xs[r * (k / QK) + at], offs[r]);
            }
        }
    }

    /// Rows `row0..row0 + R` (five to eight) of columns `cols`, each weight group
    /// dequantized once (`scale·q + offset`, four FMAs) and multiplied with every row: for
    /// five or more rows, cheaper than factoring the scale out of each row's dot product.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn columns_wide<B: Unpack, const R: usize>(
        x: &[f32],
        w: &[B],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let nb = k / B::ELEMS;
        let xr = x[row0 * k..].as_ptr();
        for j in cols.clone() {
            let blocks = &w[j * nb..(j + 1) * nb];
            let mut acc = [_mm256_setzero_ps(); R];
            for (b, blk) in blocks.iter().enumerate() {
                // SAFETY: the caller has F16C.
                let scales = unsafe { blk.scales() };
                for g in 0..B::GROUPS {
                    let (scale, offset) = B::group(&scales, g);
                    // SAFETY: the caller has AVX2, FMA and F16C; rows row0..row0 + R of x
                    // hold k values each.
                    unsafe {
                        let d = _mm256_set1_ps(scale);
                        let o = _mm256_set1_ps(offset);
                        let q = blk.unpack(&scales, g);
                        let v = [
                            _mm256_fmadd_ps(q[0], d, o),
                            _mm256_fmadd_ps(q[1], d, o),
                            _mm256_fmadd_ps(q[2], d, o),
                            _mm256_fmadd_ps(q[3], d, o),
                        ];
                        let at = b * B::ELEMS + g * QK;
                        for r in 0..R {
                            let px = xr.add(r * k + at);
                            for (i, v) in v.iter().enumerate() {
                                acc[r] =
                                    _mm256_fmadd_ps(*v, _mm256_loadu_ps(px.add(8 * i)), acc[r]);
                            }
                        }
                    }
                }
            }
            for r in 0..R {
                // SAFETY: AVX2.
                out[(row0 + r) * n + j - cols.start] = unsafe { hsum(acc[r]) };
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn stream<B: Unpack>(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let Some(w) = as_blocks::<B>(w) else { return };
        // Groups of five to eight rows share each dequantized group ...
        let r = row_groups!(rows, n, k, cols, columns_wide [B,] (x, w, out) [5, 6, 7; 8], min 5);
        if r == rows {
            return;
        }
        // ... and the last (or only) one to four rows factor each group's scale out.
        let rest = rows - r;
        let xs = block_sums(&x[r * k..], rest, k);
        let o = &mut out[r * n..];
        row_groups!(rest, n, k, cols, columns [B,] (&x[r * k..], &xs, w, o) [1, 2, 3; 4]);
    }

    /// A float format of weight rows, eight values at a time as f32.
    pub(super) trait Floats {
        /// Bytes per value.
        const BYTES: usize;
        /// Values `i..i + 8` of the row at `p`.
        ///
        /// # Safety
        /// AVX2; the values lie in the row.
        unsafe fn load8(p: *const u8, i: usize) -> __m256;
        /// Value `i` of the row at `p`.
        ///
        /// # Safety
        /// The value lies in the row.
        unsafe fn one(p: *const u8, i: usize) -> f32;
    }

    pub(super) struct F32s;
    pub(super) struct Bf16s;

    impl Floats for F32s {
        const BYTES: usize = 4;
        #[inline(always)]
        unsafe fn load8(p: *const u8, i: usize) -> __m256 {
            // SAFETY: as the trait's contract; read unaligned.
            unsafe { _mm256_loadu_ps(p.cast::<f32>().add(i)) }
        }
        #[inline(always)]
        unsafe fn one(p: *const u8, i: usize) -> f32 {
            // SAFETY: as the trait's contract.
            unsafe { std::ptr::read_unaligned(p.cast::<f32>().add(i)) }
        }
    }

    impl Floats for Bf16s {
        const BYTES: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8, i: usize) -> __m256 {
            // SAFETY: as the trait's contract; bf16 widens to f32 by a 16-bit shift.
            unsafe {
                let raw = _mm_loadu_si128(p.cast::<u16>().add(i).cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
            }
        }
        #[inline(always)]
        unsafe fn one(p: *const u8, i: usize) -> f32 {
            // SAFETY: as the trait's contract.
            let b = unsafe { std::ptr::read_unaligned(p.cast::<u16>().add(i)) };
            f32::from_bits((b as u32) << 16)
        }
    }

    /// Rows `row0..row0 + R` of columns `cols` on float weights: each eight weights loaded
    /// once for the R rows, `S` sets of accumulators taking turns (so that at least eight
    /// FMA chains run at once where R is small).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn float_columns<E: Floats, const R: usize, const S: usize>(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        row0: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        let xr = x[row0 * k..].as_ptr();
        let chunks = k / 8;
        for j in cols.clone() {
            let row = w[j * k * E::BYTES..].as_ptr();
            // SAFETY: the caller has AVX2 + FMA; rows row0..row0 + R of x hold k values, the
            // weight row k values.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); R]; S];
                let mut c = 0;
                while c + S <= chunks {
                    for s in 0..S {
                        let i = 8 * (c + s);
                        let v = E::load8(row, i);
                        for r in 0..R {
                            acc[s][r] =
                                _mm256_fmadd_ps(v, _mm256_loadu_ps(xr.add(r * k + i)), acc[s][r]);
                        }
                    }
                    c += S;
                }
                while c < chunks {
                    let v = E::load8(row, 8 * c);
                    for r in 0..R {
                        acc[0][r] =
                            _mm256_fmadd_ps(v, _mm256_loadu_ps(xr.add(r * k + 8 * c)), acc[0][r]);
                    }
                    c += 1;
                }
                for r in 0..R {
                    let mut t = acc[0][r];
                    for s in 1..S {
                        t = _mm256_add_ps(t, acc[s][r]);
                    }
                    let mut sum = hsum(t);
                    for i in 8 * chunks..k {
                        sum = E::one(row, i).mul_add(*xr.add(r * k + i), sum);
                    }
                    out[(row0 + r) * n + j - cols.start] = sum;
                }
            }
        }
    }

    /// Float weights for steps of a few rows, in groups of up to eight rows that read each
    /// weight once.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn floats<E: Floats>(
        x: &[f32],
        w: &[u8],
        out: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        cols: std::ops::Range<usize>,
    ) {
        row_groups!(rows, n, k, cols, float_columns [E,] (x, w, out) [1: 4, 2: 4, 3: 2, 4: 2, 5: 1, 6: 1, 7: 1; 8: 1]);
    }

    /// Weight rows `j0..j0 + panel.len() / k` as f32 into `panel` (`scale·q + offset`).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequant<B: Unpack>(w: &[u8], k: usize, j0: usize, panel: &mut [f32]) {
        let Some(w) = as_blocks::<B>(w) else { return };
        let nb = k / B::ELEMS;
        for (i, prow) in panel.chunks_exact_mut(k).enumerate() {
            for (b, blk) in w[(j0 + i) * nb..(j0 + i + 1) * nb].iter().enumerate() {
                // SAFETY: the caller has F16C.
                let scales = unsafe { blk.scales() };
                for g in 0..B::GROUPS {
                    let (scale, offset) = B::group(&scales, g);
                    // SAFETY: the features above; group g's 32 values lie in the row.
                    unsafe {
                        let d = _mm256_set1_ps(scale);
                        let o = _mm256_set1_ps(offset);
                        let q = blk.unpack(&scales, g);
                        let p = prow.as_mut_ptr().add(b * B::ELEMS + g * QK);
                        for (i, q) in q.iter().enumerate() {
                            _mm256_storeu_ps(p.add(8 * i), _mm256_fmadd_ps(*q, d, o));
                        }
                    }
                }
            }
        }
    }
}

/// A panel kernel: weight rows `j0..` dequantized into `panel` (`panel.len() / k` rows).
pub type PanelFn = unsafe fn(w: &[u8], k: usize, j0: usize, panel: &mut [f32]);

/// The hand kernels of one weight format on one instruction set, `None` where none is written:
/// the per-ISA tables every matmul path reads, made by [`HandKernels::of`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HandKernels {
    /// Register tiles straight on 32-value blocks, for steps below the packed kernel's rows.
    pub tiles: Option<StreamFn>,
    /// Row streaming, for steps of a few rows.
    pub stream: Option<StreamFn>,
    /// The dequantizer of prefill's panels.
    pub panel: Option<PanelFn>,
    /// Row streaming on 8-bit activations.
    #[cfg(target_arch = "x86_64")]
    pub q8: Option<int8::Q8Fn>,
    /// Row streaming on 16-bit activations.
    #[cfg(target_arch = "x86_64")]
    pub i16: Option<int16::I16Fn>,
}

/// What the hand kernels need of a block format on every instruction set they are written
/// for: its values as AVX-512 vectors ([`avx512::Dequant`]), as AVX2 vectors
/// ([`avx2::Unpack`]), as integer bytes ([`int8::Bytes`]) and as 16-bit words
/// ([`int16::Words`]). Every block format of the one
/// list ([`maxc_schema::for_each_block_format`]) must have all three: the tables below are
/// generated from that list, so a format without them does not compile.
#[cfg(target_arch = "x86_64")]
trait BlockKernels: avx512::Dequant + avx2::Unpack + int16::Words {}
#[cfg(target_arch = "x86_64")]
impl<B: avx512::Dequant + avx2::Unpack + int16::Words> BlockKernels for B {}
#[cfg(not(target_arch = "x86_64"))]
trait BlockKernels: Block {}
#[cfg(not(target_arch = "x86_64"))]
impl<B: Block> BlockKernels for B {}

impl HandKernels {
    /// The kernels of block format `B` on `isa`: the same for every block format.
    #[allow(unused_variables)]
    fn of_block<B: BlockKernels>(isa: crate::isa::Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::Isa;
            return match isa {
                Isa::Avx512 => HandKernels {
                    tiles: Some(avx512::tiles::<B>),
                    stream: None,
                    panel: Some(avx512::dequant::<B>),
                    // The 8-bit kernels are AVX2's, which every AVX-512 CPU here has too.
                    q8: Some(int8::stream::<B>),
                    i16: Some(int16::stream512::<B>),
                },
                Isa::Avx2 => HandKernels {
                    tiles: None,
                    stream: Some(avx2::stream::<B>),
                    panel: Some(avx2::dequant::<B>),
                    q8: Some(int8::stream::<B>),
                    i16: Some(int16::stream2::<B>),
                },
                Isa::Baseline => HandKernels::default(),
            };
        }
        #[allow(unreachable_code)]
        HandKernels::default()
    }

    /// The hand kernels for `dtype` weights with rows of `k` values on `isa`.
    #[allow(unused_variables)]
    pub fn of(dtype: maxc_schema::DType, k: usize, isa: crate::isa::Isa) -> Self {
        use maxc_schema::DType;
        macro_rules! blocks_table {
            ($($dt:ident => $block:ident,)*) => {
                match dtype {
                    $(DType::$dt => HandKernels::of_block::<$block>(isa),)*
                    _ => HandKernels::default(),
                }
            };
        }
        #[allow(unused_mut)]
        let mut hand = maxc_schema::for_each_block_format!(blocks_table);
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::Isa;
            // The float formats, and Q4_K's AVX-512 row streaming (the baseline the weights
            // bench compares the tiles with).
            match (isa, dtype) {
                (Isa::Avx512, DType::BF16) if k.is_multiple_of(16) => {
                    hand.stream = Some(bf16_avx512::stream)
                }
                (Isa::Avx512, DType::Q4K) => hand.stream = Some(q4k_avx512::stream),
                (Isa::Avx2, DType::BF16) => hand.stream = Some(avx2::floats::<avx2::Bf16s>),
                (Isa::Avx2, DType::F32) => hand.stream = Some(avx2::floats::<avx2::F32s>),
                _ => {}
            }
        }
        hand
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use maxc_schema::DType;

    #[test]
    fn hand_kernels_match_the_dequantized_reference_on_every_isa_the_host_has() {
        // Two 256-value super-blocks per row, so that a K format's second block is read too.
        let (n, k) = (9, 512);
        let x: Vec<f32> = (0..10 * k)
            .map(|i| ((i * 31) % 19) as f32 * 0.1 - 0.9)
            .collect();
        let mut isas = Vec::new();
        if std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("f16c") {
            isas.push(Isa::Avx512);
        }
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            isas.push(Isa::Avx2);
        }
        for dtype in DType::block_formats().chain([DType::BF16]) {
            let (elems, size) = dtype.block();
            let mut w: Vec<u8> = (0..n * k / elems * size)
                .map(|i| ((i * 73) % 256) as u8)
                .collect();
            for (i, b) in w.chunks_exact_mut(size).enumerate() {
                if dtype == DType::BF16 {
                    break;
                }
                // The scale: Q6_K keeps it last, the others first.
                let d = if dtype == DType::Q6K { size - 2 } else { 0 };
                b[d..d + 2]
                    .copy_from_slice(&half::f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes());
                if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
                }
            }
            if matches!(dtype, DType::Q4K | DType::Q5K) {
                for b in w.chunks_exact_mut(size) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
                }
            }
            if dtype == DType::BF16 {
                for (i, b) in w.chunks_exact_mut(2).enumerate() {
                    b.copy_from_slice(
                        &half::bf16::from_f32((i % 11) as f32 * 0.1 - 0.5).to_le_bytes(),
                    );
                }
            }
            let wf = match dtype {
                DType::BF16 => w
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                _ => maxc_schema::blocks::dequantize(dtype, &w).unwrap(),
            };
            for &isa in &isas {
                let hand = HandKernels::of(dtype, k, isa);
                if let Some(f) = hand.panel {
                    let mut panel = vec![f32::NAN; 3 * k];
                    // SAFETY: the host has the ISA (checked above); rows 4..7 exist.
                    unsafe { f(&w, k, 4, &mut panel) };
                    for (i, (got, want)) in panel.iter().zip(&wf[4 * k..7 * k]).enumerate() {
                        assert!(
                            (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                            "{dtype} {isa:?} panel value {i}: {got} vs {want}"
                        );
                    }
                }
                let kernels: Vec<StreamFn> =
                    [hand.stream, hand.tiles].into_iter().flatten().collect();
                assert!(
                    !kernels.is_empty() || (isa == Isa::Avx2 && dtype == DType::BF16),
                    "{dtype} has no {isa:?} kernel"
                );
                for (f, rows) in kernels.iter().flat_map(|f| (1..=10).map(move |r| (f, r))) {
                    let mut out = vec![f32::NAN; rows * n];
                    // SAFETY: the host has the ISA (checked above).
                    unsafe { f(&x, &w, &mut out, rows, n, k, 0..n) };
                    for r in 0..rows {
                        for j in 0..n {
                            let want: f32 = (0..k).map(|i| x[r * k + i] * wf[j * k + i]).sum();
                            let got = out[r * n + j];
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{dtype} {isa:?} rows {rows} ({r}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
