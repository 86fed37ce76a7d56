//! The step's sequence bookkeeping and the paged KV cache: token positions, the sequence and
//! position of a token row, cache addressing, and the KV store kernel.

use super::source::{self, fill, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, GridExtent, KernelBody, KvDtype, KvView, Rows, StepDim};

/// The checked view of the paged cache of a KV store or attention kernel's `body`: the
/// contract's checks ([`KvView::check`]), then this backend's index range.
pub(crate) fn cache_view(cx: Ctx, body: &KernelBody) -> Result<KvView, CudaError> {
    let view = KvView::of(body).map_err(|what| cx.invalid(what))?;
    cx.product(
        "bytes per cache page (num_layers × planes × page_size × kv_heads × row bytes)",
        &[&view.page_rows()[..], &[view.row_bytes()]].concat(),
    )?;
    Ok(view)
}

/// The C expression (a byte pointer) of KV head 0's row at `slot` in the keys (`which` = 0) or
/// values (1) of the view's layer in cache page `page` (both `maxc_u64` expressions); KV head
/// `h`'s row is `h * head_stride` bytes on ([`KvView::head_stride`], the page head-major). The
/// cache buffer is `kv_cache`, bytes.
pub(crate) fn slot_ptr(cache: &KvView, page: &str, slot: &str, which: u64) -> String {
    format!(
        "kv_cache + {page} * {pb} + {bo} + {slot} * {rb}",
        pb = ull(cache.page_bytes()),
        bo = ull(cache.block_offset(which)),
        rb = ull(cache.pos_stride()),
    )
}

/// The C expression of value `d` of the cached row at the byte pointer `row`, as a float
/// (the view's dtype widened).
pub(crate) fn load_cached(cache: &KvView, row: &str, d: &str) -> String {
    match cache.dtype {
        KvDtype::F32 => format!("((const float*)({row}))[{d}]"),
        KvDtype::F16 => format!("__half2float(((const __half*)({row}))[{d}])"),
        KvDtype::Bf16 => format!("__bfloat162float(((const __nv_bfloat16*)({row}))[{d}])"),
        KvDtype::Q8_0 => format!(
            "((float)((const signed char*)({row}))[{d}] * ((const float*)(({row}) + {hd}))[({d}) >> 5])",
            hd = ull(cache.head_dim)
        ),
    }
}

/// C statements locating token row `r` (a `maxc_u64` in scope, below `total_seq_len`): the
/// sequence `b` holding it and its position `p = cache_lengths[b] + r - input_row_offsets[b]`
/// (`long long`). Returns from the kernel when the step has no sequences or fewer than
/// `batch_size + 1` row offsets.
pub(crate) const LOCATE_ROW: &str = r#"    if (batch_size == 0 || batch_size >= input_row_offsets_len) return;
    const maxc_u64 b = maxc_sequence_of(input_row_offsets, batch_size, r);
    const long long p = (long long)cache_lengths[b] + ((long long)r - (long long)input_row_offsets[b]);
"#;

/// C statements giving `page` (a `maxc_u64`) for position `pos` (a non-negative `long long`)
/// of sequence `b` from `kv_lookup_table[b, pos / page_size]`, with `slot = pos % page_size`;
/// `on_bad` (a statement) runs when the page index or the page is out of the step's bounds.
pub(crate) fn page_lookup(cache: &KvView, pos: &str, on_bad: &str, indent: &str) -> String {
    fill(
        r#"${I}const maxc_u64 page_index = (maxc_u64)${POS} / ${PS};
${I}const maxc_u64 slot = (maxc_u64)${POS} % ${PS};
${I}if (page_index >= max_num_pages) ${BAD}
${I}const int page_entry = kv_lookup_table[b * max_num_pages + page_index];
${I}if (page_entry < 0 || (maxc_u64)page_entry >= total_num_pages) ${BAD}
${I}const maxc_u64 page = (maxc_u64)page_entry;
"#,
        &[
            ("I", indent.to_string()),
            ("POS", pos.to_string()),
            ("PS", ull(cache.page_size)),
            ("BAD", on_bad.to_string()),
        ],
    )
}

