//! Matrix multiplication by a transposed weight, `out = x · wᵀ (+ bias)`: a shared-memory tiled
//! f32 kernel, or the tensor-core kernel of [`super::mma`] for bf16/f16 weights on sm_80+.

use super::matmul_shape::Shape;
use super::mma;
use super::source::{self, fill, rows_expr, ull, Ctx};
use super::{CudaError, CudaTarget, Emitted};
use maxc_schema::{CudaLaunch, DType, Rows};

/// Output tile (rows × columns) of one block of the f32 kernel.
const TILE: u64 = 64;
/// `k` values per shared-memory step of the f32 kernel.
const TILE_K: u64 = 16;
/// Threads of the f32 kernel: 16 × 16, each computing 4 × 4 outputs.
const THREADS: u32 = 256;

/// Emits [`maxc_schema::KernelBody::Matmul`]: the tensor-core kernel for bf16/f16
/// weights when the target has `mma.sync` (sm_80+), the tiled f32 kernel otherwise.
pub(crate) fn emit(
    cx: Ctx,
    target: &CudaTarget,
    rows: Rows,
    n: u64,
    k: u64,
    weight_dtype: DType,
    bias: bool,
) -> Result<Emitted, CudaError> {
    let n = cx.size("n", n)?;
    let k = cx.size("k", k)?;
    cx.product("weight elements (n × k)", &[n, k])?;
    let w_ty = cx.float_type("weight_dtype", weight_dtype)?;
    if n.div_ceil(TILE) > u64::from(u32::MAX >> 1) {
        return Err(cx.invalid(format!("`n` is {n}, too many column tiles for grid x")));
    }
    let shape = Shape {
        rows,
        n,
        k,
        w_ty,
        bias,
    };
    match weight_dtype {
        DType::BF16 | DType::F16 if target.has_mma_bf16() => {
            Ok(mma::emit(cx, &shape, weight_dtype == DType::BF16))
        }
        _ => Ok(emit_tiled(cx, &shape)),
    }
}

/// The tiled f32 kernel: a block computes a 64 × 64 output tile; per 16-wide `k` step it stages
/// `x[64 rows, 16]` and `w[64 columns, 16]` (widened to f32, zero outside the bounds) in
/// shared memory, transposed so each thread reads a column of each; thread `(tx, ty)` of the
/// 16 × 16 block accumulates rows `ty + 16i` and columns `tx + 16j`, `i, j < 4`.
fn emit_tiled(cx: Ctx, shape: &Shape) -> Emitted {
    let body = fill(
        r#"
    // xs[kk][rr] = x[row0 + rr, k0 + kk], ws[kk][cc] = w[col0 + cc, k0 + kk]; +1 pads banks.
    __shared__ float xs[${TK}][${TILE} + 1];
    __shared__ float ws[${TK}][${TILE} + 1];
    const maxc_u64 rows = ${ROWS};
    const maxc_u64 col0 = (maxc_u64)blockIdx.x * ${TILE};
    const maxc_u64 row0 = (maxc_u64)blockIdx.y * ${TILE};
    if (row0 >= rows) return;
    const unsigned tx = threadIdx.x & 15u;
    const unsigned ty = threadIdx.x >> 4;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (maxc_u64 k0 = 0; k0 < ${K}; k0 += ${TK}) {
        for (unsigned e = threadIdx.x; e < ${TILE} * ${TK}; e += blockDim.x) {
            const unsigned rr = e / ${TK};
            const unsigned kk = e % ${TK};
            const maxc_u64 kg = k0 + kk;
            const maxc_u64 row = row0 + rr;
            const maxc_u64 col = col0 + rr;
            xs[kk][rr] = (row < rows && kg < ${K}) ? x[row * ${K} + kg] : 0.0f;
            ws[kk][rr] = (col < ${N} && kg < ${K}) ? maxc_ld(w, col * ${K} + kg) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (unsigned kk = 0; kk < ${TK}; ++kk) {
            float a[4];
            float bw[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bw[j] = ws[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * bw[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const maxc_u64 col = col0 + tx + 16 * j;
        if (col >= ${N}) continue;
        const float bias_v = ${BIAS};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const maxc_u64 row = row0 + ty + 16 * i;
            if (row < rows) out[row * ${N} + col] = acc[i][j] + bias_v;
        }
    }
"#,
        &[
            ("ROWS", rows_expr(shape.rows)),
            ("N", ull(shape.n)),
            ("K", ull(shape.k)),
            ("TILE", TILE.to_string()),
            ("TK", TILE_K.to_string()),
            ("BIAS", shape.bias_expr("col")),
        ],
    );
    let launch = CudaLaunch {
        grid: shape.grid(TILE, TILE),
        block: [THREADS, 1, 1],
        shared_bytes: 0,
    };
    (
        source::kernel(cx.name, THREADS, &shape.bufs(), &body),
        launch,
    )
}
