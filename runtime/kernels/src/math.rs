//! The vector `e^x` of the library kernels, in sixteen lanes (AVX-512) and eight (AVX2 + FMA),
//! on the constants the generated code uses ([`maxc_schema::exp`]).

use maxc_schema::exp;
use std::arch::x86_64::*;

/// `e^x` in sixteen lanes (Cephes' expf: `x = n·ln2 + r`, a degree-6 polynomial in `r`, then
/// `2^n` by `scalef`), within about one ulp; inputs below [`exp::MIN`] are clamped to it (a result of
/// about 1e-38), above 88.7 the result is infinite.
#[inline(always)]
pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
    // SAFETY: the caller has AVX-512F.
    unsafe {
        let x = _mm512_max_ps(x, _mm512_set1_ps(exp::MIN));
        let n = _mm512_roundscale_ps(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp::LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp::LN2_LO), r);
        let mut p = _mm512_set1_ps(exp::POLY[0]);
        for c in &exp::POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(
            p,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_scalef_ps(y, n)
    }
}

/// `e^x` in eight lanes, as [`exp16`] (Cephes' expf: `x = n·ln2 + r`, a degree-6
/// polynomial in `r`, then `2^n` built in the exponent bits), within about one ulp; inputs are
/// clamped to [[`exp::MIN`], [`exp::MAX`]].
#[inline(always)]
pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
    // SAFETY: the caller has AVX2 and FMA.
    unsafe {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(exp::MIN)),
            _mm256_set1_ps(exp::MAX),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp::LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp::LN2_LO), r);
        let mut p = _mm256_set1_ps(exp::POLY[0]);
        for c in &exp::POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        // 2^n for n in [-126, 127]: the biased exponent n + 127 in bits 23..31. (see
        // `exp::MIN` and `exp::MAX`.)
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }
}
