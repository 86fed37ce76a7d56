//! The kernels multi-head latent attention adds besides its attention (which is
//! [`super::attention`]'s, over a one-plane latent cache): concatenation along the last axis,
//! per-head matmuls (the absorbed up-projections) and DeepSeek's group-limited router.

use super::source::{self, f32_lit, fill, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, GroupScore, RouterScoring, Rows};

/// Emits [`maxc_schema::KernelBody::Concat`]: one block per row, threads striding over its
/// `groups × (a + b)` outputs.
pub(crate) fn emit_concat(
    cx: Ctx,
    rows: Rows,
    groups: u64,
    a: u64,
    b: u64,
) -> Result<Emitted, CudaError> {
    let (groups, a, b) = (
        cx.size("groups", groups)?,
        cx.size("a", a)?,
        cx.size("b", b)?,
    );
    let width = cx.product("row width (groups × (a + b))", &[groups, a + b])?;
    let threads = source::row_threads(width, 256);
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${ROWS}) return;
    for (maxc_u64 i = threadIdx.x; i < ${WIDTH}; i += blockDim.x) {
        const maxc_u64 g = i / ${AB};
        const maxc_u64 c = i % ${AB};
        const maxc_u64 row = r * ${GROUPS} + g;
        out[r * ${WIDTH} + i] = c < ${A} ? a[row * ${A} + c] : b[row * ${B} + (c - ${A})];
    }
