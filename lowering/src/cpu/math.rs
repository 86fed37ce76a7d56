//! Transcendental functions written in Cranelift IR (Cranelift has no `exp`, and kernels may
//! not call libm): a vectorisable `exp` and `silu` built on it. Both work on f32 and f32x4.

use super::builder::{int_lanes, KernelBuilder};
use cranelift_codegen::ir::{InstBuilder, Value};

use maxc_schema::exp::{LN2_HI, LN2_LO, MAX as EXP_MAX, MIN as EXP_MIN, POLY};
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// 1.5 · 2^23: adding it to an integral float `n` (|n| < 2^22) puts `n` in the low mantissa
/// bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x` lane-wise (f32 or f32x4 `x`): `x = n·ln2 + r` with `n = nearest(x·log2 e)`,
/// `e^r ≈ 1 + r + r²·p(r)` (degree-5 `p`), and `2^n` assembled in the exponent bits.
/// Relative error about 1e-7 over the clamped range; NaN propagates.
pub(crate) fn exp(kb: &mut KernelBuilder, x: Value) -> Value {
    let ty = kb.b.func.dfg.value_type(x);
    let ity = int_lanes(ty);
    let lo = kb.fconst(ty, EXP_MIN);
    let hi = kb.fconst(ty, EXP_MAX);
    // NaN stays NaN: it is the propagating operand of both.
    let x = kb.max(lo, x);
    let x = kb.min(hi, x);

    let log2e = kb.fconst(ty, LOG2_E);
    let t = kb.b.ins().fmul(x, log2e);
    let n = kb.b.ins().nearest(t);
    let ln2_hi = kb.fconst(ty, LN2_HI);
    let ln2_lo = kb.fconst(ty, LN2_LO);
    let nh = kb.b.ins().fmul(n, ln2_hi);
    let r = kb.b.ins().fsub(x, nh);
    let nl = kb.b.ins().fmul(n, ln2_lo);
    let r = kb.b.ins().fsub(r, nl);

    let mut p = kb.fconst(ty, POLY[0]);
    for &c in &POLY[1..] {
        let c = kb.fconst(ty, c);
        let pr = kb.b.ins().fmul(p, r);
        p = kb.b.ins().fadd(pr, c);
    }
    let r2 = kb.b.ins().fmul(r, r);
    let p = kb.b.ins().fmul(p, r2);
    let one = kb.fconst(ty, 1.0);
    let p = kb.b.ins().fadd(p, r);
    let y = kb.b.ins().fadd(p, one);

    // bits(n + 1.5·2^23) = 0x4B40_0000 + n; shifting by 23 drops the constant's bits, so
    // (bits + 127) << 23 is the f32 2^n.
    let magic = kb.fconst(ty, ROUND_MAGIC);
    let nm = kb.b.ins().fadd(n, magic);
    let bits = kb.bitcast(ity, nm);
    let bias = kb.iconst_lanes(ity, 127);
    let biased = kb.b.ins().iadd(bits, bias);
    let shift = kb.b.ins().iconst(cranelift_codegen::ir::types::I32, 23);
    let pow2 = kb.b.ins().ishl(biased, shift);
    let pow2 = kb.bitcast(ty, pow2);
    kb.b.ins().fmul(y, pow2)
}

/// `x · sigmoid(x) = x / (1 + e^-x)` lane-wise.
pub(crate) fn silu(kb: &mut KernelBuilder, x: Value) -> Value {
    let ty = kb.b.func.dfg.value_type(x);
    let neg = kb.b.ins().fneg(x);
    let e = exp(kb, neg);
    let one = kb.fconst(ty, 1.0);
    let d = kb.b.ins().fadd(one, e);
    kb.b.ins().fdiv(x, d)
}

