//! The init kernels of the `ep_init` program: zeroed state and a rank's experts.

use super::builder::{to_i64, KernelBuilder, MEM};
use super::CpuError;
use cranelift_codegen::ir::types::{I16, I32, I64, I8};
use cranelift_codegen::ir::InstBuilder;
use maxc_schema::DType;

/// [`maxc_schema::KernelBody::Zeros`]: `out[i] = 0` for `i` in `start..end`, one store of the
/// element's width each.
pub(crate) fn emit_zeros(kb: &mut KernelBuilder, dtype: DType) -> Result<(), CpuError> {
    let size = dtype.size() as u64;
    let ty = match size {
        1 => I8,
        2 => I16,
        4 => I32,
        8 => I64,
        _ => {
            return Err(CpuError::Invalid {
                kind: kb.kind(),
                what: format!("zeros of {dtype}, expected a 1-, 2-, 4- or 8-byte type"),
            })
        }
    };
    let out = kb.buf(0);
    let zero = kb.b.ins().iconst(ty, 0);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, i| {
        let addr = kb.addr(out, i, size);
        kb.b.ins().store(MEM, zero, addr, 0);
    });
    Ok(())
}

/// [`maxc_schema::KernelBody::RankExperts`]: `out[i] = rank[0] · experts_per_rank + i`.
pub(crate) fn emit_rank_experts(kb: &mut KernelBuilder, experts_per_rank: u64) {
    let (rank_buf, out) = (kb.buf(0), kb.buf(1));
    let zero = kb.i64c(0);
    let rank = kb.load_i32(rank_buf, zero);
    let first = kb.b.ins().imul_imm_s(rank, to_i64(experts_per_rank));
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, i| {
        let e = kb.b.ins().iadd(first, i);
        let e = kb.b.ins().ireduce(I32, e);
        let addr = kb.addr(out, i, 4);
        kb.b.ins().store(MEM, e, addr, 0);
    });
}
