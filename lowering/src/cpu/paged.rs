//! The step's sequence bookkeeping and the paged KV cache: token positions, the sequence of a
//! token row, cache addressing, and the KV store kernel.

use super::builder::{check_product, check_size, KernelBuilder, MEM};
use super::CpuError;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::I64;
use cranelift_codegen::ir::{BlockArg, InstBuilder, Value};
use maxc_schema::{KernelBody, KvView, StepDim};

/// The checked view of the paged cache of a KV store or attention kernel `kind`'s `body`: the
/// contract's checks ([`KvView::check`]), then this backend's size limits.
pub(crate) fn cache_view(kind: &'static str, body: &KernelBody) -> Result<KvView, CpuError> {
    let view = KvView::of(body).map_err(|what| CpuError::Invalid { kind, what })?;
    for (field, v) in [
        ("num_layers", view.num_layers),
        ("kv_heads", view.kv_heads),
        ("head_dim", view.head_dim),
        ("page_size", view.page_size),
    ] {
        check_size(kind, field, v)?;
    }
    check_product(
        kind,
        "bytes per cache page (num_layers × planes × page_size × kv_heads × head_dim × 4)",
        &[&view.page_shape()[..], &[4]].concat(),
    )?;
    Ok(view)
}

/// The Cranelift address arithmetic of a view of the paged cache.
pub(crate) trait CacheAddr {
    /// Address of the keys (`which = 0`) or values (`which = 1`) of this layer in `page`.
    fn block(&self, kb: &mut KernelBuilder, cache: Value, page: Value, which: u64) -> Value;
    /// Address of `slot` in a key or value block.
    fn slot(&self, kb: &mut KernelBuilder, block: Value, slot: Value) -> Value;
    /// `(p / page_size, p % page_size)` for a non-negative position `p`.
    fn page_and_slot(&self, kb: &mut KernelBuilder, p: Value) -> (Value, Value);
}

impl CacheAddr for KvView {
    fn block(&self, kb: &mut KernelBuilder, cache: Value, page: Value, which: u64) -> Value {
        let page_base = kb.addr(cache, page, self.page_elems() * 4);
        kb.offset(page_base, self.block_offset(which) * 4)
    }

    fn slot(&self, kb: &mut KernelBuilder, block: Value, slot: Value) -> Value {
        kb.addr(block, slot, self.slot_elems() * 4)
    }

    fn page_and_slot(&self, kb: &mut KernelBuilder, p: Value) -> (Value, Value) {
        let ps = self.page_size;
        if ps.is_power_of_two() {
            let page = kb.b.ins().ushr_imm_u(p, i64::from(ps.trailing_zeros()));
            let slot = kb.b.ins().band_imm_u(p, (ps - 1) as i64);
            (page, slot)
        } else {
            let ps = kb.i64c(ps);
            let page = kb.b.ins().udiv(p, ps);
            let slot = kb.b.ins().urem(p, ps);
            (page, slot)
        }
    }
}

/// The step's sequence pointers: `input_row_offsets`, `cache_lengths` and `kv_lookup_table`.
pub(crate) struct Sequences {
    /// `input_row_offsets i32 [B+1]`.
    pub offsets: Value,
    /// `cache_lengths i32 [B]`.
    pub cache_lengths: Value,
    /// `kv_lookup_table i32 [B, P]`.
    pub lookup: Value,
}

