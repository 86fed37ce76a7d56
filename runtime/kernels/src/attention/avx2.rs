//! [`super::attention`]'s kernels on AVX2 + FMA (eight lanes, sixteen registers), reading f32,
//! f16 and bf16 rows where they lie in the cache (16-bit values widened in registers): the scores of three
//! queries against four keys at a time (each key vector loaded once for the three, the twelve
//! dot products' lanes summed four at a time), the softmax with an eight-lane `exp`, and the
//! weighted values a page at a time with the accumulators in registers. A head size that is
//! not a multiple of eight runs scalar loops (16-bit rows then widened a page at a time).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kernels::{values_scalar, Half, Kernels};
use crate::math::exp8;
use crate::matmul::blocks::hsum;
use crate::matmul::tile::{Bf16, Bf16Rows, F16Rows, F32Rows, Strided, F16};

pub(super) struct Avx2;

/// Lanes `0..n` set (all for `n ≥ 8`).
#[inline(always)]
unsafe fn lanes(n: usize) -> __m256 {
    // SAFETY: the caller has AVX2.
    unsafe {
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(n.min(8) as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ))
    }
}

/// Rows the AVX2 kernels read where they lie: f32, or bf16 and f16 (F16C) widened in
/// registers.
trait Rows8: Copy {
    /// Values `d..d + 8` of row `j`, as f32.
    ///
    /// # Safety
    /// AVX2; the values are readable.
    unsafe fn load8(self, j: usize, d: usize) -> __m256;
}

impl Rows8 for Strided<f32> {
    #[inline(always)]
    unsafe fn load8(self, j: usize, d: usize) -> __m256 {
        // SAFETY: as the trait requires.
        unsafe { _mm256_loadu_ps(self.ptr.add(j * self.stride + d)) }
    }
}

impl Rows8 for Strided<Bf16> {
    #[inline(always)]
    unsafe fn load8(self, j: usize, d: usize) -> __m256 {
        // SAFETY: as the trait requires; a bf16 value is the high half of its f32.
        unsafe {
            let h = _mm_loadu_si128(self.ptr.add(j * self.stride + d).cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
}

impl Rows8 for Strided<F16> {
    #[inline(always)]
    unsafe fn load8(self, j: usize, d: usize) -> __m256 {
        // SAFETY: as the trait requires; the caller has F16C beside AVX2.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(self.ptr.add(j * self.stride + d).cast())) }
    }
}

/// The lane sums of four vectors: `[Σa, Σb, Σc, Σd]`.
#[inline(always)]
unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    // SAFETY: the caller has AVX.
    unsafe {
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
    }
}

/// Scores of queries `0..Q` (at `q`) against keys `j..j + C`: each key's eight values of the
/// head loaded once for every query (the queries' in registers), the `Q × C` dot products'
/// lanes summed four at a time.
#[inline(always)]
unsafe fn score_tile<R: Rows8, const Q: usize, const C: usize>(
    q: *const f32,
    hd: usize,
    k: R,
    j: usize,
    out: *mut f32,
    ld: usize,
) {
    // SAFETY: the caller has AVX2 + FMA; Q query rows of hd values at q, key rows j..j + C.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; Q];
        let mut d = 0;
        while d < hd {
            let mut qv = [_mm256_setzero_ps(); Q];
            for i in 0..Q {
                qv[i] = _mm256_loadu_ps(q.add(i * hd + d));
            }
            for c in 0..C {
                let kv = k.load8(j + c, d);
                for i in 0..Q {
                    acc[i][c] = _mm256_fmadd_ps(qv[i], kv, acc[i][c]);
                }
            }
            d += 8;
        }
        if C == 4 {
            for i in 0..Q {
                let s = hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                _mm_storeu_ps(out.add(i * ld + j), s);
            }
        } else if C == 2 && Q.is_multiple_of(2) {
            // Two queries' two keys at a time.
            for i in (0..Q).step_by(2) {
                let s = hsum4(acc[i][0], acc[i][1], acc[i + 1][0], acc[i + 1][1]);
                _mm_storel_pd(out.add(i * ld + j).cast(), _mm_castps_pd(s));
                _mm_storeh_pd(out.add((i + 1) * ld + j).cast(), _mm_castps_pd(s));
            }
        } else {
            for i in 0..Q {
                for c in 0..C {
                    *out.add(i * ld + j + c) = hsum(acc[i][c]);
                }
            }
        }
    }
}

/// Scores of queries `0..Q` against keys `0..n`, `C` keys at a time.
#[inline(always)]
unsafe fn score_rows<R: Rows8, const Q: usize, const C: usize>(
    q: *const f32,
    hd: usize,
    k: R,
    n: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut j = 0;
    // SAFETY: as `score_tile`.
    unsafe {
        while j + C <= n {
            score_tile::<R, Q, C>(q, hd, k, j, out, ld);
            j += C;
        }
        while j < n {
            score_tile::<R, Q, 1>(q, hd, k, j, out, ld);
            j += 1;
        }
    }
}

/// `out[i·ld + j] = q_i · k_j` for `i < nq`, `j < n` (head size a multiple of eight): three
/// queries against four keys at a time (sixteen registers), four against two.
#[inline(always)]
unsafe fn scores_in_place<R: Rows8>(
    q: *const f32,
    nq: usize,
    hd: usize,
    k: R,
    n: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut i = 0;
    // SAFETY: as the trait's contract.
    unsafe {
        while i < nq {
            let (qi, oi) = (q.add(i * hd), out.add(i * ld));
            let take = match nq - i {
                1 => {
                    score_rows::<R, 1, 4>(qi, hd, k, n, oi, ld);
                    1
                }
                2 => {
                    score_rows::<R, 2, 4>(qi, hd, k, n, oi, ld);
                    2
                }
                4 => {
                    score_rows::<R, 4, 2>(qi, hd, k, n, oi, ld);
                    4
                }
                _ => {
                    score_rows::<R, 3, 4>(qi, hd, k, n, oi, ld);
                    3
                }
            };
            i += take;
        }
    }
}

/// Adds the weighted values of one page's keys `t0..t0 + n` (rows `rows`) into `acc`, for
/// queries `q0..q0 + Q` and values `d0..d0 + 8·D` of the head: the accumulators held in
/// registers over the page (each key's weights broadcast once, each value vector loaded once
/// for the Q queries).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_page<R: Rows8, const Q: usize, const D: usize>(
    scores: &[f32],
    ld: usize,
    q0: usize,
    d0: usize,
    hd: usize,
    t0: usize,
    n: usize,
    rows: R,
    acc: &mut [f32],
) {
    // SAFETY: the caller has AVX2 + FMA; rows q0..q0 + Q of the scores and keys t0..t0 + n in
    // bounds, value rows hold hd ≥ d0 + 8·D values.
    unsafe {
        let at = |i: usize, d: usize| (q0 + i) * hd + d0 + 8 * d;
        let mut a = [[_mm256_setzero_ps(); D]; Q];
        for i in 0..Q {
            for d in 0..D {
                a[i][d] = _mm256_loadu_ps(acc.as_ptr().add(at(i, d)));
            }
        }
        for s in 0..n {
            let mut w = [_mm256_setzero_ps(); Q];
            for i in 0..Q {
                w[i] = _mm256_broadcast_ss(scores.get_unchecked((q0 + i) * ld + t0 + s));
            }
            for d in 0..D {
                let v = rows.load8(s, d0 + 8 * d);
                for i in 0..Q {
                    a[i][d] = _mm256_fmadd_ps(w[i], v, a[i][d]);
                }
            }
        }
        for i in 0..Q {
            for d in 0..D {
                _mm256_storeu_ps(acc.as_mut_ptr().add(at(i, d)), a[i][d]);
            }
        }
    }
}

