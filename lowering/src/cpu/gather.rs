//! Row gathers: embedding lookup by token id, and the last row of each sequence.

use super::builder::{check_size, KernelBuilder};
use super::dtype::{self, FloatType};
use super::CpuError;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{InstBuilder, Value};
use maxc_schema::{DType, GatherIndex};

/// Emits [`maxc_schema::KernelBody::Gather`]: for each output row `i` of this call's
/// slice, copies (and widens to f32) the chosen source row with f32x4 stores; a sequence
/// without rows gets a zero row.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    cols: u64,
    index: GatherIndex,
    src_dtype: DType,
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
                copy_row(kb, ft, cols, src, token, out_row);
            }
            GatherIndex::LastRows => {
                let lo = kb.load_i32(idx, i);
                let next = kb.b.ins().iadd_imm_s(i, 1);
                let hi = kb.load_i32(idx, next);
                let has_rows = kb.b.ins().icmp(IntCC::SignedGreaterThan, hi, lo);
                kb.if_else(
                    has_rows,
                    |kb| {
                        let last = kb.b.ins().iadd_imm_s(hi, -1);
                        copy_row(kb, ft, cols, src, last, out_row);
                    },
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

/// Copies source row `row` (stored as `ft`) to `out_row` as f32.
fn copy_row(
    kb: &mut KernelBuilder,
    ft: FloatType,
    cols: u64,
    src: Value,
    row: Value,
    out_row: Value,
) {
    let src_row = kb.addr(src, row, cols * ft.size());
    kb.map_cols(cols, |kb, ty, c| {
        let v = dtype::load(kb, ty, ft, src_row, c);
        kb.store_f32(v, out_row, c);
    });
}
