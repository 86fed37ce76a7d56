//! RMSNorm, optionally fused with the residual add before it.

use super::source::{self, f32_lit, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, Rows};

/// Emits [`maxc_schema::KernelBody::RmsNorm`]: one block per row `r < rows`. Pass 1
/// (with `residual`, writing `sum = a + b`) sums squares per thread, then a block reduction;
/// `inv = 1 / sqrt(Σx²/cols + eps)`; pass 2 writes `out = x · inv · w`. Each thread reads back
/// only the sums it wrote itself.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    cols: u64,
    eps: f32,
    residual: bool,
    weight_dtype: DType,
) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    let w_ty = cx.float_type("weight_dtype", weight_dtype)?;
    let threads = source::row_threads(cols, 256);
    let (bufs, x_row, pass1) = if residual {
        (
            vec![
                Buf::input("float", "a"),
                Buf::input("float", "b"),
                Buf::input(w_ty, "w"),
                Buf::output("float", "sum"),
                Buf::output("float", "out"),
            ],
            "sum",
            r#"        const float v = a[r * ${COLS} + c] + b[r * ${COLS} + c];
        sum[r * ${COLS} + c] = v;"#,
        )
    } else {
        (
            vec![
                Buf::input("float", "x"),
                Buf::input(w_ty, "w"),
                Buf::output("float", "out"),
            ],
            "x",
            r#"        const float v = x[r * ${COLS} + c];"#,
        )
    };
    let template = format!(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${{ROWS}}) return;
    float sq = 0.0f;
    for (maxc_u64 c = threadIdx.x; c < ${{COLS}}; c += blockDim.x) {{
{pass1}
        sq += v * v;
    }}
    sq = maxc_block_sum(sq);
    const float inv = 1.0f / sqrtf(sq / ${{COLS_F}} + ${{EPS}});
    for (maxc_u64 c = threadIdx.x; c < ${{COLS}}; c += blockDim.x)
        out[r * ${{COLS}} + c] = {x_row}[r * ${{COLS}} + c] * inv * maxc_ld(w, c);
"#
    );
    let body = fill(
        &template,
        &[
            ("ROWS", rows_expr(rows)),
            ("COLS", ull(cols)),
            ("COLS_F", f32_lit(cols as f32)),
            ("EPS", f32_lit(eps)),
        ],
    );
    let launch = CudaLaunch {
        grid: [per_row(rows), GridExtent::Fixed(1), GridExtent::Fixed(1)],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
