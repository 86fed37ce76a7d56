//! Row gathers: embedding lookup by token id, and the last row of each sequence.

use super::source::{self, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GatherIndex, GridExtent, Rows};

/// Emits [`maxc_schema::KernelBody::Gather`]: one block per output row `i < rows`,
/// threads striding over the columns. `Tokens` copies source row `index[i]`; `LastRows` copies
/// row `index[i + 1] - 1` when sequence `i` has rows (and that row is below `total_seq_len`),
/// zeros otherwise.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    cols: u64,
    index: GatherIndex,
    src_dtype: DType,
) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    let src_ty = cx.float_type("src_dtype", src_dtype)?;
    let threads = source::row_threads(cols, 256);
    let vars = [("ROWS", rows_expr(rows)), ("COLS", ull(cols))];
    let (index_buf, body) = match index {
        GatherIndex::Tokens => (
            Buf::input("long long", "index"),
            fill(
                r#"
    const maxc_u64 i = blockIdx.x;
    if (i >= ${ROWS}) return;
    const maxc_u64 token = (maxc_u64)index[i];
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x)
        out[i * ${COLS} + c] = maxc_ld(src, token * ${COLS} + c);
"#,
                &vars,
            ),
        ),
        GatherIndex::LastRows => (
            Buf::input("int", "index"),
            fill(
                r#"
    const maxc_u64 i = blockIdx.x;
    if (i >= ${ROWS}) return;
    // Sequence i owns rows index[i]..index[i + 1]; its last row, if any.
    long long last = -1;
    if (i + 1 < input_row_offsets_len && index[i + 1] > index[i]) last = (long long)index[i + 1] - 1;
    const bool has_row = last >= 0 && (maxc_u64)last < total_seq_len;
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x)
        out[i * ${COLS} + c] = has_row ? maxc_ld(src, (maxc_u64)last * ${COLS} + c) : 0.0f;
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
