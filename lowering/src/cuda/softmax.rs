//! Row softmax.

use super::source::{self, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, GridExtent, Rows};

/// Emits [`maxc_schema::KernelBody::Softmax`]: one block per row `r < rows`; the row
/// maximum (block reduction), `e = expf(x - max)` written to `out` while summing (block
/// reduction), then `out = e / sum`. Each thread reads back only what it wrote.
pub(crate) fn emit(cx: Ctx, rows: Rows, cols: u64) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    let threads = source::row_threads(cols, 256);
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${ROWS}) return;
    const float* x_row = x + r * ${COLS};
    float* out_row = out + r * ${COLS};
    float m = -maxc_inf();
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x) m = fmaxf(m, x_row[c]);
    m = maxc_block_max(m);
    float s = 0.0f;
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x) {
        const float e = expf(x_row[c] - m);
        out_row[c] = e;
        s += e;
    }
    s = maxc_block_sum(s);
    for (maxc_u64 c = threadIdx.x; c < ${COLS}; c += blockDim.x) out_row[c] = out_row[c] / s;
"#,
        &[("ROWS", rows_expr(rows)), ("COLS", ull(cols))],
    );
    let bufs = [Buf::input("float", "x"), Buf::output("float", "out")];
    let launch = CudaLaunch {
        grid: [per_row(rows), GridExtent::Fixed(1), GridExtent::Fixed(1)],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
