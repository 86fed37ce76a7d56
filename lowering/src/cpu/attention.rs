//! Causal attention over the paged KV cache with an online (flash-style) softmax.

use super::builder::{check_product, check_size, KernelBuilder};
use super::columns::Reduce;
use super::math;
use super::paged::{load_cached, CacheAddr, Sequences};
use super::CpuError;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::{F32, F32X4, I64};
use cranelift_codegen::ir::{InstBuilder, StackSlotData, StackSlotKind, Value};
use maxc_schema::KvView;

/// Emits [`maxc_schema::KernelBody::Attention`]. For each (row `r`, KV head) of this call's
/// slice: the row's sequence `b` and position `p`; for every query head `h` of the KV head's
/// group (`h / (heads / kv_heads)` is the KV head), a walk over the sequence's pages covering positions `0..=p`
/// keeping a running max `m`, running sum `l` and a `head_dim` f32 accumulator in a stack
/// slot: per position, `s = (q·k)·scale` (four f32x4 accumulators),
/// `acc = acc·e^(m-m') + e^(s-m')·v`; finally `out = acc / l`. With a sliding `window` the walk
/// covers positions `p + 1 - window ..= p` (from 0 where that is negative), starting at the
/// page that holds the first. The values are `value_dim` wide: the value plane's (two planes),
/// or the key's first `value_dim` elements (one plane: a latent).
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    cache: &KvView,
    heads: u64,
    scale: f32,
    window: Option<u64>,
    value_dim: u64,
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let heads = check_size(kind, "heads", heads)?;
    if heads % cache.kv_heads != 0 {
        return Err(CpuError::Invalid {
            kind,
            what: format!(
                "`heads` is {heads}, expected a multiple of `kv_heads` = {}",
                cache.kv_heads
            ),
        });
    }
    let hd = cache.head_dim;
    check_product(kind, "heads × head_dim × 4", &[heads, hd, 4])?;
    let vd = value_dim;
    let value_ok = match cache.planes {
        2 => vd == hd,
        _ => vd > 0 && vd <= hd,
    };
    if !value_ok {
        return Err(CpuError::Invalid {
            kind,
            what: format!(
                "`value_dim` is {vd} with {} plane(s) of head_dim {hd}",
                cache.planes
            ),
        });
    }
    let group = heads / cache.kv_heads;
    let slot_bytes = u32::try_from(vd * 4).map_err(|_| CpuError::Invalid {
        kind,
        what: format!("`value_dim` is {vd}, too large for the stack accumulator"),
    })?;
    let slot = kb.b.create_sized_stack_slot(StackSlotData::new(
        StackSlotKind::ExplicitSlot,
        slot_bytes,
        4,
    ));

    let q = kb.buf(0);
    let cache_ptr = kb.buf(1);
    let seqs = Sequences {
        lookup: kb.buf(2),
        cache_lengths: kb.buf(3),
        offsets: kb.buf(4),
    };
    let out = kb.buf(5);
    let acc = kb.b.ins().stack_addr(I64, slot, 0);
    if window == Some(0) {
        return Err(CpuError::Invalid {
            kind,
            what: "`window` is 0, expected at least 1".into(),
        });
    }
    let ctx = Context {
        cache,
        seqs: &seqs,
        cache_ptr,
        scale,
        window,
        value_dim: vd,
    };
    let (start, end) = (kb.start(), kb.end());
    // Item `i` of the parallel range is KV head `i % kv_heads` of row `i / kv_heads`, so that a
    // single decode row still splits across threads.
    kb.for_range(start, end, 1, |kb, i| {
        let kv_heads = kb.i64c(cache.kv_heads);
        let r = kb.b.ins().udiv(i, kv_heads);
        let kvh = kb.b.ins().urem(i, kv_heads);
        let (b, p) = seqs.locate(kb, r);
        let q_row = kb.addr(q, r, heads * hd * 4);
        let out_row = kb.addr(out, r, heads * vd * 4);
        let zero = kb.i64c(0);
        let group_v = kb.i64c(group);
        kb.for_range(zero, group_v, 1, |kb, g| {
            let first = kb.b.ins().imul_imm_s(kvh, group as i64);
            let h = kb.b.ins().iadd(first, g);
            let head = Head {
                q: kb.addr(q_row, h, hd * 4),
                out: kb.addr(out_row, h, vd * 4),
                kv_head: kvh,
                acc,
            };
            attend(kb, &ctx, &head, b, p);
        });
    });
    Ok(())
}

/// What every head's attention shares.
struct Context<'c> {
    cache: &'c KvView,
    seqs: &'c Sequences,
    /// The cache buffer.
    cache_ptr: Value,
    /// Score scale.
    scale: f32,
    /// Sliding window, where the layer has one.
    window: Option<u64>,
    /// Elements of a value.
    value_dim: u64,
}

