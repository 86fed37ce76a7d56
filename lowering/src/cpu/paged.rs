//! The step's sequence bookkeeping and the paged KV cache: token positions, the sequence of a
//! token row, cache addressing, and the KV store kernel.

use super::builder::{check_product, check_size, KernelBuilder, MEM};
use super::dtype::{self, FloatType};
use super::CpuError;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I32, I32X4, I64, I8X16};
use cranelift_codegen::ir::{BlockArg, Endianness, InstBuilder, MemFlagsData, Type, Value};
use maxc_schema::{KernelBody, KvDtype, KvView, StepDim};

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
        &[&view.page_rows()[..], &[view.head_dim, 4]].concat(),
    )?;
    Ok(view)
}

/// The Cranelift address arithmetic of a view of the paged cache.
pub(crate) trait CacheAddr {
    /// Address of the keys (`which = 0`) or values (`which = 1`) of this layer in `page`.
    fn block(&self, kb: &mut KernelBuilder, cache: Value, page: Value, which: u64) -> Value;
    /// Address of KV head `kvh`'s rows in a key or value block.
    fn head(&self, kb: &mut KernelBuilder, block: Value, kvh: Value) -> Value;
    /// Address of `slot`'s row in a KV head's rows.
    fn slot(&self, kb: &mut KernelBuilder, head: Value, slot: Value) -> Value;
    /// `(p / page_size, p % page_size)` for a non-negative position `p`.
    fn page_and_slot(&self, kb: &mut KernelBuilder, p: Value) -> (Value, Value);
}

impl CacheAddr for KvView {
    fn block(&self, kb: &mut KernelBuilder, cache: Value, page: Value, which: u64) -> Value {
        let page_base = kb.addr(cache, page, self.page_bytes());
        kb.offset(page_base, self.block_offset(which))
    }

    fn head(&self, kb: &mut KernelBuilder, block: Value, kvh: Value) -> Value {
        kb.addr(block, kvh, self.head_stride())
    }

