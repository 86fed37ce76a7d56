//! Causal attention over the paged KV cache with an online (flash-style) softmax.

use super::paged::{load_cached, page_lookup, slot_ptr, LOCATE_ROW};
use super::source::{self, f32_lit, fill, ull, Buf, Ctx, WARP};
use super::{CudaError, Emitted};
use maxc_schema::KvView;
use maxc_schema::{CudaLaunch, GridExtent, Rows, StepDim};

/// Warps per block; each walks every `WARPS`-th position of the context.
const WARPS: u32 = 4;

/// Emits [`maxc_schema::KernelBody::Attention`]: one block per (token row
/// `r < total_seq_len`, query head), reading KV head `head / (heads / kv_heads)`. The row's
/// sequence `b` and position `p` come from the row offsets; warp `w` walks positions
/// `w, w + WARPS, ... <= p` (pages through `kv_lookup_table`, skipping entries outside the
/// step's bounds), each lane holding `ceil(head_dim / 32)` elements of `q` and of an f32
/// accumulator: per position `s = warp_sum(q·k) · scale`, `m' = max(m, s)`,
/// `l = l·e^(m-m') + e^(s-m')`, `acc = acc·e^(m-m') + e^(s-m')·v`. The warps' states are then
/// merged in shared memory: `out = Σ_w acc_w e^(m_w-M) / Σ_w l_w e^(m_w-M)`. Prefill and
/// decode rows run the same kernel. With a sliding `window` the walk starts at position
/// `max(p + 1 - window, 0)`. Values are `value_dim` wide: the value plane's (two planes), or
/// the key's first `value_dim` elements (one plane: a latent, every head reading it).
pub(crate) fn emit(
    cx: Ctx,
    cache: &KvView,
    heads: u64,
    scale: f32,
    window: Option<u64>,
    value_dim: u64,
) -> Result<Emitted, CudaError> {
    let heads = cx.size("heads", heads)?;
    if heads % cache.kv_heads != 0 {
        return Err(cx.invalid(format!(
            "`heads` is {heads}, expected a multiple of `kv_heads` = {}",
            cache.kv_heads
        )));
    }
    let hd = cache.head_dim;
    cx.product("row width (heads × head_dim)", &[heads, hd])?;
    if hd > 1024 {
        return Err(cx.invalid(format!(
            "`head_dim` is {hd}, expected at most 1024 (per-lane registers)"
        )));
    }
    if heads > 65535 {
        return Err(cx.invalid(format!(
            "`heads` is {heads}, expected at most 65535 (grid y)"
        )));
    }
    if window == Some(0) {
        return Err(cx.invalid("`window` is 0, expected at least 1".into()));
    }
    let vd = value_dim;
    let value_ok = match cache.planes {
        2 => vd == hd,
        _ => vd > 0 && vd <= hd,
    };
    if !value_ok {
        return Err(cx.invalid(format!(
            "`value_dim` is {vd} with {} plane(s) of head_dim {hd}",
            cache.planes
        )));
    }
    let first = match window {
        None => String::new(),
        Some(w) => format!("(p + 1 > {w}ll ? p + 1 - {w}ll : 0) + "),
    };
    let group = heads / cache.kv_heads;
    let per_lane = hd.div_ceil(u64::from(WARP));
    let threads = WARPS * WARP;
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    const maxc_u64 head = blockIdx.y;
    if (r >= total_seq_len || head >= ${HEADS}) return;
${LOCATE}    // Grouped-query attention: query heads [g * ${GROUP}, (g + 1) * ${GROUP}) read KV head g.
    const maxc_u64 kv_head = head / ${GROUP};
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const float* q_row = q + (r * ${HEADS} + head) * ${HEAD_DIM};
    float qv[${PER_LANE}];
    float acc[${PER_LANE}];
#pragma unroll
    for (unsigned e = 0; e < ${PER_LANE}; ++e) {
        const maxc_u64 d = lane + 32u * e;
        qv[e] = d < ${HEAD_DIM} ? q_row[d] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -maxc_inf();
    float l = 0.0f;
    // Warp-uniform loop: every lane of a warp sees the same positions and pages.
    for (long long pos = ${FIRST}warp; pos <= p; pos += ${WARPS}) {
${PAGE}        const unsigned char* k_ptr = ${K_PTR} + kv_head * ${HEAD_STRIDE};
        const unsigned char* v_ptr = ${V_PTR} + kv_head * ${HEAD_STRIDE};
        float dot = 0.0f;
#pragma unroll
        for (unsigned e = 0; e < ${PER_LANE}; ++e) {
            const maxc_u64 d = lane + 32u * e;
            if (d < ${HEAD_DIM}) dot += qv[e] * ${K_AT_D};
        }
        const float s = maxc_warp_sum(dot) * ${SCALE};
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);
        const float w = expf(s - m_new);
        l = l * corr + w;
#pragma unroll
        for (unsigned e = 0; e < ${PER_LANE}; ++e) {
            const maxc_u64 d = lane + 32u * e;
            if (d < ${VALUE_DIM}) acc[e] = acc[e] * corr + w * ${V_AT_D};
        }
        m = m_new;
    }
    __shared__ float warp_m[${WARPS}];
    __shared__ float warp_l[${WARPS}];
    __shared__ float warp_acc[${WARPS}][${VALUE_DIM}];
#pragma unroll
    for (unsigned e = 0; e < ${PER_LANE}; ++e) {
        const maxc_u64 d = lane + 32u * e;
        if (d < ${VALUE_DIM}) warp_acc[warp][d] = acc[e];
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
    __syncthreads();
    // Warps that saw no position (l = 0) take no part.
    float m_all = -maxc_inf();
    for (unsigned w = 0; w < ${WARPS}; ++w)
        if (warp_l[w] > 0.0f) m_all = fmaxf(m_all, warp_m[w]);
    float l_all = 0.0f;
    for (unsigned w = 0; w < ${WARPS}; ++w)
        if (warp_l[w] > 0.0f) l_all += warp_l[w] * expf(warp_m[w] - m_all);
    float* out_row = out + (r * ${HEADS} + head) * ${VALUE_DIM};
    for (maxc_u64 d = threadIdx.x; d < ${VALUE_DIM}; d += blockDim.x) {
        float o = 0.0f;
        for (unsigned w = 0; w < ${WARPS}; ++w)
            if (warp_l[w] > 0.0f) o += warp_acc[w][d] * expf(warp_m[w] - m_all);
        out_row[d] = l_all > 0.0f ? o / l_all : 0.0f;
    }
"#,
        &[
            ("LOCATE", LOCATE_ROW.to_string()),
            ("PAGE", page_lookup(cache, "pos", "continue;", "        ")),
            ("K_PTR", slot_ptr(cache, "page", "slot", 0)),
            ("V_PTR", slot_ptr(cache, "page", "slot", 1)),
            ("HEAD_STRIDE", ull(cache.head_stride())),
            ("K_AT_D", load_cached(cache, "k_ptr", "d")),
            ("V_AT_D", load_cached(cache, "v_ptr", "d")),
            ("HEADS", ull(heads)),
            ("GROUP", ull(group)),
            ("HEAD_DIM", ull(hd)),
            ("VALUE_DIM", ull(vd)),
            ("PER_LANE", per_lane.to_string()),
            ("WARPS", WARPS.to_string()),
            ("SCALE", f32_lit(scale)),
            ("FIRST", first),
        ],
    );
    let bufs = [
        Buf::input("float", "q"),
        Buf::input("unsigned char", "kv_cache"),
        Buf::input("int", "kv_lookup_table"),
        Buf::input("int", "cache_lengths"),
        Buf::input("int", "input_row_offsets"),
        Buf::output("float", "out"),
    ];
    let launch = CudaLaunch {
        grid: [
            source::per_row(Rows::Step(StepDim::TotalSeqLen)),
            GridExtent::Fixed(heads),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
