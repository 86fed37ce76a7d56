//! 16-bit float weights (bf16, f16) in panels of 32 output columns, and the register tiles that
//! read them.
//!
//! A weight `[n, k]` is stored by rows: each output column's `k` values lie together, so the
//! register tiles of [`super::tile`] take dot products along `k` and sum each accumulator's
//! lanes at the end. At eight activation rows those tiles run at about half the FMA peak even on
//! f32 weights in L1 (their loads, shuffles and sums per FMA). Repacked at load into
//! *panels* (the executor's `Repack`), the same values lie the other way round: panel `p` holds,
//! for each `i` in `0..k`, the 32 values `w[32p + c][i]` (`c < 32`) in one 64-byte line, the
//! last panel padded with zeros. A tile of `R ≤ 8` activation rows by one panel keeps two
//! accumulators a row (output columns along the lanes): per `i` it loads one line, widens it into
//! two 16-lane f32 vectors (bf16: one shift and one mask; f16: two conversions), broadcasts each
//! row's `x[r][i]` from memory, and issues two FMAs a row, sixteen at eight rows against two or
//! three other instructions; the accumulators are the outputs, with no sums across lanes. Steps
//! of more rows run the tiles eight rows at a time over a panel, which stays in L1/L2.
//!
//! Within a line, bf16 lane `l` (a 32-bit word) holds column `l` in its low half and column
//! `16 + l` in its high half, so `word << 16` and `word & 0xFFFF_0000` are the two f32 vectors;
//! f16 holds columns `0..32` in order, each half converted by `vcvtph2ps`.
//!
//! The values and their products are the stored ones; sums run along `k` in order, so results
//! match the row kernels' up to f32 reassociation.

use maxc_schema::DType;

/// Output columns per panel.
pub const COLS: usize = 32;
/// Bytes per `i` of a panel (32 16-bit values).
const LINE: usize = 64;
/// Most activation rows per tile.
const MAX_ROWS: usize = 8;
/// How far ahead (in lines, values of `i`) a tile prefetches its panel: the hardware's
/// streams alone left a core's eight-row tile at 128-136 GFLOP/s on the Intel guest against
/// 152-159 with this (a stand-alone measurement of 1536 × 576 bf16 weights from L3).
const AHEAD: usize = 96;