/// Emits [`maxc_schema::KernelBody::Positions`]: one block per sequence
/// `b < batch_size`, threads striding over its rows `input_row_offsets[b]..[b + 1]` (clipped to
/// `total_seq_len`), writing `cache_lengths[b] + r - input_row_offsets[b]`.
pub(crate) fn emit_positions(cx: Ctx) -> Result<Emitted, CudaError> {
    let threads = 128;
    let body = r#"
    const maxc_u64 b = blockIdx.x;
    if (b >= batch_size || b + 1 >= input_row_offsets_len) return;
    const long long lo = input_row_offsets[b];
    const long long hi = input_row_offsets[b + 1];
    const long long base = (long long)cache_lengths[b] - lo;
    for (long long r = lo + (long long)threadIdx.x; r < hi; r += blockDim.x)
        if (r >= 0 && (maxc_u64)r < total_seq_len) out[r] = base + r;
"#;
    let bufs = [
        Buf::input("int", "input_row_offsets"),
        Buf::input("int", "cache_lengths"),
        Buf::output("long long", "out"),
    ];
    let launch = CudaLaunch {
        grid: [
            source::per_row(Rows::Step(StepDim::BatchSize)),
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, body), launch))
}

/// Emits [`maxc_schema::KernelBody::KvStore`]: one block per token row
/// `r < total_seq_len`; the row's sequence and position give its page (through
/// `kv_lookup_table`, skipped when out of bounds) and slot, and threads store the row's keys
/// and values (all KV heads; with one plane, its latent) there in the cache's dtype. With
/// q8_0 each warp takes whole groups of 32 values: their largest magnitude by shuffles, the
/// scale `max / 127` from lane 0, each lane its integer `x / d` rounded to nearest even.
pub(crate) fn emit_kv_store(cx: Ctx, cache: &KvView) -> Result<Emitted, CudaError> {
    let floats = cache.kv_heads * cache.head_dim;
    let threads = source::row_threads(floats, 256);
    let two = cache.planes == 2;
    // Value `c` of the row is value `c % head_dim` of KV head `c / head_dim`, whose row is
    // that head's stride on from head 0's.
    let store = |dst: &str, src: &str| -> String {
        let x = format!("{src}[r * {} + c]", ull(floats));
        let put = match cache.dtype {
            KvDtype::F32 => "((float*)row)[e] = x;\n".to_string(),
            KvDtype::F16 => "((__half*)row)[e] = __float2half_rn(x);\n".to_string(),
            KvDtype::Bf16 => "((__nv_bfloat16*)row)[e] = __float2bfloat16_rn(x);\n".to_string(),
            KvDtype::Q8_0 => fill(
                r#"float amax = fabsf(x);
            for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float d = amax / 127.0f;
            ((signed char*)row)[e] = (signed char)(d == 0.0f ? 0 : __float2int_rn(x / d));
            if ((e & 31u) == 0) ((float*)(row + ${HD}))[e >> 5] = d;
"#,
                &[("HD", ull(cache.head_dim))],
            ),
        };
        fill(
            r#"        {
            const float x = ${X};
            unsigned char* row = ${DST} + (c / ${HD}) * ${HS};
            const maxc_u64 e = c % ${HD};
            ${PUT}        }
"#,
            &[
                ("X", x),
                ("DST", dst.to_string()),
                ("HD", ull(cache.head_dim)),
                ("HS", ull(cache.head_stride())),
                ("PUT", put),
            ],
        )
    };
    let (v_dst, v_store) = if two {
        (
            format!(
                "    unsigned char* v_dst = {};\n",
                slot_ptr(cache, "page", "slot", 1)
            ),
            store("v_dst", "v"),
        )
    } else {
        (String::new(), String::new())
    };
    // Every warp's 32 values lie in one group of 32 of one head (threads and head_dim are
    // multiples of 32 with q8_0), and the loop is warp-uniform.
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= total_seq_len) return;
${LOCATE}    if (p < 0) return;
${PAGE}    unsigned char* k_dst = ${K_DST};
${V_DST}    for (maxc_u64 c = threadIdx.x; c < ${SLOT}; c += blockDim.x) {
${K_STORE}${V_STORE}    }
"#,
        &[
            ("LOCATE", LOCATE_ROW.to_string()),
            ("PAGE", page_lookup(cache, "p", "return;", "    ")),
            ("K_DST", slot_ptr(cache, "page", "slot", 0)),
            ("V_DST", v_dst),
            ("K_STORE", store("k_dst", "k")),
            ("V_STORE", v_store),
            ("SLOT", ull(floats)),
        ],
    );
    let mut bufs = vec![Buf::input("float", "k")];
    if two {
        bufs.push(Buf::input("float", "v"));
    }
    bufs.extend([
        Buf::output("unsigned char", "kv_cache"),
        Buf::input("int", "kv_lookup_table"),
        Buf::input("int", "cache_lengths"),
        Buf::input("int", "input_row_offsets"),
    ]);
    let launch = CudaLaunch {
        grid: [
            source::per_row(Rows::Step(StepDim::TotalSeqLen)),
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