    fn slot(&self, kb: &mut KernelBuilder, head: Value, slot: Value) -> Value {
        kb.addr(head, slot, self.pos_stride())
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

/// Element `c` (i64; a multiple of 4 for a vector `ty`) of the cached row at `row`, stored in
/// `view`'s dtype, widened to `ty` (f32 or f32x4).
pub(crate) fn load_cached(
    kb: &mut KernelBuilder,
    view: &KvView,
    ty: Type,
    row: Value,
    c: Value,
) -> Value {
    match view.dtype {
        KvDtype::F32 => kb.load_f32(ty, row, c),
        KvDtype::F16 => dtype::load(kb, ty, FloatType::F16, row, c),
        KvDtype::Bf16 => dtype::load(kb, ty, FloatType::Bf16, row, c),
        KvDtype::Q8_0 => {
            let addr = kb.b.ins().iadd(row, c);
            let q = if ty.is_vector() {
                // Four i8 as one i32, widened lane by lane.
                let w = kb.b.ins().load(I32, MEM, addr, 0);
                let v = kb.b.ins().scalar_to_vector(I32X4, w);
                let little = MemFlagsData::new().with_endianness(Endianness::Little);
                let v = kb.b.ins().bitcast(I8X16, little, v);
                let v = kb.b.ins().swiden_low(v);
                let v = kb.b.ins().swiden_low(v);
                debug_assert_eq!(kb.b.func.dfg.value_type(v), I32X4);
                kb.b.ins().fcvt_from_sint(F32X4, v)
            } else {
                let q = kb.b.ins().sload8(I32, MEM, addr, 0);
                kb.b.ins().fcvt_from_sint(F32, q)
            };
            // The row's scales follow its head_dim integers; lanes of a vector share one.
            let block = kb.b.ins().ushr_imm_u(c, 5);
            let scales = kb.offset(row, view.head_dim);
            let d = kb.load_f32(F32, scales, block);
            let d = if ty.is_vector() {
                kb.b.ins().splat(F32X4, d)
            } else {
                d
            };
            kb.b.ins().fmul(q, d)
        }
    }
}

/// The IEEE binary16 bits (in an i32) of the f32 `x`, rounded to nearest even as
/// [`KvDtype::round_row`] (the `half` crate) rounds: normals rebiased with the round bit
/// added, magnitudes from 65520 on infinite, those below 2^-14 subnormal (`|x|·2^24` rounded
/// to an integer, exact in f32), NaN quiet with its payload's top bits.
fn f16_bits(kb: &mut KernelBuilder, x: Value) -> Value {
    let bits = kb.bitcast(I32, x);
    let sign = kb.b.ins().ushr_imm_u(bits, 16);
    let sign = kb.b.ins().band_imm_u(sign, 0x8000);
    let abs = kb.b.ins().band_imm_u(bits, 0x7fff_ffff);
    // Normal: the exponent rebiased from 127 to 15, then the low 13 bits rounded away.
    let t = kb.b.ins().iadd_imm_s(abs, -(112 << 23));
    let lsb = kb.b.ins().ushr_imm_u(t, 13);
    let lsb = kb.b.ins().band_imm_u(lsb, 1);
    let bias = kb.b.ins().iadd_imm_s(lsb, 0xfff);
    let r = kb.b.ins().iadd(t, bias);
    let normal = kb.b.ins().ushr_imm_u(r, 13);
    let inf = kb.b.ins().iconst(I32, 0x7c00);
    let normal = kb.b.ins().umin(normal, inf);
    // Subnormal (and zero): |x| in units of 2^-24, to nearest even.
    let ax = kb.b.ins().fabs(x);
    let scale = kb.fconst(F32, f32::from_bits((127 + 24) << 23));
    let m = kb.b.ins().fmul(ax, scale);
    let m = kb.b.ins().nearest(m);
    let sub = kb.b.ins().fcvt_to_uint_sat(I32, m);
    let is_sub =
        kb.b.ins()
            .icmp_imm_u(IntCC::UnsignedLessThan, abs, 0x3880_0000);
    let h = kb.b.ins().select(is_sub, sub, normal);
    // NaN: quiet, the top ten bits of its payload kept.
    let payload = kb.b.ins().band_imm_u(bits, 0x7f_ffff);
    let payload = kb.b.ins().ushr_imm_u(payload, 13);
    let nan = kb.b.ins().bor_imm_u(payload, 0x7e00);
    let is_nan =
        kb.b.ins()
            .icmp_imm_u(IntCC::UnsignedGreaterThan, abs, 0x7f80_0000);
    let h = kb.b.ins().select(is_nan, nan, h);
    kb.b.ins().bor(h, sign)
}

/// The bf16 bits of f32 `x` (an I32 whose low 16 bits are stored): rounded to nearest even,
/// NaN kept NaN (quiet).
fn bf16_bits(kb: &mut KernelBuilder, x: Value) -> Value {
    let bits = kb.bitcast(I32, x);
    let lsb = kb.b.ins().ushr_imm_u(bits, 16);
    let lsb = kb.b.ins().band_imm_u(lsb, 1);
    let bias = kb.b.ins().iadd_imm_s(lsb, 0x7fff);
    let rounded = kb.b.ins().iadd(bits, bias);
    let rounded = kb.b.ins().ushr_imm_u(rounded, 16);
    // NaN stays NaN (quiet): its upper half with the quiet bit set.
    let upper = kb.b.ins().ushr_imm_u(bits, 16);
    let quiet = kb.b.ins().bor_imm_u(upper, 0x40);
    let nan = kb.b.ins().fcmp(FloatCC::Unordered, x, x);
    kb.b.ins().select(nan, quiet, rounded)
}

/// Stores the `head_dim` f32 values at `src` as one cached row at `dst` in `view`'s dtype,
/// rounded as [`KvDtype::round_row`] says (bf16: to nearest even; q8_0: per 32 values
/// `d = max|x| / 127`, `q = x / d` to nearest even, 0 where `d` is 0).
fn store_row(kb: &mut KernelBuilder, view: &KvView, src: Value, dst: Value) {
    let hd = view.head_dim;
    match view.dtype {
        KvDtype::F32 => kb.map_cols(hd, |kb, ty, c| {
            let x = kb.load_f32(ty, src, c);
            kb.store_f32(x, dst, c);
        }),
        KvDtype::F16 | KvDtype::Bf16 => {
            let (lo, hi) = (kb.i64c(0), kb.i64c(hd));
            kb.for_range(lo, hi, 1, |kb, c| {
                let x = kb.load_f32(F32, src, c);
                let h = if view.dtype == KvDtype::F16 {
                    f16_bits(kb, x)
                } else {
                    bf16_bits(kb, x)
                };
                let addr = kb.addr(dst, c, 2);
                kb.b.ins().istore16(MEM, h, addr, 0);
            });
        }
        KvDtype::Q8_0 => {
            let n = KvDtype::Q8_BLOCK;
            let (lo, hi) = (kb.i64c(0), kb.i64c(hd / n));
            kb.for_range(lo, hi, 1, |kb, j| {
                let first = kb.b.ins().imul_imm_s(j, n as i64);
                let block = kb.addr(src, first, 4);
                let zero = kb.fconst(F32, 0.0);
                let amax = kb.var(F32, zero);
                let (lo, hi) = (kb.i64c(0), kb.i64c(n));
                kb.for_range(lo, hi, 1, |kb, i| {
                    let x = kb.load_f32(F32, block, i);
                    let a = kb.b.ins().fabs(x);
                    let m = kb.get(amax);
                    let m = kb.max(m, a);
                    kb.set(amax, m);
                });
                let amax = kb.get(amax);
                let c127 = kb.fconst(F32, 127.0);
                let d = kb.b.ins().fdiv(amax, c127);
                let zero = kb.fconst(F32, 0.0);
                let is_zero = kb.b.ins().fcmp(FloatCC::Equal, d, zero);
                let q_block = kb.b.ins().iadd(dst, first);
                kb.for_range(lo, hi, 1, |kb, i| {
                    let x = kb.load_f32(F32, block, i);
                    let r = kb.b.ins().fdiv(x, d);
                    let r = kb.b.ins().nearest(r);
                    let r = kb.b.ins().select(is_zero, zero, r);
                    let q = kb.b.ins().fcvt_to_sint_sat(I32, r);
                    let addr = kb.b.ins().iadd(q_block, i);
                    kb.b.ins().istore8(MEM, q, addr, 0);
                });
                let scales = kb.offset(dst, hd);
                kb.store_f32(d, scales, j);
            });
        }
    }
}

/// Emits [`maxc_schema::KernelBody::KvStore`]: writes each row's keys and values (or its
/// latent, with one plane; every KV head) into its page and slot of the cache, in the
/// cache's dtype.
pub(crate) fn emit_kv_store(kb: &mut KernelBuilder, cache: &KvView) -> Result<(), CpuError> {
    let planes = cache.planes as usize;
    let srcs: Vec<Value> = (0..planes).map(|i| kb.buf(i)).collect();
    let cache_ptr = kb.buf(planes);
    let seqs = Sequences {
        lookup: kb.buf(planes + 1),
        cache_lengths: kb.buf(planes + 2),
        offsets: kb.buf(planes + 3),
    };
    let floats = cache.kv_heads * cache.head_dim;
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let (b, p) = seqs.locate(kb, r);
        let (page_index, slot) = cache.page_and_slot(kb, p);
        let page = seqs.page(kb, b, page_index);
        for (which, &src) in srcs.iter().enumerate() {
            let which = which as u64;
            let block = cache.block(kb, cache_ptr, page, which);
            let src_row = kb.addr(src, r, floats * 4);
            // Each KV head's row goes to its own run of the page (head-major).
            let (lo, hi) = (kb.i64c(0), kb.i64c(cache.kv_heads));
            kb.for_range(lo, hi, 1, |kb, h| {
                let src_head = kb.addr(src_row, h, cache.head_dim * 4);
                let head = cache.head(kb, block, h);
                let dst_head = cache.slot(kb, head, slot);
                store_row(kb, cache, src_head, dst_head);
            });
        }
    });
    Ok(())
}