/// Whether `dtype` weights can be read in panels.
pub fn supported(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// Bytes of an `[n, k]` weight of `dtype` in panels.
pub fn panels_len(n: usize, k: usize) -> usize {
    n.div_ceil(COLS) * k * LINE
}

/// Writes the `[n, k]` weight `src` of `dtype` (by rows, as stored) into `dst` in panels.
/// Returns whether it could: a format without panels, or lengths that do not match
/// ([`panels_len`]), write nothing.
pub fn repack(dtype: DType, src: &[u8], dst: &mut [u8], n: usize, k: usize) -> bool {
    if !supported(dtype) || src.len() != n * k * 2 || dst.len() != panels_len(n, k) {
        return false;
    }
    let value = |j: usize, i: usize| -> [u8; 2] {
        let at = (j * k + i) * 2;
        [src[at], src[at + 1]]
    };
    for (p, panel) in dst.chunks_exact_mut(k * LINE).enumerate() {
        let cols = COLS.min(n - p * COLS);
        for (i, line) in panel.chunks_exact_mut(LINE).enumerate() {
            for c in 0..COLS {
                let v = if c < cols {
                    value(p * COLS + c, i)
                } else {
                    [0, 0]
                };
                let at = slot(dtype, c);
                line[at..at + 2].copy_from_slice(&v);
            }
        }
    }
    true
}

/// The byte offset of column `c` (`< 32`) in a line of `dtype`.
fn slot(dtype: DType, c: usize) -> usize {
    match dtype {
        // Word `c % 16`, low half for columns 0..16, high half for 16..32.
        DType::BF16 => (c % 16) * 4 + (c / 16) * 2,
        _ => c * 2,
    }
}

/// The value of column `c` at line `line` (of a panel of `dtype`), as f32.
fn value(dtype: DType, line: &[u8], c: usize) -> f32 {
    let at = slot(dtype, c);
    let bits = u16::from_le_bytes([line[at], line[at + 1]]);
    match dtype {
        DType::BF16 => f32::from_bits((bits as u32) << 16),
        _ => maxc_schema::blocks::f16_to_f32(bits),
    }
}

/// Row `row` (an output column) of an `[n, k]` weight of `dtype` in panels, as f32, into
/// `out[..k]` (an embedding table that is also the output head's weight).
pub fn gather_row(dtype: DType, w: &[u8], k: usize, row: usize, out: &mut [f32]) {
    let panel = &w[row / COLS * k * LINE..][..k * LINE];
    for (o, line) in out[..k].iter_mut().zip(panel.chunks_exact(LINE)) {
        *o = value(dtype, line, row % COLS);
    }
}

/// `out[r * n + j] = Σ_i x[r * k + i] · w[j][i]` for panels `panels` of the weight `w` of
/// `dtype` in panels (`j` in their columns below `n`), all `rows` rows: the plain loops, for
/// CPUs without AVX-512.
#[allow(clippy::too_many_arguments)]
fn matmul_generic(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    panels: std::ops::Range<usize>,
) {
    let mut acc = [0f32; COLS];
    for p in panels {
        let panel = &w[p * k * LINE..(p + 1) * k * LINE];
        let cols = COLS.min(n - p * COLS);
        for r in 0..rows {
            acc.fill(0.0);
            for (i, line) in panel.chunks_exact(LINE).enumerate() {
                let xv = x[r * k + i];
                for (c, a) in acc[..cols].iter_mut().enumerate() {
                    *a += xv * value(dtype, line, c);
                }
            }
            out[r * n + p * COLS..r * n + p * COLS + cols].copy_from_slice(&acc[..cols]);
        }
    }
}

/// `out[rows, n] = x[rows, k] · wᵀ`, `w` an `[n, k]` weight of `dtype` in panels
/// ([`panels_len`] bytes), panels split across `threads` where the weight is large enough.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    assert!(supported(dtype), "{dtype:?} weights have no panels");
    assert!(x.len() >= rows * k && out.len() >= rows * n && w.len() >= panels_len(n, k));
    let panels = n.div_ceil(COLS);
    let chunks = if w.len() < super::SPLIT_BYTES {
        1
    } else {
        threads.clamp(1, panels)
    };
    let avx512 = tiles_available();
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        let range = panels * c / chunks..panels * (c + 1) / chunks;
        // SAFETY: `out` holds rows × n values; each call writes only the columns of its
        // panels, which no other call's range holds.
        let out = unsafe { std::slice::from_raw_parts_mut(optr.get(), rows * n) };
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512F/BW/VL/DQ and F16C (checked); lengths checked above.
            unsafe {
                match dtype {
                    DType::BF16 => panels_avx512::<Bf16>(x, w, out, rows, n, k, range),
                    _ => panels_avx512::<F16>(x, w, out, rows, n, k, range),
                }
            }
            return;
        }
        let _ = avx512;
        matmul_generic(dtype, x, w, out, rows, n, k, range);
    });
}

/// Whether this CPU runs the AVX-512 tiles (elsewhere panels run plain loops).
pub fn tiles_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::isa::isa() == crate::isa::Isa::Avx512 && super::tile::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// How a line of a panel widens into its two f32 vectors (columns `0..16`, `16..32`).
#[cfg(target_arch = "x86_64")]
trait Widen {
    /// # Safety
    /// AVX-512F/BW and F16C; 64 readable bytes at `p`.
    unsafe fn widen(p: *const u8) -> (__m512, __m512);
}

#[cfg(target_arch = "x86_64")]
struct Bf16;
#[cfg(target_arch = "x86_64")]
struct F16;

#[cfg(target_arch = "x86_64")]
impl Widen for Bf16 {
    #[inline(always)]
    unsafe fn widen(p: *const u8) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe {
            let v = _mm512_loadu_si512(p.cast());
            let lo = _mm512_slli_epi32::<16>(v);
            let hi = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi))
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Widen for F16 {
    #[inline(always)]
    unsafe fn widen(p: *const u8) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe {
            let lo = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
            let hi = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32).cast()));
            (lo, hi)
        }
    }
}