/// `x · sigmoid(s·(x + c·x³))` (the tanh GELU; `s`, `c` from the kernel IR's constants), lane-wise.
pub(crate) fn gelu_tanh(kb: &mut KernelBuilder, x: Value) -> Value {
    let ty = kb.b.func.dfg.value_type(x);
    let x2 = kb.b.ins().fmul(x, x);
    let c = kb.fconst(ty, maxc_schema::GELU_TANH_CUBIC);
    let cx2 = kb.b.ins().fmul(c, x2);
    let one = kb.fconst(ty, 1.0);
    let inner = kb.b.ins().fadd(one, cx2);
    let u = kb.b.ins().fmul(x, inner);
    let s = kb.fconst(ty, -maxc_schema::GELU_TANH_SLOPE);
    let arg = kb.b.ins().fmul(s, u);
    let e = exp(kb, arg);
    let d = kb.b.ins().fadd(one, e);
    kb.b.ins().fdiv(x, d)
}

#[cfg(test)]
mod tests {
    use super::super::{compile_function, CpuTarget};
    use maxc_runtime::cpu::code::ExecutableCode;

    /// Runs `f` (an f32 → f32 function in IR) over `xs` with the f32x4 path and scalar tail.
    fn run_unary(
        f: fn(
            &mut super::KernelBuilder,
            cranelift_codegen::ir::Value,
        ) -> cranelift_codegen::ir::Value,
        xs: &[f32],
    ) -> Option<Vec<f32>> {
        let target = CpuTarget::host_baseline()?;
        if !target.host_supports() {
            return None;
        }
        let n = xs.len() as u64;
        let code = compile_function("unary_test", &target, |kb| {
            let x = kb.buf(0);
            let out = kb.buf(1);
            kb.map_cols(n, |kb, ty, c| {
                let v = kb.load_f32(ty, x, c);
                let e = f(kb, v);
                kb.store_f32(e, out, c);
            });
            Ok(())
        })
        .expect("test kernel compiles");
        let exe = ExecutableCode::new(&code).expect("executable memory");
        let mut input = xs.to_vec();
        let mut out = vec![0f32; xs.len()];
        let bufs = [input.as_mut_ptr() as *mut u8, out.as_mut_ptr() as *mut u8];
        let dims = [0u64; 4];
        // SAFETY: the code was compiled for this machine with the kernel signature; the
        // buffers hold `n` f32 each.
        unsafe { exe.kernel(0)(bufs.as_ptr(), dims.as_ptr(), 0, 1) };
        Some(out)
    }

    #[test]
    fn exp_relative_error_is_below_2e_7() {
        let n = 400_003;
        let xs: Vec<f32> = (0..n)
            .map(|i| -87.3 + (88.36 + 87.3) * i as f32 / (n - 1) as f32)
            .chain([0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 0.5, 88.0])
            .collect();
        let Some(out) = run_unary(super::exp, &xs) else {
            return;
        };
        let mut worst = (0f64, 0f32);
        for (&x, &y) in xs.iter().zip(&out) {
            let want = f64::from(x).exp();
            let rel = ((f64::from(y) - want) / want).abs();
            if rel > worst.0 {
                worst = (rel, x);
            }
        }
        eprintln!("exp: max relative error {:.3e} at x = {}", worst.0, worst.1);
        assert!(worst.0 < 2e-7, "exp max relative error {:?}", worst);
    }

    #[test]
    fn exp_saturates_outside_the_range() {
        let xs = [
            -1000.0f32,
            -88.0,
            89.0,
            1000.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
        ];
        let Some(out) = run_unary(super::exp, &xs) else {
            return;
        };
        for (&x, &y) in xs.iter().zip(&out) {
            if x < 0.0 {
                assert!((0.0..2e-38).contains(&y), "exp({x}) = {y}");
            } else {
                assert!(y > 1e38 && y.is_finite(), "exp({x}) = {y}");
            }
        }
        let nan = run_unary(super::exp, &[f32::NAN; 5]).expect("ran above");
        assert!(nan.iter().all(|v| v.is_nan()));
    }
}
