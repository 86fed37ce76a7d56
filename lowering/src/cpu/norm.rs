//! RMSNorm, optionally fused with the residual add before it.

use super::builder::{check_size, KernelBuilder};
use super::columns::Reduce;
use super::dtype::{self, FloatType};
use super::CpuError;
use cranelift_codegen::ir::types::{F32, F32X4};
use cranelift_codegen::ir::{InstBuilder, Value};
use maxc_schema::DType;

/// Emits [`maxc_schema::KernelBody::RmsNorm`]. Per `width` values of a row (the row, or one
/// head): one pass that (with `residual`) writes `sum = a + b` and accumulates squares in four
/// f32x4 accumulators, then `inv = 1 / sqrt(Σx²/width + eps)` and a pass writing
/// `out = x · inv · w`. Rows `start..end` of `cols` are rows `start·g..end·g` of `width`
/// (`g = cols / width`), so one loop serves both.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    (cols, width): (u64, u64),
    weight_offset: f32,
    eps: f32,
    residual: bool,
    weight_dtype: DType,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let row_cols = check_size(kind, "cols", cols)?;
    let cols = check_size(kind, "width", width)?;
    if row_cols % cols != 0 {
        return Err(CpuError::Invalid {
            kind,
            what: format!("`width` {width} does not divide `cols` {row_cols}"),
        });
    }
    let groups = row_cols / cols;
    let wt = FloatType::of(kind, "weight_dtype", weight_dtype)?;
    // `x` is the normalised row: the input, or the written residual sum.
    let (a, b, w, x, out) = if residual {
        let a = kb.buf(0);
        let b = kb.buf(1);
        let w = kb.buf(2);
        let sum = kb.buf(3);
        (Some(a), Some(b), w, sum, kb.buf(4))
    } else {
        let x = kb.buf(0);
        (None, None, kb.buf(1), x, kb.buf(2))
    };
    let row_bytes = cols * 4;
    let (start, end) = (kb.start(), kb.end());
    let (start, end) = if groups == 1 {
        (start, end)
    } else {
        let g = groups as i64;
        (
            kb.b.ins().imul_imm_s(start, g),
            kb.b.ins().imul_imm_s(end, g),
        )
    };
    kb.for_range(start, end, 1, |kb, r| {
        let x_row = kb.addr(x, r, row_bytes);
        let out_row = kb.addr(out, r, row_bytes);
        let rows_ab: Option<(Value, Value)> = a.zip(b).map(|(a, b)| {
            let a_row = kb.addr(a, r, row_bytes);
            let b_row = kb.addr(b, r, row_bytes);
            (a_row, b_row)
        });
        let sumsq = kb.reduce_cols(cols, Reduce::Add, 0.0, |kb, ty, c| {
            let v = match rows_ab {
                Some((a_row, b_row)) => {
                    let av = kb.load_f32(ty, a_row, c);
                    let bv = kb.load_f32(ty, b_row, c);
                    let s = kb.b.ins().fadd(av, bv);
                    kb.store_f32(s, x_row, c);
                    s
                }
                None => kb.load_f32(ty, x_row, c),
            };
            kb.b.ins().fmul(v, v)
        });
        let n = kb.fconst(F32, cols as f32);
        let mean = kb.b.ins().fdiv(sumsq, n);
        let eps = kb.fconst(F32, eps);
        let var = kb.b.ins().fadd(mean, eps);
        let rms = kb.b.ins().sqrt(var);
        let one = kb.fconst(F32, 1.0);
        let inv = kb.b.ins().fdiv(one, rms);
        let inv_v = kb.b.ins().splat(F32X4, inv);
        kb.map_cols(cols, |kb, ty, c| {
            let v = kb.load_f32(ty, x_row, c);
            let wv = dtype::load(kb, ty, wt, w, c);
            let wv = if weight_offset == 0.0 {
                wv
            } else {
                let o = kb.fconst(ty, weight_offset);
                kb.b.ins().fadd(wv, o)
            };
            let inv = if ty.is_vector() { inv_v } else { inv };
            let v = kb.b.ins().fmul(v, inv);
            let v = kb.b.ins().fmul(v, wv);
            kb.store_f32(v, out_row, c);
        });
    });
    Ok(())
}
