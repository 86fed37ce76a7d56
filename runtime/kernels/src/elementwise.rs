//! The library's fused elementwise kernel (AVX-512): the expression program of
//! [`KernelBody::Elementwise`](maxc_schema::KernelBody::Elementwise) evaluated sixteen lanes at a
//! time (generated CPU code has four), one instruction over a chunk of a row at once. `silu` is
//! `x / (1 + exp(-x))` with the vector `exp` of the blocked attention, as the reference computes
//! it.
#![allow(clippy::needless_range_loop)]

use maxc_schema::EwInstr;
use std::arch::x86_64::*;

/// The longest program this kernel evaluates (a scratch chunk per instruction, 16 KiB in all);
/// longer ones run as generated code.
pub const MAX_PROGRAM: usize = 16;
/// The most inputs this kernel takes (passed without allocating); more run as generated code.
pub const MAX_INPUTS: usize = 8;

/// An input of the expression: `rows × cols` values, or one row of `cols` repeated.
#[derive(Clone, Copy)]
pub struct Input {
    pub ptr: *const f32,
    pub broadcast: bool,
}

// SAFETY: read-only pointers into buffers that outlive the kernel call; threads only read them.
unsafe impl Send for Input {}
unsafe impl Sync for Input {}

/// Elements per chunk: each instruction runs over a chunk of a row at once, its values in an
/// L1-resident scratch row, so that the program is dispatched once per chunk, not per vector.
const CHUNK: usize = 256;

/// Rows `r0..r1` of `out[rows, cols] = program(inputs)`.
///
/// # Safety
/// AVX-512F; every input holds `r1 × cols` values (or `cols` where broadcast), `out` the same;
/// `program` is valid (operands refer to earlier instructions and to inputs that exist) and at
/// most [`MAX_PROGRAM`] long.
#[target_feature(enable = "avx512f,avx512dq,fma")]
pub unsafe fn rows(
    inputs: &[Input],
    program: &[EwInstr],
    cols: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
) {
    debug_assert!(!program.is_empty() && program.len() <= MAX_PROGRAM);
    let last = program.len() - 1;
    let mut vals = [[0.0f32; CHUNK]; MAX_PROGRAM];
    for r in r0..r1 {
        let mut c0 = 0;
        while c0 < cols {
            let len = CHUNK.min(cols - c0);
            for (t, instr) in program.iter().enumerate() {
                let (done, rest) = vals.split_at_mut(t);
                let dst = rest[0].as_mut_ptr();
                let src = |a: u32| done[a as usize].as_ptr();
                // SAFETY: the contract above; each loop reads and writes `len ≤ CHUNK` values
                // (masked lanes are not touched).
                unsafe {
                    match *instr {
                        EwInstr::Input(j) => {
                            let inp = inputs[j as usize];
                            let at = if inp.broadcast { c0 } else { r * cols + c0 };
                            lanes(len, |i, m| {
                                let v = _mm512_maskz_loadu_ps(m, inp.ptr.add(at + i));
                                _mm512_mask_storeu_ps(dst.add(i), m, v);
                            });
                        }
                        EwInstr::Add(a, b) => {
                            binary(len, src(a), src(b), dst, |x, y| _mm512_add_ps(x, y))
                        }
                        EwInstr::Mul(a, b) => {
                            binary(len, src(a), src(b), dst, |x, y| _mm512_mul_ps(x, y))
                        }
                        EwInstr::Silu(a) => {
                            let xs = src(a);
                            lanes(len, |i, m| {
                                let x = _mm512_maskz_loadu_ps(m, xs.add(i));
                                let e = crate::math::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                                let y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                                _mm512_mask_storeu_ps(dst.add(i), m, y);
                            });
                        }
                        EwInstr::GeluTanh(a) => {
                            let xs = src(a);
                            lanes(len, |i, m| {
                                let x = _mm512_maskz_loadu_ps(m, xs.add(i));
                                let one = _mm512_set1_ps(1.0);
                                let x2 = _mm512_mul_ps(x, x);
                                let inner = _mm512_fmadd_ps(
                                    _mm512_set1_ps(maxc_schema::GELU_TANH_CUBIC),
                                    x2,
                                    one,
                                );
                                let arg = _mm512_mul_ps(
                                    _mm512_set1_ps(-maxc_schema::GELU_TANH_SLOPE),
                                    _mm512_mul_ps(x, inner),
                                );
                                let e = crate::math::exp16(arg);
                                let y = _mm512_div_ps(x, _mm512_add_ps(one, e));
                                _mm512_mask_storeu_ps(dst.add(i), m, y);
                            });
                        }
                    }
                }
            }
            // SAFETY: `out` holds rows × cols values; masked lanes are not written.
            unsafe {
                let res = vals[last].as_ptr();
                let o = out.add(r * cols + c0);
                lanes(len, |i, m| {
                    _mm512_mask_storeu_ps(o.add(i), m, _mm512_maskz_loadu_ps(m, res.add(i)))
                });
            }
            c0 += len;
        }
    }
}

