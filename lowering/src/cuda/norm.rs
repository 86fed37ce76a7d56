//! RMSNorm, optionally fused with the residual add before it.

use super::source::{self, f32_lit, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, Rows};

/// Emits [`maxc_schema::KernelBody::RmsNorm`]: one block per row `r < rows`. Pass 1
/// (with `residual`, writing `sum = a + b`) sums squares per thread, then a block reduction;
/// `inv = 1 / sqrt(Σx²/width + eps)`; pass 2 writes `out = x · inv · w`. Each thread reads back
/// only the sums it wrote itself. Where `width < cols` (per-head norms) the block does the
/// row's `cols / width` groups in turn.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    (cols, width): (u64, u64),
    weight_offset: f32,
    eps: f32,
    residual: bool,
    weight_dtype: DType,
) -> Result<Emitted, CudaError> {
    let w = if weight_offset == 0.0 {
        "maxc_ld(w, c)".to_string()
    } else {
        format!("(maxc_ld(w, c) + {})", f32_lit(weight_offset))
    };
    let cols = cx.size("cols", cols)?;
    let width = cx.size("width", width)?;
    if cols % width != 0 {
        return Err(cx.invalid(format!("`width` {width} does not divide `cols` {cols}")));
    }
    if width < cols {
        return grouped(cx, rows, (cols, width), &w, eps, residual, weight_dtype);
    }
    let w_ty = cx.float_type("weight_dtype", weight_dtype)?;
    let threads = source::row_threads(cols, 256);
    let (bufs, x_row, pass1) = operands(w_ty, residual, "r * ${COLS} + c", "        ");
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
        out[r * ${{COLS}} + c] = {x_row}[r * ${{COLS}} + c] * inv * {w};
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

/// [`emit`] for rows of `cols / width` groups normalized each on its own (per-head norms).
fn grouped(
    cx: Ctx,
    rows: Rows,
    (cols, width): (u64, u64),
    w: &str,
    eps: f32,
    residual: bool,
    weight_dtype: DType,
) -> Result<Emitted, CudaError> {
    let w_ty = cx.float_type("weight_dtype", weight_dtype)?;
    let threads = source::row_threads(width, 256);
    let (bufs, x_row, pass1) = operands(w_ty, residual, "o + c", "            ");
    let template = format!(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${{ROWS}}) return;
    for (maxc_u64 g = 0; g < ${{GROUPS}}; ++g) {{
        const maxc_u64 o = r * ${{COLS}} + g * ${{WIDTH}};
        float sq = 0.0f;
        for (maxc_u64 c = threadIdx.x; c < ${{WIDTH}}; c += blockDim.x) {{
{pass1}
            sq += v * v;
        }}
        sq = maxc_block_sum(sq);
        const float inv = 1.0f / sqrtf(sq / ${{WIDTH_F}} + ${{EPS}});
        for (maxc_u64 c = threadIdx.x; c < ${{WIDTH}}; c += blockDim.x)
            out[o + c] = {x_row}[o + c] * inv * {w};
    }}
"#
    );
    let body = fill(
        &template,
        &[
            ("ROWS", rows_expr(rows)),
            ("COLS", ull(cols)),
            ("GROUPS", ull(cols / width)),
            ("WIDTH", ull(width)),
            ("WIDTH_F", f32_lit(width as f32)),
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

/// The kernel's buffers, the one its second pass reads (`x`, or the written `sum`), and its
/// first pass's body at element index `at`, each line indented by `indent`.
fn operands(
    w_ty: &'static str,
    residual: bool,
    at: &str,
    indent: &str,
) -> (Vec<Buf>, &'static str, String) {
    if residual {
        (
            vec![
                Buf::input("float", "a"),
                Buf::input("float", "b"),
                Buf::input(w_ty, "w"),
                Buf::output("float", "sum"),
                Buf::output("float", "out"),
            ],
            "sum",
            format!("{indent}const float v = a[{at}] + b[{at}];\n{indent}sum[{at}] = v;"),
        )
    } else {
        (
            vec![
                Buf::input("float", "x"),
                Buf::input(w_ty, "w"),
                Buf::output("float", "out"),
            ],
            "x",
            format!("{indent}const float v = x[{at}];"),
        )
    }
}
