//! SwiGLU experts weighted by a dense routing matrix, all experts in one launch, tokens grouped
//! by expert within tiles of rows.

use super::source::{self, fill, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, Rows};

/// Threads per block (8 warps).
const THREADS: u32 = 256;
/// Rows per block: each expert's weights are read once for all the tile's rows routed to it
/// (a decode step of up to this many sequences reads every expert once).
const TILE: u64 = 8;
/// Most `ffn` activations per row kept in shared memory at once (`TILE × CHUNK` floats, 32 KiB).
const CHUNK: u64 = 1024;

/// Emits [`maxc_schema::KernelBody::MoeExperts`] as one kernel over all experts (on CUDA there
/// are no partial outputs to sum: the kernel overwrites `out`). One block per tile of `TILE`
/// rows: it zeroes the tile's output rows, then for each expert `e` in order that any of the
/// tile's rows is routed to (the same for the whole block) calls `<name>_expert`, which per
/// chunk of `ffn`: warp per activation `f`, reading `gate[f]` and `up[f]` once for every routed
/// row `m`, `h[m, f] = silu(gate[f]·x_m) · (up[f]·x_m)` into shared memory; then warp per output
/// `j` (the same warp for `j` in every chunk and expert, so no two threads touch one output),
/// reading `down[j]` once, `out[m, j] += routing[m, e] · Σ_f down[j, f] · h[m, f]`. Each row's
/// experts are summed in order, so the result does not depend on the tiling.
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
        ("TILE", TILE.to_string()),
    ];
    let expert_fn = fill(
        r#"// Expert `e`'s weighted SwiGLU output added to the rows of the tile at `row0` routed to it;
// called by every thread of the block.
static __device__ __noinline__ void ${NAME}_expert(
    const float* __restrict__ x,
    const float* __restrict__ routing,
    const maxc_u64 row0,
    const maxc_u64 rows,
    const maxc_u64 e,
    const ${W}* __restrict__ gate,
    const ${W}* __restrict__ up,
    const ${W}* __restrict__ down,
    float* __restrict__ out,
    float* __restrict__ h)
{
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = blockDim.x >> 5;
    float route[${TILE}];
    bool any = false;
#pragma unroll
    for (int m = 0; m < ${TILE}; ++m) {
        route[m] = row0 + m < rows ? routing[(row0 + m) * ${EXPERTS} + e] : 0.0f;
        any = any || route[m] != 0.0f;
    }
    if (!any) return;
    for (maxc_u64 f0 = 0; f0 < ${FFN}; f0 += ${CHUNK}) {
        const maxc_u64 len = ${FFN} - f0 < ${CHUNK} ? ${FFN} - f0 : ${CHUNK};
        for (maxc_u64 f = warp; f < len; f += warps) {
            const maxc_u64 w_row = (f0 + f) * ${HIDDEN};
            float g[${TILE}];
            float u[${TILE}];
#pragma unroll
            for (int m = 0; m < ${TILE}; ++m) { g[m] = 0.0f; u[m] = 0.0f; }
            for (maxc_u64 c = lane; c < ${HIDDEN}; c += 32) {
                const float gw = maxc_ld(gate, w_row + c);
                const float uw = maxc_ld(up, w_row + c);
#pragma unroll
                for (int m = 0; m < ${TILE}; ++m) {
                    if (route[m] != 0.0f) {
                        const float xv = x[(row0 + m) * ${HIDDEN} + c];
                        g[m] += gw * xv;
                        u[m] += uw * xv;
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < ${TILE}; ++m) {
                if (route[m] != 0.0f) {
                    const float gs = maxc_warp_sum(g[m]);
                    const float us = maxc_warp_sum(u[m]);
                    if (lane == 0) h[m * ${CHUNK} + f] = maxc_silu(gs) * us;
                }
            }
        }
        __syncthreads();
        for (maxc_u64 j = warp; j < ${HIDDEN}; j += warps) {
            const maxc_u64 d_row = j * ${FFN} + f0;
            float y[${TILE}];
#pragma unroll
            for (int m = 0; m < ${TILE}; ++m) y[m] = 0.0f;
            for (maxc_u64 f = lane; f < len; f += 32) {
                const float dw = maxc_ld(down, d_row + f);
#pragma unroll
                for (int m = 0; m < ${TILE}; ++m)
                    if (route[m] != 0.0f) y[m] += dw * h[m * ${CHUNK} + f];
            }
#pragma unroll
            for (int m = 0; m < ${TILE}; ++m) {
                if (route[m] != 0.0f) {
                    const float ys = maxc_warp_sum(y[m]);
                    if (lane == 0) out[(row0 + m) * ${HIDDEN} + j] += route[m] * ys;
                }
            }
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
            "    {}_expert(x, routing, row0, ${{ROWS}}, {e}ULL, gate{e}, up{e}, down{e}, out, h);\n",
            cx.name
        ));
    }
    bufs.push(Buf::output("float", "out"));
    let body = fill(
        &format!(
            r#"
    const maxc_u64 row0 = (maxc_u64)blockIdx.x * ${{TILE}};
    if (row0 >= ${{ROWS}}) return;
    __shared__ float h[${{TILE}} * ${{CHUNK}}];
    // Zero the tile's rows with the ownership the experts use (warp j % warps, lane 0).
    for (maxc_u64 m = 0; m < ${{TILE}} && row0 + m < ${{ROWS}}; ++m)
        for (maxc_u64 j = threadIdx.x >> 5; j < ${{HIDDEN}}; j += blockDim.x >> 5)
            if ((threadIdx.x & 31u) == 0u) out[(row0 + m) * ${{HIDDEN}} + j] = 0.0f;
{calls}"#
        ),
        &[
            ("ROWS", rows_expr(rows)),
            ("CHUNK", ull(chunk)),
            ("HIDDEN", ull(hidden)),
            ("TILE", ull(TILE)),
        ],
    );
    let launch = CudaLaunch {
        grid: [
            GridExtent::CeilDiv { rows, by: TILE },
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
    };
    let source = format!(
        "{expert_fn}\n{}",
        source::kernel(cx.name, THREADS, &bufs, &body)
    );
    Ok((source, launch))
}
