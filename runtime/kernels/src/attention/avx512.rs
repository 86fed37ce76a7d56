//! The attention loop's kernels on AVX-512: scores by the matmul register tiles, the softmax
//! with a sixteen-lane `exp`, and the weighted values with the accumulators in registers.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kernels::{values_scalar, Half, Kernels};
use crate::math::exp16;
use crate::matmul::tile::{self, lane_mask, Bf16, Bf16Rows, Elem, F16Rows, F32Rows, Strided, F16};

pub(super) struct Avx512;

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
        let stride = k.stride;
        // SAFETY: as the trait's contract; the register tiles widen 16-bit values as they
        // load them.
        unsafe {
            match half {
                Half::Bf16 => {
                    let k = Bf16Rows {
                        ptr: k.ptr.cast(),
                        stride,
                    };
                    tile::matmul(q, nq, hd, k, n, out, ld)
                }
                Half::F16 => {
                    let k = F16Rows {
                        ptr: k.ptr.cast(),
                        stride,
                    };
                    tile::matmul(q, nq, hd, k, n, out, ld)
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
        if hd != 64 && hd != 128 {
            return false;
        }
        let args = (scores, ld, nq, keys, page_size, stride);
        acc.clear();
        acc.resize(nq * hd, 0.0);
        // SAFETY: as the trait's contract; the loads widen 16-bit values in registers.
        unsafe {
            match half {
                Half::Bf16 => values_16::<Bf16>(args, hd, &|pg| values(pg).cast(), acc),
                Half::F16 => values_16::<F16>(args, hd, &|pg| values(pg).cast(), acc),
            }
        }
        true
    }
    #[inline(always)]
    unsafe fn softmax(row: &mut [f32], valid: usize, scale: f32) -> (f32, f32) {
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
        stride: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    ) {
        // SAFETY: as the trait's contract.
        unsafe { weighted_values(scores, ld, nq, hd, keys, page_size, stride, values, acc) }
    }
}

/// Scales `row[..valid]`, replaces it with `exp(s - max)` and zeroes `row[valid..]`; returns
/// the sum of the exponentials and the max.
#[inline(always)]
unsafe fn softmax_row(row: &mut [f32], valid: usize, scale: f32) -> (f32, f32) {
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
        let max = _mm512_reduce_max_ps(m);
        let mx = _mm512_set1_ps(max);
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < row.len() {
            let mask = if i < valid { lane_mask(valid - i) } else { 0 };
            let v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr().add(i)), sc);
            let e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(v, mx)));
            _mm512_storeu_ps(row.as_mut_ptr().add(i), e);
            sum = _mm512_add_ps(sum, e);
            i += 16;
        }
        (_mm512_reduce_add_ps(sum), max)
    }
}

/// `acc[q, :] = Σ_t scores[q, t] · V[t, :]` for `q < nq`, `t < keys`, value rows of page `pg`
/// at `values(pg)`, `stride` apart (AVX-512).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn weighted_values(
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
    acc.clear();
    acc.resize(nq * hd, 0.0);
    // SAFETY: the caller has AVX-512F; value rows hold `hd` values.
    unsafe {
        match hd {
            64 => values_in_registers::<f32, 4, 6>(
                scores, ld, nq, keys, page_size, stride, values, acc,
            ),
            128 => values_in_registers::<f32, 8, 3>(
                scores, ld, nq, keys, page_size, stride, values, acc,
            ),
            _ => values_scalar(scores, ld, nq, hd, keys, page_size, stride, values, acc),
        }
    }
}

/// [`values_in_registers`] over 16-bit rows of `E`, head size 64 or 128.
///
/// # Safety
/// As [`values_in_registers`].
#[inline(always)]
unsafe fn values_16<E: Elem>(
    args: (&[f32], usize, usize, usize, usize, usize),
    hd: usize,
    values: &dyn Fn(usize) -> *const E,
    acc: &mut [f32],
) {
    let (scores, ld, nq, keys, page_size, stride) = args;
    // SAFETY: the caller's contract.
    unsafe {
        if hd == 64 {
            values_in_registers::<E, 4, 6>(scores, ld, nq, keys, page_size, stride, values, acc)
        } else {
            values_in_registers::<E, 8, 3>(scores, ld, nq, keys, page_size, stride, values, acc)
        }
    }
}

/// [`weighted_values`] for `head_dim = 16·D`, up to `Q` queries' accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn values_in_registers<E: Elem, const D: usize, const Q: usize>(
    scores: &[f32],
    ld: usize,
    nq: usize,
    keys: usize,
    page_size: usize,
    stride: usize,
    values: &dyn Fn(usize) -> *const E,
    acc: &mut [f32],
) {
    let mut q0 = 0;
    while q0 < nq {
        let qn = Q.min(nq - q0);
        // One instance per query count, so that every accumulator is a register (a count
        // known only at run time kept them on the stack).
        let args = (scores, ld, q0, keys, page_size, stride, values);
        // SAFETY: the caller's contract; rows `q0..q0 + qn` exist.
        unsafe {
            match qn {
                1 => values_block::<E, D, 1>(args, acc),
                2 => values_block::<E, D, 2>(args, acc),
                3 => values_block::<E, D, 3>(args, acc),
                4 => values_block::<E, D, 4>(args, acc),
                5 => values_block::<E, D, 5>(args, acc),
                _ => values_block::<E, D, 6>(args, acc),
            }
        }
        q0 += qn;
    }
}

/// Scores, their row length, the first query, keys, page size, value row stride, pages.
type ValuesArgs<'a, E> = (
    &'a [f32],
    usize,
    usize,
    usize,
    usize,
    usize,
    &'a dyn Fn(usize) -> *const E,
);

/// Queries `q0..q0 + Q` of [`values_in_registers`].
#[inline(always)]
unsafe fn values_block<E: Elem, const D: usize, const Q: usize>(
    args: ValuesArgs<E>,
    acc: &mut [f32],
) {
    let (scores, ld, q0, keys, page_size, stride, values) = args;
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
                let v = base.add(s * stride);
                // Value rows prefetched a few dozen rows ahead, into the next page (anywhere in
                // the cache) near the end of this one.
                let ahead = s + tile::STRIDED_AHEAD;
                let pv = if ahead < n {
                    base.add(ahead * stride)
                } else {
                    next.wrapping_add((ahead - n) * stride)
                };
                if ahead < n || (!next.is_null() && t0 + ahead < keys) {
                    for d in 0..D {
                        _mm_prefetch::<_MM_HINT_T0>(pv.add(16 * d).cast());
                    }
                }
                let mut vv = [_mm512_setzero_ps(); D];
                for d in 0..D {
                    vv[d] = E::load16(v.add(16 * d));
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
