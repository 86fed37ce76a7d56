//! Rotary position embedding (rotate-half layout).

use super::source::{self, fill, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, GridExtent, Rows, StepDim};

/// Emits [`maxc_schema::KernelBody::Rope`]: one block per token row
/// `r < total_seq_len`; its position selects the table row `[2, rotary_dim/2]` (cos, then
/// sin), and threads stride over the `heads × rotary_dim/2` pairs `(x[i], x[i + h])`, then
/// copy each head's elements past `rotary_dim`.
pub(crate) fn emit(
    cx: Ctx,
    heads: u64,
    head_dim: u64,
    rotary_dim: u64,
) -> Result<Emitted, CudaError> {
    let heads = cx.size("heads", heads)?;
    let head_dim = cx.size("head_dim", head_dim)?;
    let rotary_dim = cx.size("rotary_dim", rotary_dim)?;
    if rotary_dim % 2 != 0 || rotary_dim > head_dim {
        return Err(cx.invalid(format!(
            "`rotary_dim` is {rotary_dim}, expected an even number at most `head_dim` ({head_dim})"
        )));
    }
    cx.product("row width (heads × head_dim)", &[heads, head_dim])?;
    let half = rotary_dim / 2;
    let pass = if rotary_dim < head_dim {
        fill(
            r#"    for (maxc_u64 i = threadIdx.x; i < ${REST}; i += blockDim.x) {
        const maxc_u64 at = r * ${WIDTH} + (i / ${TAIL}) * ${HEAD_DIM} + ${ROT} + i % ${TAIL};
        out[at] = x[at];
    }
"#,
            &[
                ("REST", ull(heads * (head_dim - rotary_dim))),
                ("TAIL", ull(head_dim - rotary_dim)),
                ("WIDTH", ull(heads * head_dim)),
                ("HEAD_DIM", ull(head_dim)),
                ("ROT", ull(rotary_dim)),
            ],
        )
    } else {
        String::new()
    };
    let threads = source::row_threads(heads * half, 256);
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= total_seq_len) return;
    const maxc_u64 pos = (maxc_u64)positions[r];
    const float* cos_row = table + pos * ${ROT};
    const float* sin_row = cos_row + ${HALF};
    for (maxc_u64 i = threadIdx.x; i < ${PAIRS}; i += blockDim.x) {
        const maxc_u64 h = i / ${HALF};
        const maxc_u64 j = i % ${HALF};
        const maxc_u64 lo = r * ${WIDTH} + h * ${HEAD_DIM} + j;
        const maxc_u64 hi = lo + ${HALF};
        const float x1 = x[lo];
        const float x2 = x[hi];
        const float c = cos_row[j];
        const float s = sin_row[j];
        out[lo] = x1 * c - x2 * s;
        out[hi] = x2 * c + x1 * s;
    }
${PASS}"#,
        &[
            ("PASS", pass),
            ("ROT", ull(rotary_dim)),
            ("HEAD_DIM", ull(head_dim)),
            ("HALF", ull(half)),
            ("PAIRS", ull(heads * half)),
            ("WIDTH", ull(heads * head_dim)),
        ],
    );
    let bufs = [
        Buf::input("float", "x"),
        Buf::input("long long", "positions"),
        Buf::input("float", "table"),
        Buf::output("float", "out"),
    ];
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
