//! Row gathers: embedding lookup by token id, and the rows a step returns logits for.

use super::builder::{check_size, KernelBuilder};
use super::dtype::{self, FloatType};
use super::CpuError;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{InstBuilder, Value};
use maxc_schema::{DType, GatherIndex};

/// Emits [`maxc_schema::KernelBody::Gather`]: for each output row `i` of this call's
/// slice, copies (and widens to f32, times `scale` where that is not 1) the chosen source row
/// with f32x4 stores; a logit row of index -1 gets zeros.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    cols: u64,
    index: GatherIndex,
    src_dtype: DType,
    scale: f32,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let cols = check_size(kind, "cols", cols)?;
    let ft = FloatType::of(kind, "src_dtype", src_dtype)?;
    let src = kb.buf(0);
    let idx = kb.buf(1);
    let out = kb.buf(2);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, i| {
        let out_row = kb.addr(out, i, cols * 4);
        match index {
            GatherIndex::Tokens => {
                let token = kb.load_i64(idx, i);
                copy_row(kb, (ft, scale), cols, src, token, out_row);
            }
            GatherIndex::LogitRows => {
                // The step check holds every index in -1..total_seq_len; -1 gives zeros.
                let row = kb.load_i32(idx, i);
                let has_row =
                    kb.b.ins()
                        .icmp_imm_s(IntCC::SignedGreaterThanOrEqual, row, 0);
                kb.if_else(
                    has_row,
                    |kb| copy_row(kb, (ft, scale), cols, src, row, out_row),
                    |kb| {
                        kb.map_cols(cols, |kb, ty, c| {
                            let zero = kb.fconst(ty, 0.0);
                            kb.store_f32(zero, out_row, c);
                        })
                    },
                );
            }
        }
    });
    Ok(())
}

/// Copies source row `row` (stored as `ft`) to `out_row` as f32, times `scale`.
fn copy_row(
    kb: &mut KernelBuilder,
    (ft, scale): (FloatType, f32),
    cols: u64,
    src: Value,
    row: Value,
    out_row: Value,
) {
    let src_row = kb.addr(src, row, cols * ft.size());
    kb.map_cols(cols, |kb, ty, c| {
        let v = dtype::load(kb, ty, ft, src_row, c);
        let v = if scale == 1.0 {
            v
        } else {
            let s = kb.fconst(ty, scale);
            kb.b.ins().fmul(v, s)
        };
        kb.store_f32(v, out_row, c);
    });
}
