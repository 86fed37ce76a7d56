//! Row gathers: embedding lookup by token id, and the rows a step returns logits for.

use super::source::{self, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GatherIndex, GridExtent, Rows};

/// Emits [`maxc_schema::KernelBody::Gather`]: one block per output row `i < rows`,
/// threads striding over the columns. `Tokens` copies source row `index[i]` (a token id);
/// `LogitRows` copies row `index[i]` (a step row), zeros where it is -1.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    cols: u64,
    index: GatherIndex,
    src_dtype: DType,
    scale: f32,
) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    let src_ty = cx.float_type("src_dtype", src_dtype)?;
    let threads = source::row_threads(cols, 256);
    let scale = if scale == 1.0 {
        String::new()
    } else {
        format!(" * {}", source::f32_lit(scale))
    };
    let vars = [
        ("ROWS", rows_expr(rows)),
        ("COLS", ull(cols)),
        ("SCALE", scale),
    ];
    let (index_buf, body) = match index {
        GatherIndex::Tokens => (
            Buf::input("long long", "index"),
            fill(
                r#"
    const maxc_u64 i = blockIdx.x;
    if (i >= ${ROWS}) return;
    const maxc_u64 token = (maxc_u64)index[i];
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x)
        out[i * ${COLS} + c] = maxc_ld(src, token * ${COLS} + c)${SCALE};
"#,
                &vars,
            ),
        ),
        GatherIndex::LogitRows => (
            Buf::input("int", "index"),
            fill(
                r#"
    const maxc_u64 i = blockIdx.x;
    if (i >= ${ROWS}) return;
    // The step check holds every index in -1..total_seq_len.
    const long long row = (long long)index[i];
    const bool has_row = row >= 0 && (maxc_u64)row < total_seq_len;
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x)
        out[i * ${COLS} + c] = has_row ? maxc_ld(src, (maxc_u64)row * ${COLS} + c)${SCALE} : 0.0f;
"#,
                &vars,
            ),
        ),
    };
    let bufs = [
        Buf::input(src_ty, "src"),
        index_buf,
        Buf::output("float", "out"),
    ];
    let launch = CudaLaunch {
        grid: [per_row(rows), GridExtent::Fixed(1), GridExtent::Fixed(1)],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
