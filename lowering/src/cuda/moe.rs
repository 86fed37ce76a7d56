//! SwiGLU experts weighted by a dense routing matrix, all experts in one launch.

use super::source::{self, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, Rows};

/// Threads per block (8 warps).
const THREADS: u32 = 256;
/// Most `ffn` activations kept in shared memory at once.
const CHUNK: u64 = 2048;

/// Emits [`maxc_schema::KernelBody::MoeExperts`] as one kernel over all experts (on
/// CUDA there are no partial outputs to sum: the kernel overwrites `out`). One block per row
/// `r < rows`: it zeroes `out[r]`, then for each expert `e` in order whose routing weight
/// `routing[r, e]` is non-zero (the same for the whole block) calls `<name>_expert`, which per
/// chunk of `ffn`: warp per activation `f`, `h[f] = silu(gate[f]·x) · (up[f]·x)` into shared
/// memory; then warp per output `j` (the same warp for `j` in every chunk and expert, so no
/// two threads touch one output), `out[r, j] += routing[r, e] · Σ_f down[j, f] · h[f]`.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    hidden: u64,
    ffn: u64,
    experts: u64,
    weight_dtype: DType,
) -> Result<Emitted, CudaError> {
    let hidden = cx.size("hidden", hidden)?;
    let ffn = cx.size("ffn", ffn)?;
    let experts = cx.size("experts", experts)?;
    cx.product("expert weight elements (ffn × hidden)", &[ffn, hidden])?;
    if experts > 4096 {
        return Err(cx.invalid(format!(
            "`experts` is {experts}, expected at most 4096 (kernel parameter space)"
        )));
    }
    let w_ty = cx.float_type("weight_dtype", weight_dtype)?;
    let chunk = ffn.min(CHUNK);
    let vars = [
        ("NAME", cx.name.to_string()),
        ("W", w_ty.to_string()),
        ("ROWS", rows_expr(rows)),
        ("HIDDEN", ull(hidden)),
        ("FFN", ull(ffn)),
        ("EXPERTS", ull(experts)),
        ("CHUNK", ull(chunk)),
    ];
    let expert_fn = fill(
        r#"// One expert's weighted SwiGLU output added to out_row; called by every thread of the block.
static __device__ __noinline__ void ${NAME}_expert(
    const float* __restrict__ x_row,
    const float route,
    const ${W}* __restrict__ gate,
    const ${W}* __restrict__ up,
    const ${W}* __restrict__ down,
    float* __restrict__ out_row,
    float* __restrict__ h)
{
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = blockDim.x >> 5;
    for (maxc_u64 f0 = 0; f0 < ${FFN}; f0 += ${CHUNK}) {
        const maxc_u64 len = ${FFN} - f0 < ${CHUNK} ? ${FFN} - f0 : ${CHUNK};
        for (maxc_u64 f = warp; f < len; f += warps) {
            const maxc_u64 w_row = (f0 + f) * ${HIDDEN};
            float g = 0.0f;
            float u = 0.0f;
            for (maxc_u64 c = lane; c < ${HIDDEN}; c += 32) {
                const float xv = x_row[c];
                g += maxc_ld(gate, w_row + c) * xv;
                u += maxc_ld(up, w_row + c) * xv;
            }
            g = maxc_warp_sum(g);
            u = maxc_warp_sum(u);
            if (lane == 0) h[f] = maxc_silu(g) * u;
        }
        __syncthreads();
        for (maxc_u64 j = warp; j < ${HIDDEN}; j += warps) {
            const maxc_u64 d_row = j * ${FFN} + f0;
            float y = 0.0f;
            for (maxc_u64 f = lane; f < len; f += 32) y += maxc_ld(down, d_row + f) * h[f];
            y = maxc_warp_sum(y);
            if (lane == 0) out_row[j] += route * y;
        }
        __syncthreads();
    }
}
"#,
        &vars,
    );
    let mut calls = String::new();
    let mut bufs = vec![Buf::input("float", "x"), Buf::input("float", "routing")];
    for e in 0..experts {
        for part in ["gate", "up", "down"] {
            bufs.push(Buf::input(w_ty, &format!("{part}{e}")));
        }
        calls.push_str(&format!(
            "    if (route[{e}] != 0.0f) {}_expert(x_row, route[{e}], gate{e}, up{e}, down{e}, out_row, h);\n",
            cx.name
        ));
    }
    bufs.push(Buf::output("float", "out"));
    let body = fill(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${ROWS}) return;
    __shared__ float h[${CHUNK}];
    const float* x_row = x + r * ${HIDDEN};
    const float* route = routing + r * ${EXPERTS};
    float* out_row = out + r * ${HIDDEN};
    // Zero with the ownership the experts use (warp j % warps, lane 0).
    for (maxc_u64 j = threadIdx.x >> 5; j < ${HIDDEN}; j += blockDim.x >> 5)
        if ((threadIdx.x & 31u) == 0u) out_row[j] = 0.0f;
${CALLS}"#,
        &[
            ("ROWS", rows_expr(rows)),
            ("CHUNK", ull(chunk)),
            ("HIDDEN", ull(hidden)),
            ("EXPERTS", ull(experts)),
            ("CALLS", calls),
        ],
    );
    let launch = CudaLaunch {
        grid: [per_row(rows), GridExtent::Fixed(1), GridExtent::Fixed(1)],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
    };
    let source = format!(
        "{expert_fn}\n{}",
        source::kernel(cx.name, THREADS, &bufs, &body)
    );
    Ok((source, launch))
}
