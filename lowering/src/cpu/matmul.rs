//! Matrix multiplication by a transposed weight: `out = x · wᵀ (+ bias)`.

use super::builder::{check_size, KernelBuilder, MEM};
use super::columns::Reduce;
use super::dtype::{self, FloatType};
use super::CpuError;
use cranelift_codegen::ir::types::F32;
use cranelift_codegen::ir::InstBuilder;
use maxc_schema::{DType, Rows};

/// Emits [`maxc_schema::KernelBody::Matmul`]: for each output column `j` of this
/// call's slice and every row `r`, `out[r, j] = Σ_k x[r, k] · w[j, k] (+ bias[j])` with four
/// f32x4 accumulators over `k` (weights widened from `weight_dtype` on load).
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    rows: Rows,
    n: u64,
    k: u64,
    weight_dtype: DType,
    bias: bool,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let n = check_size(kind, "n", n)?;
    let k = check_size(kind, "k", k)?;
    let wt = FloatType::of(kind, "weight_dtype", weight_dtype)?;
    let x = kb.buf(0);
    let w = kb.buf(1);
    let bias = bias.then(|| kb.buf(2));
    let out = kb.buf(if bias.is_some() { 3 } else { 2 });
    let rows = kb.rows(rows);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, j| {
        let w_row = kb.addr(w, j, k * wt.size());
        let b = bias.map(|bias| dtype::load(kb, F32, wt, bias, j));
        let out_col = kb.addr(out, j, 4);
        let zero = kb.i64c(0);
        kb.for_range(zero, rows, 1, |kb, r| {
            let x_row = kb.addr(x, r, k * 4);
            let dot = kb.reduce_cols(k, Reduce::Add, 0.0, |kb, ty, c| {
                let xv = kb.load_f32(ty, x_row, c);
                let wv = dtype::load(kb, ty, wt, w_row, c);
                kb.b.ins().fmul(xv, wv)
            });
            let v = match b {
                Some(b) => kb.b.ins().fadd(dot, b),
                None => dot,
            };
            let dst = kb.addr(out_col, r, n * 4);
            kb.b.ins().store(MEM, v, dst, 0);
        });
    });
    Ok(())
}
