//! Top-k selection per row (MoE routing).

use super::builder::{check_size, KernelBuilder};
use super::CpuError;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I32, I32X4, I64};
use cranelift_codegen::ir::{ConstantData, InstBuilder, Value};

/// Emits [`maxc_schema::KernelBody::TopK`]. Entries are ranked by value, then by
/// lower index. Per row, `min(k, cols)` scalar argmax passes each find the best entry ranked
/// after the previous pass's pick, which tracks the k-th kept entry `(pv, pi)` and the kept
/// sum without scratch memory; a final f32x4 pass writes `x` (or `x / sum` with
/// `renormalize`) where `x > pv || (x == pv && j <= pi)` and zero elsewhere.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    cols: u64,
    k: u64,
    renormalize: bool,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let cols = check_size(kind, "cols", cols)?;
    if cols > i32::MAX as u64 {
        return Err(CpuError::Invalid {
            kind,
            what: format!("`cols` is {cols}, expected at most {}", i32::MAX),
        });
    }
    let k = k.min(cols);
    let x = kb.buf(0);
    let out = kb.buf(1);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let x_row = kb.addr(x, r, cols * 4);
        let out_row = kb.addr(out, r, cols * 4);
        let inf = kb.fconst(F32, f32::INFINITY);
        let none = kb.b.ins().iconst(I64, -1);
        let zero = kb.fconst(F32, 0.0);
        let prev_v = kb.var(F32, inf);
        let prev_i = kb.var(I64, none);
        let sum = kb.var(F32, zero);
        let lo = kb.i64c(0);
        let passes = kb.i64c(k);
        kb.for_range(lo, passes, 1, |kb, _| {
            let (pv, pi) = (kb.get(prev_v), kb.get(prev_i));
            let (best_v, best_i) = argmax_after(kb, x_row, cols, pv, pi);
            let found =
                kb.b.ins()
                    .icmp_imm_s(IntCC::SignedGreaterThanOrEqual, best_i, 0);
            let v = kb.b.ins().select(found, best_v, pv);
            let i = kb.b.ins().select(found, best_i, pi);
            let s = kb.get(sum);
            let added = kb.b.ins().fadd(s, best_v);
            let s = kb.b.ins().select(found, added, s);
            kb.set(prev_v, v);
            kb.set(prev_i, i);
            kb.set(sum, s);
        });
        let (pv, pi, sum) = (kb.get(prev_v), kb.get(prev_i), kb.get(sum));
        write_kept(kb, x_row, out_row, cols, pv, pi, renormalize.then_some(sum));
    });
    Ok(())
}

/// The best entry `(value, index)` of the row ranked strictly after `(pv, pi)`, i.e. with
/// `x < pv || (x == pv && j > pi)`; index -1 when there is none. Ties go to the lower index.
fn argmax_after(
    kb: &mut KernelBuilder,
    x_row: Value,
    cols: u64,
    pv: Value,
    pi: Value,
) -> (Value, Value) {
    let neg_inf = kb.fconst(F32, f32::NEG_INFINITY);
    let none = kb.b.ins().iconst(I64, -1);
    let best_v = kb.var(F32, neg_inf);
    let best_i = kb.var(I64, none);
    let lo = kb.i64c(0);
    let hi = kb.i64c(cols);
    kb.for_range(lo, hi, 1, |kb, j| {
        let v = kb.load_f32(F32, x_row, j);
        let below = kb.b.ins().fcmp(FloatCC::LessThan, v, pv);
        let same = kb.b.ins().fcmp(FloatCC::Equal, v, pv);
        let later = kb.b.ins().icmp(IntCC::SignedGreaterThan, j, pi);
        let tie_after = kb.b.ins().band(same, later);
        let eligible = kb.b.ins().bor(below, tie_after);
        let (bv, bi) = (kb.get(best_v), kb.get(best_i));
        let first = kb.b.ins().icmp_imm_s(IntCC::SignedLessThan, bi, 0);
        let larger = kb.b.ins().fcmp(FloatCC::GreaterThan, v, bv);
        let better = kb.b.ins().bor(first, larger);
        let take = kb.b.ins().band(eligible, better);
        let nv = kb.b.ins().select(take, v, bv);
        let ni = kb.b.ins().select(take, j, bi);
        kb.set(best_v, nv);
        kb.set(best_i, ni);
    });
    (kb.get(best_v), kb.get(best_i))
}

/// Writes `x` (divided by `sum` when given) where the entry ranks at or before `(pv, pi)`,
/// zero elsewhere.
fn write_kept(
    kb: &mut KernelBuilder,
    x_row: Value,
    out_row: Value,
    cols: u64,
    pv: Value,
    pi: Value,
    sum: Option<Value>,
) {
    let pi32 = kb.b.ins().ireduce(I32, pi);
    let pv_v = kb.b.ins().splat(F32X4, pv);
    let pi_v = kb.b.ins().splat(I32X4, pi32);
    let sum_v = sum.map(|s| kb.b.ins().splat(F32X4, s));
    let lane_bytes: Vec<u8> = (0..4i32).flat_map(|i| i.to_le_bytes()).collect();
    let lane_const =
        kb.b.func
            .dfg
            .constants
            .insert(ConstantData::from(lane_bytes));
    let lane_ids = kb.b.ins().vconst(I32X4, lane_const);
    kb.map_cols(cols, |kb, ty, c| {
        let v = kb.load_f32(ty, x_row, c);
        let c32 = kb.b.ins().ireduce(I32, c);
        let (pv, pi, idx, sum) = if ty.is_vector() {
            let base = kb.b.ins().splat(I32X4, c32);
            let idx = kb.b.ins().iadd(base, lane_ids);
            (pv_v, pi_v, idx, sum_v)
        } else {
            (pv, pi32, c32, sum)
        };
        let above = kb.b.ins().fcmp(FloatCC::GreaterThan, v, pv);
        let same = kb.b.ins().fcmp(FloatCC::Equal, v, pv);
        let not_after = kb.b.ins().icmp(IntCC::SignedLessThanOrEqual, idx, pi);
        let tie = kb.b.ins().band(same, not_after);
        let kept = kb.b.ins().bor(above, tie);
        let val = match sum {
            Some(s) => kb.b.ins().fdiv(v, s),
            None => v,
        };
        let zero = kb.fconst(ty, 0.0);
        let res = kb.pick(kept, val, zero);
        kb.store_f32(res, out_row, c);
    });
}
