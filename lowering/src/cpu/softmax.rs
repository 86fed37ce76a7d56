//! Row softmax.

use super::builder::{check_size, KernelBuilder};
use super::columns::Reduce;
use super::math;
use super::CpuError;
use cranelift_codegen::ir::types::F32X4;
use cranelift_codegen::ir::InstBuilder;

/// Emits [`maxc_schema::KernelBody::Softmax`]. Per row, three passes: the maximum
/// (four f32x4 max accumulators), `e = exp(x - max)` written to `out` while summing (four
/// f32x4 sum accumulators), then `out = e / sum`.
pub(crate) fn emit(kb: &mut KernelBuilder, cols: u64) -> Result<(), CpuError> {
    let cols = check_size(kb.kind(), "cols", cols)?;
    let x = kb.buf(0);
    let out = kb.buf(1);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let x_row = kb.addr(x, r, cols * 4);
        let out_row = kb.addr(out, r, cols * 4);
        let max = kb.reduce_cols(cols, Reduce::Max, f32::NEG_INFINITY, |kb, ty, c| {
            kb.load_f32(ty, x_row, c)
        });
        let max_v = kb.b.ins().splat(F32X4, max);
        let sum = kb.reduce_cols(cols, Reduce::Add, 0.0, |kb, ty, c| {
            let v = kb.load_f32(ty, x_row, c);
            let m = if ty.is_vector() { max_v } else { max };
            let d = kb.b.ins().fsub(v, m);
            let e = math::exp(kb, d);
            kb.store_f32(e, out_row, c);
            e
        });
        let sum_v = kb.b.ins().splat(F32X4, sum);
        kb.map_cols(cols, |kb, ty, c| {
            let e = kb.load_f32(ty, out_row, c);
            let s = if ty.is_vector() { sum_v } else { sum };
            let v = kb.b.ins().fdiv(e, s);
            kb.store_f32(v, out_row, c);
        });
    });
    Ok(())
}
