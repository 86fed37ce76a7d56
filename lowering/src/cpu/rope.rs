//! Rotary position embedding (rotate-half layout).

use super::builder::{check_product, check_size, KernelBuilder};
use super::CpuError;
use cranelift_codegen::ir::InstBuilder;

/// Emits [`maxc_schema::KernelBody::Rope`]: per row, looks up its position's cos/sin
/// table row, then for every head rotates the pairs `(x[i], x[i + h])` with f32x4 lanes over
/// `i < h = rotary_dim / 2` (scalar tail for `h % 4`), and copies the head's elements past
/// `rotary_dim`.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    heads: u64,
    head_dim: u64,
    rotary_dim: u64,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let heads = check_size(kind, "heads", heads)?;
    let head_dim = check_size(kind, "head_dim", head_dim)?;
    let rotary_dim = check_size(kind, "rotary_dim", rotary_dim)?;
    if rotary_dim % 2 != 0 || rotary_dim > head_dim {
        return Err(CpuError::Invalid {
            kind,
            what: format!(
                "`rotary_dim` is {rotary_dim}, expected an even number at most `head_dim` ({head_dim})"
            ),
        });
    }
    check_product(kind, "heads × head_dim × 4", &[heads, head_dim, 4])?;
    let half = rotary_dim / 2;
    let x = kb.buf(0);
    let positions = kb.buf(1);
    let table = kb.buf(2);
    let out = kb.buf(3);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let pos = kb.load_i64(positions, r);
        let cos_row = kb.addr(table, pos, rotary_dim * 4);
        let sin_row = kb.offset(cos_row, half * 4);
        let x_row = kb.addr(x, r, heads * head_dim * 4);
        let out_row = kb.addr(out, r, heads * head_dim * 4);
        let zero = kb.i64c(0);
        let heads_v = kb.i64c(heads);
        kb.for_range(zero, heads_v, 1, |kb, h| {
            let x_lo = kb.addr(x_row, h, head_dim * 4);
            let x_hi = kb.offset(x_lo, half * 4);
            let out_lo = kb.addr(out_row, h, head_dim * 4);
            let out_hi = kb.offset(out_lo, half * 4);
            kb.map_cols(half, |kb, ty, i| {
                let x1 = kb.load_f32(ty, x_lo, i);
                let x2 = kb.load_f32(ty, x_hi, i);
                let cos = kb.load_f32(ty, cos_row, i);
                let sin = kb.load_f32(ty, sin_row, i);
                let a = kb.b.ins().fmul(x1, cos);
                let b = kb.b.ins().fmul(x2, sin);
                let lo = kb.b.ins().fsub(a, b);
                let a = kb.b.ins().fmul(x2, cos);
                let b = kb.b.ins().fmul(x1, sin);
                let hi = kb.b.ins().fadd(a, b);
                kb.store_f32(lo, out_lo, i);
                kb.store_f32(hi, out_hi, i);
            });
            if rotary_dim < head_dim {
                let x_pass = kb.offset(x_lo, rotary_dim * 4);
                let out_pass = kb.offset(out_lo, rotary_dim * 4);
                kb.map_cols(head_dim - rotary_dim, |kb, ty, i| {
                    let v = kb.load_f32(ty, x_pass, i);
                    kb.store_f32(v, out_pass, i);
                });
            }
        });
    });
    Ok(())
}