/// Pointers of one query head's work.
struct Head {
    /// `q[r, h, :]`.
    q: Value,
    /// `out[r, h, :]`.
    out: Value,
    /// The KV head it reads (i64).
    kv_head: Value,
    /// The `head_dim` f32 accumulator.
    acc: Value,
}

/// Attention of one query head over positions `0..=p` of sequence `b` (its window's).
fn attend(kb: &mut KernelBuilder, ctx: &Context, head: &Head, b: Value, p: Value) {
    let (cache, seqs, cache_ptr) = (ctx.cache, ctx.seqs, ctx.cache_ptr);
    let hd = cache.head_dim;
    let vd = ctx.value_dim;
    let acc = head.acc;
    kb.map_cols(vd, |kb, ty, c| {
        let zero = kb.fconst(ty, 0.0);
        kb.store_f32(zero, acc, c);
    });
    let neg_inf = kb.fconst(F32, f32::NEG_INFINITY);
    let zero = kb.fconst(F32, 0.0);
    let m = kb.var(F32, neg_inf);
    let l = kb.var(F32, zero);
    let scale = kb.fconst(F32, ctx.scale);

    let positions = kb.b.ins().iadd_imm_s(p, 1);
    let page_size = kb.i64c(cache.page_size);
    let (last_page, _) = cache.page_and_slot(kb, p);
    let pages = kb.b.ins().iadd_imm_s(last_page, 1);
    // The first position seen: `max(p + 1 - window, 0)`.
    let lo = match ctx.window {
        None => kb.i64c(0),
        Some(w) => {
            let lo = kb.b.ins().iadd_imm_s(positions, -(w as i64));
            let zero = kb.i64c(0);
            let neg = kb.b.ins().icmp(IntCC::SignedLessThan, lo, zero);
            kb.b.ins().select(neg, zero, lo)
        }
    };
    let (first_page, _) = cache.page_and_slot(kb, lo);
    kb.for_range(first_page, pages, 1, |kb, pg| {
        let page = seqs.page(kb, b, pg);
        let k_block = cache.block(kb, cache_ptr, page, 0);
        let k_block = cache.head(kb, k_block, head.kv_head);
        let v_block = cache.block(kb, cache_ptr, page, 1);
        let v_block = cache.head(kb, v_block, head.kv_head);
        let first = kb.b.ins().imul(pg, page_size);
        let left = kb.b.ins().isub(positions, first);
        let full = kb.b.ins().icmp(IntCC::SignedGreaterThan, left, page_size);
        let slots = kb.b.ins().select(full, page_size, left);
        // Slots before the window's first position (on its first page only).
        let before = kb.b.ins().isub(lo, first);
        let zero_i = kb.i64c(0);
        let inside = kb.b.ins().icmp(IntCC::SignedGreaterThan, before, zero_i);
        let from = kb.b.ins().select(inside, before, zero_i);
        kb.for_range(from, slots, 1, |kb, s| {
            let k_ptr = cache.slot(kb, k_block, s);
            let v_ptr = cache.slot(kb, v_block, s);
            let dot = kb.reduce_cols(hd, Reduce::Add, 0.0, |kb, ty, c| {
                let qv = kb.load_f32(ty, head.q, c);
                let kv = load_cached(kb, cache, ty, k_ptr, c);
                kb.b.ins().fmul(qv, kv)
            });
            let score = kb.b.ins().fmul(dot, scale);
            let m_old = kb.get(m);
            let m_new = kb.max(m_old, score);
            let d_old = kb.b.ins().fsub(m_old, m_new);
            let corr = math::exp(kb, d_old);
            let d_new = kb.b.ins().fsub(score, m_new);
            let e = math::exp(kb, d_new);
            let l_old = kb.get(l);
            let l_scaled = kb.b.ins().fmul(l_old, corr);
            let l_new = kb.b.ins().fadd(l_scaled, e);
            kb.set(m, m_new);
            kb.set(l, l_new);
            let corr_v = kb.b.ins().splat(F32X4, corr);
            let e_v = kb.b.ins().splat(F32X4, e);
            kb.map_cols(vd, |kb, ty, c| {
                let (corr, e) = if ty.is_vector() {
                    (corr_v, e_v)
                } else {
                    (corr, e)
                };
                let a = kb.load_f32(ty, acc, c);
                let v = load_cached(kb, cache, ty, v_ptr, c);
                let a = kb.b.ins().fmul(a, corr);
                let ev = kb.b.ins().fmul(v, e);
                let a = kb.b.ins().fadd(a, ev);
                kb.store_f32(a, acc, c);
            });
        });
    });
    let l = kb.get(l);
    let l_v = kb.b.ins().splat(F32X4, l);
    kb.map_cols(vd, |kb, ty, c| {
        let a = kb.load_f32(ty, acc, c);
        let l = if ty.is_vector() { l_v } else { l };
        let o = kb.b.ins().fdiv(a, l);
        kb.store_f32(o, head.out, c);
    });
}
