//! The `e^x` every CPU kernel computes, generated (Cranelift) or library (AVX-512, AVX2): one
//! set of constants, so that a fused kernel and the library kernel of the same op agree.
//! Cephes' `expf`: `x = n·ln2 + r` with `n = nearest(x·log2 e)`, `e^r ≈ 1 + r + r²·p(r)`, then
//! `2^n` assembled in the exponent bits (or by `scalef`).

/// Inputs are clamped to `[MIN, MAX]`: `exp(MIN)` is still a normal f32 and
/// `nearest(MAX · log2 e) = 127`, so `2^n` always has a biased exponent in `1..=254`.
/// Below the range the result is ~1.3e-38 instead of 0; above it ~2.4e38 instead of inf.
pub const MIN: f32 = -87.3;
/// The largest input (see [`MIN`]).
pub const MAX: f32 = 88.37;
/// ln 2 split so that `n · LN2_HI` is exact for |n| < 2^9 (Cody–Waite reduction).
pub const LN2_HI: f32 = 355.0 / 512.0;
/// The rest of ln 2 (see [`LN2_HI`]).
pub const LN2_LO: f32 = -2.121_944_4e-4;
/// Minimax coefficients of `(e^r - 1 - r) / r²` on `[-ln2/2, ln2/2]`, highest degree first.
pub const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