"#,
        &[
            ("ROWS", rows_expr(rows)),
            ("WIDTH", ull(width)),
            ("AB", ull(a + b)),
            ("GROUPS", ull(groups)),
            ("A", ull(a)),
            ("B", ull(b)),
        ],
    );
    let bufs = [
        Buf::input("float", "a"),
        Buf::input("float", "b"),
        Buf::output("float", "out"),
    ];
    let launch = CudaLaunch {
        grid: [
            source::per_row(rows),
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}

/// Emits [`maxc_schema::KernelBody::HeadMatmul`]: one block per (row, head), a thread per
/// output feature computing its dot product over the head's `k` inputs (weights widened from
/// their float type).
pub(crate) fn emit_head_matmul(
    cx: Ctx,
    rows: Rows,
    heads: u64,
    n: u64,
    k: u64,
    weight_dtype: DType,
) -> Result<Emitted, CudaError> {
    let (heads, n, k) = (cx.size("heads", heads)?, cx.size("n", n)?, cx.size("k", k)?);
    cx.product("weight elements (heads × n × k)", &[heads, n, k])?;
    if heads > 65535 {
        return Err(cx.invalid(format!(
            "`heads` is {heads}, expected at most 65535 (grid y)"
        )));
    }
    let wty = cx.float_type("weight_dtype", weight_dtype)?;
    let threads = source::row_threads(n, 256);
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    const maxc_u64 h = blockIdx.y;
    if (r >= ${ROWS} || h >= ${HEADS}) return;
    const float* x_row = x + (r * ${HEADS} + h) * ${K};
    for (maxc_u64 j = threadIdx.x; j < ${N}; j += blockDim.x) {
        const maxc_u64 w_row = (h * ${N} + j) * ${K};
        float acc = 0.0f;
        for (maxc_u64 i = 0; i < ${K}; ++i) acc += x_row[i] * maxc_ld(w, w_row + i);
        out[(r * ${HEADS} + h) * ${N} + j] = acc;
    }
"#,
        &[
            ("ROWS", rows_expr(rows)),
            ("HEADS", ull(heads)),
            ("N", ull(n)),
            ("K", ull(k)),
        ],
    );
    let bufs = [
        Buf::input("float", "x"),
        Buf::input(wty, "w"),
        Buf::output("float", "out"),
    ];
    let launch = CudaLaunch {
        grid: [
            source::per_row(rows),
            GridExtent::Fixed(heads),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}

/// A group-limited router's settings (see [`maxc_schema::KernelBody::MoeRouter`]).
pub(crate) struct Routing {
    pub top_k: u64,
    pub n_group: u64,
    pub topk_group: u64,
    pub scoring: RouterScoring,
    pub group_score: GroupScore,
    pub renormalize: bool,
    pub scale: f32,
}

/// Emits [`maxc_schema::KernelBody::MoeRouter`]: one warp per row, its scores, choice scores
/// and group scores in shared memory, each lane striding over experts (and groups); the groups
/// are kept and the experts chosen by repeated warp arg-max passes (ties: lower index), as the
/// kernel body defines.
pub(crate) fn emit_router(
    cx: Ctx,
    rows: Rows,
    experts: u64,
    r: Routing,
    bias_dtype: DType,
) -> Result<Emitted, CudaError> {
    let e = cx.size("experts", experts)?;
    if e > 4096 {
        return Err(cx.invalid(format!("`experts` is {e}, expected at most 4096")));
    }
    let g = cx.size("n_group", r.n_group)?;
    if e % g != 0
        || r.topk_group == 0
        || r.topk_group > g
        || r.top_k == 0
        || r.top_k > r.topk_group * (e / g)
    {
        return Err(cx.invalid(format!(
            "{} of {e} experts in {g} groups keeping {}: expected groups dividing the experts and choices within the kept groups",
            r.top_k, r.topk_group
        )));
    }
    let bty = cx.float_type("bias_dtype", bias_dtype)?;
    let scores = match r.scoring {
        RouterScoring::Sigmoid => {
            "    for (unsigned e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-l[e]));\n"
                .to_string()
        }
        RouterScoring::Softmax => r#"    float mx = -maxc_inf();
    for (unsigned e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float total = 0.0f;
    for (unsigned e = lane; e < E; e += 32) total += expf(l[e] - mx);
    total = maxc_warp_sum(total);
    for (unsigned e = lane; e < E; e += 32) s[e] = expf(l[e] - mx) / total;
"#
        .to_string(),
    };
    let group = match r.group_score {
        GroupScore::TopTwoSum => {
            r#"        float first = -maxc_inf(), second = -maxc_inf();
        for (unsigned e = g * PER; e < (g + 1) * PER; ++e) {
            if (c[e] > first) { second = first; first = c[e]; }
            else if (c[e] > second) second = c[e];
        }
        gs[g] = PER < 2 ? first : first + second;
"#
        }
        GroupScore::Max => {
            r#"        float best = -maxc_inf();
        for (unsigned e = g * PER; e < (g + 1) * PER; ++e) best = fmaxf(best, s[e]);
        gs[g] = best;
"#
        }
    };
    let weight = if r.renormalize { "s[e] / sum" } else { "s[e]" };
    let body = fill(
        r#"
    enum { E = ${E}, G = ${G}, PER = ${PER} };
    const unsigned lane = threadIdx.x;
    const maxc_u64 r = blockIdx.x;
    if (r >= ${ROWS}) return;
    __shared__ float s[E];
    __shared__ float c[E];
    __shared__ unsigned char chosen[E];
    __shared__ float gs[G];
    __shared__ unsigned char kept[G];
    const float* l = logits + r * E;
${SCORES}    __syncwarp();
    for (unsigned e = lane; e < E; e += 32) { c[e] = s[e] + maxc_ld(bias, e); chosen[e] = 0; }
    __syncwarp();
    for (unsigned g = lane; g < G; g += 32) {
${GROUP}        kept[g] = 0;
    }
    __syncwarp();
    // A warp arg-max over the items `ok` admits: the largest value, ties to the lower index.
#define MAXC_ARGMAX(COUNT, OK, VAL)                                                        \
    float bv = -maxc_inf();                                                                \
    int bi = -1;                                                                           \
    for (unsigned i = lane; i < (COUNT); i += 32)                                          \
        if ((OK) && (bi < 0 || (VAL) > bv)) { bv = (VAL); bi = (int)i; }                   \
    for (int o = 16; o > 0; o >>= 1) {                                                     \
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);                              \
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);                                \
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; } \
    }
    for (unsigned t = 0; t < ${TOPK_GROUP}; ++t) {
        MAXC_ARGMAX(G, !kept[i], gs[i])
        if (lane == 0) kept[bi] = 1;
        __syncwarp();
    }
    float sum = 0.0f;
    for (unsigned t = 0; t < ${TOP_K}; ++t) {
        MAXC_ARGMAX(E, kept[i / PER] && !chosen[i], c[i])
        if (lane == 0) chosen[bi] = 1;
        sum += s[bi];
        __syncwarp();
    }
#undef MAXC_ARGMAX
    sum += 1e-20f;
    float* o = out + r * E;
    for (unsigned e = lane; e < E; e += 32) o[e] = chosen[e] ? (${WEIGHT}) * ${SCALE} : 0.0f;
"#,
        &[
            ("E", e.to_string()),
            ("G", g.to_string()),
            ("PER", (e / g).to_string()),
            ("ROWS", rows_expr(rows)),
            ("SCORES", scores),
            ("GROUP", group.to_string()),
            ("TOPK_GROUP", r.topk_group.to_string()),
            ("TOP_K", r.top_k.to_string()),
            ("WEIGHT", weight.to_string()),
            ("SCALE", f32_lit(r.scale)),
        ],
    );
    let bufs = [
        Buf::input("float", "logits"),
        Buf::input(bty, "bias"),
        Buf::output("float", "out"),
    ];
    let launch = CudaLaunch {
        grid: [
            source::per_row(rows),
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [32, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, 32, &bufs, &body), launch))
}