/// Calls `f(i, mask)` for every sixteen values of `0..len` (the last ones masked).
#[inline(always)]
fn lanes(len: usize, mut f: impl FnMut(usize, __mmask16)) {
    let mut i = 0;
    while i < len {
        f(i, crate::matmul::tile::lane_mask(len - i));
        i += 16;
    }
}

/// `dst[i] = op(a[i], b[i])` for `i < len`.
///
/// # Safety
/// AVX-512F; `a`, `b` and `dst` hold `len` values.
#[inline(always)]
unsafe fn binary(
    len: usize,
    a: *const f32,
    b: *const f32,
    dst: *mut f32,
    op: impl Fn(__m512, __m512) -> __m512,
) {
    // SAFETY: as the caller guarantees; masked lanes are not touched.
    lanes(len, |i, m| unsafe {
        let v = op(
            _mm512_maskz_loadu_ps(m, a.add(i)),
            _mm512_maskz_loadu_ps(m, b.add(i)),
        );
        _mm512_mask_storeu_ps(dst.add(i), m, v);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_instruction_matches_scalar_f32_at_every_edge() {
        if !crate::isa::tiles_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        // silu(a · w + b) and gelu_tanh(a · w + b), w broadcast, over widths that end
        // mid-vector.
        let gelu = |x: f32| {
            let inner = (2.0f32 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh())
        };
        let cases: [(EwInstr, &dyn Fn(f32) -> f32); 2] = [
            (EwInstr::Silu(4), &|x: f32| x / (1.0 + (-x).exp())),
            (EwInstr::GeluTanh(4), &gelu),
        ];
        for ((act, f), cols) in cases
            .iter()
            .flat_map(|c| [1, 15, 16, 17, 40, 300].map(|cols| (c, cols)))
        {
            let program = [
                EwInstr::Input(0),
                EwInstr::Input(1),
                EwInstr::Mul(0, 1),
                EwInstr::Input(2),
                EwInstr::Add(2, 3),
                *act,
            ];
            let rows = 3;
            let a: Vec<f32> = (0..rows * cols)
                .map(|i| (i as f32 * 0.77).sin() * 30.0)
                .collect();
            let w: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32 * 0.1).collect();
            let b: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.01 - 0.3).collect();
            let mut out = vec![f32::NAN; rows * cols + 1];
            let inputs = [
                Input {
                    ptr: a.as_ptr(),
                    broadcast: false,
                },
                Input {
                    ptr: w.as_ptr(),
                    broadcast: true,
                },
                Input {
                    ptr: b.as_ptr(),
                    broadcast: false,
                },
            ];
            // SAFETY: AVX-512 (checked); every input and the output hold rows × cols values.
            unsafe { super::rows(&inputs, &program, cols, 0, rows, out.as_mut_ptr()) };
            for r in 0..rows {
                for c in 0..cols {
                    let x = a[r * cols + c] * w[c] + b[r * cols + c];
                    let want = f(x);
                    let got = out[r * cols + c];
                    assert!(
                        (got - want).abs() <= 2e-6 * (1.0 + want.abs()),
                        "{act:?} cols {cols} ({r}, {c}): {got} vs {want}"
                    );
                }
            }
            assert!(out[rows * cols].is_nan(), "wrote past the end");
        }
    }
}
