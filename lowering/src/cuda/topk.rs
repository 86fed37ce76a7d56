//! Top-k selection per row (MoE routing).

use super::source::{self, fill, rows_expr, ull, Buf, Ctx, WARP};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, GridExtent, Rows};

/// Rows per block: one warp each.
const ROWS_PER_BLOCK: u32 = 4;

/// Emits [`maxc_schema::KernelBody::TopK`]: one warp per row `r < rows`. Entries are
/// ranked by value, then by lower index. Each of `min(k, cols)` passes finds the best entry
/// ranked after the previous pick `(pv, pi)` (a per-lane scan, then a butterfly arg-max that
/// leaves every lane with the same pick), tracking the kept sum; a final pass writes `x` (or
/// `x / sum` with `renormalize`) where `x > pv || (x == pv && j <= pi)`, zero elsewhere.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    cols: u64,
    k: u64,
    renormalize: bool,
) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    if cols > i64::MAX as u64 {
        return Err(cx.invalid(format!("`cols` is {cols}, expected at most {}", i64::MAX)));
    }
    let keep = k.min(cols);
    let value = if renormalize { "v / sum" } else { "v" };
    let body = fill(
        r#"
    const unsigned lane = threadIdx.x & 31u;
    const maxc_u64 r = (maxc_u64)blockIdx.x * ${PER_BLOCK} + (threadIdx.x >> 5);
    if (r >= ${ROWS}) return;
    const float* x_row = x + r * ${COLS};
    float* out_row = out + r * ${COLS};
    float pv = maxc_inf();
    long long pi = -1;
    float sum = 0.0f;
    for (maxc_u64 pass = 0; pass < ${KEEP}; ++pass) {
        float bv = -maxc_inf();
        long long bi = -1;
        for (maxc_u64 j = lane; j < ${COLS}; j += 32) {
            const float v = x_row[j];
            const bool after = v < pv || (v == pv && (long long)j > pi);
            if (after && (bi < 0 || v > bv)) {
                bv = v;
                bi = (long long)j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const long long oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi < 0) break;
        pv = bv;
        pi = bi;
        sum += bv;
    }
    for (maxc_u64 j = lane; j < ${COLS}; j += 32) {
        const float v = x_row[j];
        const bool kept = v > pv || (v == pv && (long long)j <= pi);
        out_row[j] = kept ? ${VALUE} : 0.0f;
    }
"#,
        &[
            ("PER_BLOCK", ull(u64::from(ROWS_PER_BLOCK))),
            ("ROWS", rows_expr(rows)),
            ("COLS", ull(cols)),
            ("KEEP", ull(keep)),
            ("VALUE", value.to_string()),
        ],
    );
    let bufs = [Buf::input("float", "x"), Buf::output("float", "out")];
    let threads = ROWS_PER_BLOCK * WARP;
    let launch = CudaLaunch {
        grid: [
            GridExtent::CeilDiv {
                rows,
                by: u64::from(ROWS_PER_BLOCK),
            },
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