/// [`Kernels::values`] over rows read where they lie (head size a multiple of eight), into
/// `acc` zeroed: a page at a time (its rows then stay in L1 across the passes), three queries
/// by 16 values of the head or one or two by 32 (no more than eleven registers).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_in_place<R: Rows8>(
    scores: &[f32],
    ld: usize,
    nq: usize,
    hd: usize,
    keys: usize,
    page_size: usize,
    values: &dyn Fn(usize) -> R,
    acc: &mut Vec<f32>,
) {
    acc.clear();
    acc.resize(nq * hd, 0.0);
    let mut t0 = 0;
    // SAFETY: as the trait's contract.
    unsafe {
        while t0 < keys {
            let rows = values(t0 / page_size);
            let n = page_size.min(keys - t0);
            let mut q0 = 0;
            while q0 < nq {
                // Four queries as two pairs.
                let qn = match nq - q0 {
                    4 => 2,
                    r => r.min(3),
                };
                let width = if qn == 3 { 16 } else { 32 };
                let mut d0 = 0;
                while d0 < hd {
                    // One instance per (queries, vectors), so that the accumulators are
                    // registers.
                    macro_rules! block {
                        ($q:literal, $d:literal) => {
                            values_page::<R, $q, $d>(scores, ld, q0, d0, hd, t0, n, rows, acc)
                        };
                    }
                    match (qn, (hd - d0).min(width) / 8) {
                        (1, 1) => block!(1, 1),
                        (1, 2) => block!(1, 2),
                        (1, 3) => block!(1, 3),
                        (1, _) => block!(1, 4),
                        (2, 1) => block!(2, 1),
                        (2, 2) => block!(2, 2),
                        (2, 3) => block!(2, 3),
                        (2, _) => block!(2, 4),
                        (_, 1) => block!(3, 1),
                        _ => block!(3, 2),
                    }
                    d0 += width.min(hd - d0);
                }
                q0 += qn;
            }
            t0 += n;
        }
    }
}