impl Sequences {
    /// The sequence `b` holding token row `r` and the row's position
    /// `p = cache_lengths[b] + r - input_row_offsets[b]` (both i64). `b` is the last
    /// sequence whose first row is at most `r`, so sequences without rows are skipped.
    pub fn locate(&self, kb: &mut KernelBuilder, r: Value) -> (Value, Value) {
        let batch = kb.dim(StepDim::BatchSize);
        let header = kb.b.create_block();
        let check = kb.b.create_block();
        let exit = kb.b.create_block();
        let b = kb.b.append_block_param(header, I64);
        let found = kb.b.append_block_param(exit, I64);
        let zero = kb.i64c(0);
        kb.b.ins().jump(header, &[BlockArg::Value(zero)]);

        kb.b.switch_to_block(header);
        let next = kb.b.ins().iadd_imm_s(b, 1);
        let more = kb.b.ins().icmp(IntCC::SignedLessThan, next, batch);
        kb.b.ins()
            .brif(more, check, &[], exit, &[BlockArg::Value(b)]);
        kb.b.switch_to_block(check);
        kb.b.seal_block(check);
        let next_start = kb.load_i32(self.offsets, next);
        let inside = kb.b.ins().icmp(IntCC::SignedLessThanOrEqual, next_start, r);
        kb.b.ins().brif(
            inside,
            header,
            &[BlockArg::Value(next)],
            exit,
            &[BlockArg::Value(b)],
        );
        kb.b.seal_block(header);
        kb.b.switch_to_block(exit);
        kb.b.seal_block(exit);

        let first = kb.load_i32(self.offsets, found);
        let cached = kb.load_i32(self.cache_lengths, found);
        let rel = kb.b.ins().isub(r, first);
        let p = kb.b.ins().iadd(cached, rel);
        (found, p)
    }

    /// `kv_lookup_table[b, page]`: the cache page holding page `page` of sequence `b`.
    pub fn page(&self, kb: &mut KernelBuilder, b: Value, page: Value) -> Value {
        let max_pages = kb.dim(StepDim::MaxNumPages);
        let row = kb.b.ins().imul(b, max_pages);
        let i = kb.b.ins().iadd(row, page);
        kb.load_i32(self.lookup, i)
    }
}

/// Emits [`maxc_schema::KernelBody::Positions`]: for each sequence `b` of this
/// call's slice, `out[r] = cache_lengths[b] + r - input_row_offsets[b]` for its rows.
pub(crate) fn emit_positions(kb: &mut KernelBuilder) {
    let offsets = kb.buf(0);
    let cache_lengths = kb.buf(1);
    let out = kb.buf(2);
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, b| {
        let lo = kb.load_i32(offsets, b);
        let next = kb.b.ins().iadd_imm_s(b, 1);
        let hi = kb.load_i32(offsets, next);
        let cached = kb.load_i32(cache_lengths, b);
        let base = kb.b.ins().isub(cached, lo);
        kb.for_range(lo, hi, 1, |kb, r| {
            let p = kb.b.ins().iadd(base, r);
            let addr = kb.addr(out, r, 8);
            kb.b.ins().store(MEM, p, addr, 0);
        });
    });
}

/// Emits [`maxc_schema::KernelBody::KvStore`]: copies each row's keys and values (or its
/// latent, with one plane; all KV heads, f32x4 copies) into its page and slot of the cache.
pub(crate) fn emit_kv_store(kb: &mut KernelBuilder, cache: &KvView) -> Result<(), CpuError> {
    let planes = cache.planes as usize;
    let srcs: Vec<Value> = (0..planes).map(|i| kb.buf(i)).collect();
    let cache_ptr = kb.buf(planes);
    let seqs = Sequences {
        lookup: kb.buf(planes + 1),
        cache_lengths: kb.buf(planes + 2),
        offsets: kb.buf(planes + 3),
    };
    let floats = cache.slot_elems();
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let (b, p) = seqs.locate(kb, r);
        let (page_index, slot) = cache.page_and_slot(kb, p);
        let page = seqs.page(kb, b, page_index);
        for (which, &src) in srcs.iter().enumerate() {
            let which = which as u64;
            let block = cache.block(kb, cache_ptr, page, which);
            let dst = cache.slot(kb, block, slot);
            let src_row = kb.addr(src, r, floats * 4);
            kb.map_cols(floats, |kb, ty, c| {
                let x = kb.load_f32(ty, src_row, c);
                kb.store_f32(x, dst, c);
            });
        }
    });
    Ok(())
}