/// One tile: `R` rows of `x` (rows `k` apart) by the panel at `w`; writes the `cols` (≤ 32)
/// first columns of each row of `out` (rows `ldo` apart).
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; `x` holds `R` rows of `k` values, `w` a panel of `k` lines,
/// `out` `R` rows with `cols` columns from it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile<W: Widen, const R: usize>(
    x: *const f32,
    k: usize,
    w: *const u8,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY (the loads): `i < k` lines of the panel, `R` rows of `x`; prefetches never fault.
    unsafe {
        let step = |acc: &mut [[__m512; 2]; R], i: usize| {
            _mm_prefetch::<_MM_HINT_T0>(w.add((i + AHEAD) * LINE).cast());
            let (a, b) = W::widen(w.add(i * LINE));
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(r * k + i));
                acc[0] = _mm512_fmadd_ps(xv, a, acc[0]);
                acc[1] = _mm512_fmadd_ps(xv, b, acc[1]);
            }
        };
        let mut i = 0;
        // Two values of `i` a pass: the loop's own instructions halved.
        while i + 2 <= k {
            step(&mut acc, i);
            step(&mut acc, i + 1);
            i += 2;
        }
        if i < k {
            step(&mut acc, i);
        }
        let (ma, mb) = (
            super::tile::lane_mask(cols),
            super::tile::lane_mask(cols.saturating_sub(16)),
        );
        for (r, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(r * ldo), ma, a[0]);
            _mm512_mask_storeu_ps(out.add(r * ldo + 16), mb, a[1]);
        }
    }
}

/// The tiles of panels `panels` for every row, eight rows at a time.
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; lengths as [`matmul`] checks them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn panels_avx512<W: Widen>(
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    panels: std::ops::Range<usize>,
) {
    for p in panels {
        let cols = COLS.min(n - p * COLS);
        let mut r = 0;
        while r < rows {
            let m = MAX_ROWS.min(rows - r);
            // SAFETY: rows r..r + m of x and out, panel p of w, columns below n.
            unsafe {
                let (xp, wp, op) = (
                    x.as_ptr().add(r * k),
                    w.as_ptr().add(p * k * LINE),
                    out.as_mut_ptr().add(r * n + p * COLS),
                );
                match m {
                    1 => tile::<W, 1>(xp, k, wp, op, n, cols),
                    2 => tile::<W, 2>(xp, k, wp, op, n, cols),
                    3 => tile::<W, 3>(xp, k, wp, op, n, cols),
                    4 => tile::<W, 4>(xp, k, wp, op, n, cols),
                    5 => tile::<W, 5>(xp, k, wp, op, n, cols),
                    6 => tile::<W, 6>(xp, k, wp, op, n, cols),
                    7 => tile::<W, 7>(xp, k, wp, op, n, cols),
                    _ => tile::<W, 8>(xp, k, wp, op, n, cols),
                }
            }
            r += m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A weight of `n × k` 16-bit values of `dtype` with varied signs and magnitudes.
    fn weight(dtype: DType, n: usize, k: usize) -> Vec<u8> {
        (0..n * k)
            .flat_map(|e| {
                let v = ((e * 7919 % 2003) as f32 - 1001.0) / 997.0;
                let bits = match dtype {
                    DType::BF16 => (v.to_bits() >> 16) as u16,
                    _ => half::f16::from_f32(v).to_bits(),
                };
                bits.to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn panels_hold_each_stored_value_and_zeros_past_the_last_column() {
        for dtype in [DType::BF16, DType::F16] {
            let (n, k) = (37, 5);
            let src = weight(dtype, n, k);
            let mut dst = vec![0xAAu8; panels_len(n, k)];
            assert!(repack(dtype, &src, &mut dst, n, k));
            for j in 0..64 {
                for i in 0..k {
                    let line = &dst[(j / COLS * k + i) * LINE..][..LINE];
                    let want = if j < n {
                        let mut row = vec![0f32; k];
                        super::super::gather_row(&src, dtype, k, j, &mut row);
                        row[i]
                    } else {
                        0.0
                    };
                    assert_eq!(
                        value(dtype, line, j % COLS),
                        want,
                        "{dtype:?} column {j}, i {i}"
                    );
                }
            }
            let mut row = vec![0f32; k];
            let mut got = vec![0f32; k];
            for j in 0..n {
                super::super::gather_row(&src, dtype, k, j, &mut row);
                gather_row(dtype, &dst, k, j, &mut got);
                assert_eq!(got, row, "{dtype:?} row {j}");
            }
            assert!(
                !repack(dtype, &src, &mut dst[1..], n, k),
                "a short destination"
            );
        }
        assert!(!repack(DType::F32, &[0; 16], &mut [0; 256], 1, 4));
    }
}