impl Kernels for Avx2 {
    #[inline(always)]
    unsafe fn scores(
        q: *const f32,
        nq: usize,
        hd: usize,
        k: F32Rows,
        n: usize,
        out: *mut f32,
        ld: usize,
        _next: (F32Rows, usize),
    ) {
        // SAFETY: as the trait's contract.
        unsafe {
            if !hd.is_multiple_of(8) {
                for i in 0..nq {
                    for j in 0..n {
                        let mut s = 0.0f32;
                        for d in 0..hd {
                            s = (*q.add(i * hd + d)).mul_add(*k.ptr.add(j * k.stride + d), s);
                        }
                        *out.add(i * ld + j) = s;
                    }
                }
                return;
            }
            scores_in_place(q, nq, hd, k, n, out, ld)
        }
    }

    #[inline(always)]
    unsafe fn scores_half(
        q: *const f32,
        nq: usize,
        hd: usize,
        half: Half,
        k: Strided<u16>,
        n: usize,
        out: *mut f32,
        ld: usize,
    ) -> bool {
        if !hd.is_multiple_of(8) {
            return false;
        }
        let stride = k.stride;
        // SAFETY: as the trait's contract; the loads widen 16-bit values in registers.
        unsafe {
            match half {
                Half::Bf16 => {
                    let k = Bf16Rows {
                        ptr: k.ptr.cast(),
                        stride,
                    };
                    scores_in_place(q, nq, hd, k, n, out, ld)
                }
                Half::F16 => {
                    let k = F16Rows {
                        ptr: k.ptr.cast(),
                        stride,
                    };
                    scores_in_place(q, nq, hd, k, n, out, ld)
                }
            }
        };
        true
    }

    #[inline(always)]
    unsafe fn values_half(
        scores: &[f32],
        ld: usize,
        nq: usize,
        hd: usize,
        keys: usize,
        page_size: usize,
        stride: usize,
        half: Half,
        values: &dyn Fn(usize) -> *const u16,
        acc: &mut Vec<f32>,
    ) -> bool {
        if !hd.is_multiple_of(8) {
            return false;
        }
        // SAFETY: as the trait's contract; the loads widen 16-bit values in registers.
        unsafe {
            match half {
                Half::Bf16 => {
                    let rows = |pg: usize| Bf16Rows {
                        ptr: values(pg).cast(),
                        stride,
                    };
                    values_in_place(scores, ld, nq, hd, keys, page_size, &rows, acc)
                }
                Half::F16 => {
                    let rows = |pg: usize| F16Rows {
                        ptr: values(pg).cast(),
                        stride,
                    };
                    values_in_place(scores, ld, nq, hd, keys, page_size, &rows, acc)
                }
            }
        }
        true
    }

    #[inline(always)]
    unsafe fn softmax(row: &mut [f32], valid: usize, scale: f32) -> (f32, f32) {
        // SAFETY: the caller has AVX2 + FMA; every access is within `row` (whole vectors up to
        // `row.len()`, a multiple of 16; lanes past `valid` masked).
        unsafe {
            let sc = _mm256_set1_ps(scale);
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut i = 0;
            while i < valid {
                let v = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(i)), sc);
                let v = _mm256_blendv_ps(m, v, lanes(valid - i));
                m = _mm256_max_ps(m, v);
                i += 8;
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_movehdup_ps(m));
            let max = _mm_cvtss_f32(m);
            let mx = _mm256_set1_ps(max);
            let mut sum = _mm256_setzero_ps();
            let mut i = 0;
            while i < row.len() {
                let keep = if i < valid {
                    lanes(valid - i)
                } else {
                    _mm256_setzero_ps()
                };
                let v = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(i)), sc);
                let e = _mm256_and_ps(keep, exp8(_mm256_sub_ps(v, mx)));
                _mm256_storeu_ps(row.as_mut_ptr().add(i), e);
                sum = _mm256_add_ps(sum, e);
                i += 8;
            }
            (hsum(sum), max)
        }
    }

    #[inline(always)]
    unsafe fn values(
        scores: &[f32],
        ld: usize,
        nq: usize,
        hd: usize,
        keys: usize,
        page_size: usize,
        stride: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    ) {
        // SAFETY: as the trait's contract.
        unsafe {
            if !hd.is_multiple_of(8) {
                acc.clear();
                acc.resize(nq * hd, 0.0);
                return values_scalar(scores, ld, nq, hd, keys, page_size, stride, values, acc);
            }
            let rows = |pg: usize| F32Rows {
                ptr: values(pg),
                stride,
            };
            values_in_place(scores, ld, nq, hd, keys, page_size, &rows, acc)
        }
    }
}
