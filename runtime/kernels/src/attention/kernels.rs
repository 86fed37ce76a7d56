//! What an instruction set gives the attention loop, and the scalar weighted sum the vector
//! versions fall back on for head sizes they do not cover.
#![allow(clippy::needless_range_loop)]

use crate::matmul::tile::{F32Rows, Strided};

/// A 16-bit KV cache type the kernels may read where it lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Half {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

/// What an instruction set gives [`super::attention`]'s loop: the scores matmul, the softmax of a row and the
/// weighted sum of the values.
pub(super) trait Kernels {
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
    /// As [`Kernels::scores`] over 16-bit key rows (`half`, their bits at `k`) read where
    /// they are; false (nothing written) where this instruction set or head size widens them
    /// first instead.
    ///
    /// # Safety
    /// As [`Kernels::scores`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_half(
        _q: *const f32,
        _nq: usize,
        _hd: usize,
        _half: Half,
        _k: Strided<u16>,
        _n: usize,
        _out: *mut f32,
        _ld: usize,
    ) -> bool {
        false
    }
    /// As [`Kernels::values`] over 16-bit value rows (`half`) read where they are (`stride` in
    /// values, `values(pg)` the page's first row); false (nothing written) where this
    /// instruction set or head size widens them first instead.
    ///
    /// # Safety
    /// As [`Kernels::values`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn values_half(
        _scores: &[f32],
        _ld: usize,
        _nq: usize,
        _hd: usize,
        _keys: usize,
        _page_size: usize,
        _stride: usize,
        _half: Half,
        _values: &dyn Fn(usize) -> *const u16,
        _acc: &mut Vec<f32>,
    ) -> bool {
        false
    }
    /// Scales `row[..valid]`, replaces it with `exp(s - max)` and zeroes `row[valid..]`;
    /// returns the sum of the exponentials and the max.
    ///
    /// # Safety
    /// The instruction set is available; `row.len()` is a multiple of 16.
    unsafe fn softmax(row: &mut [f32], valid: usize, scale: f32) -> (f32, f32);
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
        stride: usize,
        values: &dyn Fn(usize) -> *const f32,
        acc: &mut Vec<f32>,
    );
}

/// [`weighted_values`] one value at a time (head sizes the vector kernels do not cover), into
/// `acc` zeroed.
///
/// # Safety
/// As [`weighted_values`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn values_scalar(
    scores: &[f32],
    ld: usize,
    nq: usize,
    hd: usize,
    keys: usize,
    page_size: usize,
    stride: usize,
    values: &dyn Fn(usize) -> *const f32,
    acc: &mut [f32],
) {
    for t in 0..keys {
        // SAFETY: as the function's contract: value rows hold `hd` values.
        let v = unsafe { values(t / page_size).add((t % page_size) * stride) };
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
