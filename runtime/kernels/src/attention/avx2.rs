//! [`super::attention`]'s kernels on AVX2 + FMA (eight lanes, sixteen registers): the scores of
//! up to four queries against two keys at a time with their dot products' lanes summed once,
//! the softmax with an eight-lane `exp`, and the weighted values with two queries' accumulators
//! for 32 values of the head at a time in registers. A head size that is not a multiple of
//! eight runs scalar loops.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kernels::{values_scalar, Kernels};
use crate::math::exp8;
use crate::matmul::blocks::hsum;
use crate::matmul::tile::F32Rows;

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

/// Scores of queries `q0..q0 + Q` against keys `j..j + C` (eight values of the head at a time).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_tile<const Q: usize, const C: usize>(
    q: *const f32,
    hd: usize,
    k: F32Rows,
    j: usize,
    out: *mut f32,
    ld: usize,
) {
    // SAFETY: the caller has AVX2 + FMA; Q query rows of hd values at q, key rows j..j + C.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; Q];
        let mut d = 0;
        while d < hd {
            let mut kv = [_mm256_setzero_ps(); C];
            for c in 0..C {
                kv[c] = _mm256_loadu_ps(k.ptr.add((j + c) * k.stride + d));
            }
            for i in 0..Q {
                let qv = _mm256_loadu_ps(q.add(i * hd + d));
                for c in 0..C {
                    acc[i][c] = _mm256_fmadd_ps(qv, kv[c], acc[i][c]);
                }
            }
            d += 8;
        }
        for i in 0..Q {
            for c in 0..C {
                *out.add(i * ld + j + c) = hsum(acc[i][c]);
            }
        }
    }
}

/// Scores of queries `q0..q0 + Q` against keys `0..n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_rows<const Q: usize>(
    q: *const f32,
    hd: usize,
    k: F32Rows,
    n: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut j = 0;
    // SAFETY: as `score_tile`.
    unsafe {
        while j + 2 <= n {
            score_tile::<Q, 2>(q, hd, k, j, out, ld);
            j += 2;
        }
        if j < n {
            score_tile::<Q, 1>(q, hd, k, j, out, ld);
        }
    }
}

/// Value rows `t` of the values, for queries `q0..q0 + Q`, values `d0..d0 + 8·D` of the head,
/// accumulated in registers over every key, then stored into `acc`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_block<const Q: usize, const D: usize>(
    scores: &[f32],
    ld: usize,
    q0: usize,
    d0: usize,
    hd: usize,
    keys: usize,
    page_size: usize,
    slot: usize,
    values: &dyn Fn(usize) -> *const f32,
    acc: &mut [f32],
) {
    // SAFETY: the caller has AVX2 + FMA; rows q0..q0 + Q of the scores and keys ..keys in
    // bounds, value rows hold hd ≥ d0 + 8·D values.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); D]; Q];
        let mut t0 = 0;
        while t0 < keys {
            let base = values(t0 / page_size).add(d0);
            let n = page_size.min(keys - t0);
            for s in 0..n {
                let v = base.add(s * slot);
                let mut vv = [_mm256_setzero_ps(); D];
                for d in 0..D {
                    vv[d] = _mm256_loadu_ps(v.add(8 * d));
                }
                for i in 0..Q {
                    let w = _mm256_broadcast_ss(scores.get_unchecked((q0 + i) * ld + t0 + s));
                    for d in 0..D {
                        a[i][d] = _mm256_fmadd_ps(w, vv[d], a[i][d]);
                    }
                }
            }
            t0 += n;
        }
        for i in 0..Q {
            for d in 0..D {
                _mm256_storeu_ps(acc.as_mut_ptr().add((q0 + i) * hd + d0 + 8 * d), a[i][d]);
            }
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
            let mut i = 0;
            while i < nq {
                let (qi, oi) = (q.add(i * hd), out.add(i * ld));
                match nq - i {
                    1 => score_rows::<1>(qi, hd, k, n, oi, ld),
                    2 => score_rows::<2>(qi, hd, k, n, oi, ld),
                    3 => score_rows::<3>(qi, hd, k, n, oi, ld),
                    _ => score_rows::<4>(qi, hd, k, n, oi, ld),
                }
                i += 4.min(nq - i);
            }
        }
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
        slot: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    ) {
        acc.clear();
        acc.resize(nq * hd, 0.0);
        // SAFETY: as the trait's contract.
        unsafe {
            if !hd.is_multiple_of(8) {
                return values_scalar(scores, ld, nq, hd, keys, page_size, slot, values, acc);
            }
            let mut q0 = 0;
            while q0 < nq {
                let qn = 2.min(nq - q0);
                let mut d0 = 0;
                while d0 < hd {
                    // One instance per (queries, vectors), so that the accumulators are
                    // registers.
                    macro_rules! block {
                        ($q:literal, $d:literal) => {
                            values_block::<$q, $d>(
                                scores, ld, q0, d0, hd, keys, page_size, slot, values, acc,
                            )
                        };
                    }
                    match (qn, (hd - d0) / 8) {
                        (1, 1) => block!(1, 1),
                        (1, 2) => block!(1, 2),
                        (1, 3) => block!(1, 3),
                        (1, _) => block!(1, 4),
                        (_, 1) => block!(2, 1),
                        (_, 2) => block!(2, 2),
                        (_, 3) => block!(2, 3),
                        _ => block!(2, 4),
                    }
                    d0 += 32.min(hd - d0);
                }
                q0 += qn;
            }
        }
    }
}
