//! The tensor-core matmul for bf16/f16 weights (sm_80+): `mma.sync.aligned.m16n8k16` with f32
//! accumulators; the f32 activations are rounded to the weight type as they enter the tile.

use super::matmul_shape::Shape;
use super::source::{self, fill, rows_expr, ull, Ctx};
use super::Emitted;
use maxc_schema::CudaLaunch;

/// Output tile (rows × columns) of one block.
const TILE: u64 = 64;
/// Threads: four warps in a 2 × 2 layout, each owning a 32 × 32 quarter of the tile.
const THREADS: u32 = 128;

/// The kernel: per 32-wide `k` step the block stages `x[64 rows, 32]` (rounded to bf16/f16)
/// and `w[64 columns, 32]` (copied bit for bit) in shared memory as packed pairs along `k`,
/// zero outside `rows`, `n` and `k`; each warp then issues, per 16-wide half, 2 × 4
/// `m16n8k16` products (A = x rows, row-major; B = w rows, i.e. `wᵀ` column-major) into
/// 2 × 4 × 4 f32 accumulators per lane, finally adding the bias and storing under guards.
/// Pair rows are 20 words apart, so the fragment loads of a warp hit 32 distinct banks.
pub(crate) fn emit(cx: Ctx, shape: &Shape, bf16: bool) -> Emitted {
    let (cvt, mma) = if bf16 {
        ("maxc_bf16_bits", "maxc_mma_bf16")
    } else {
        ("maxc_f16_bits", "maxc_mma_f16")
    };
    let body = fill(
        r#"
    // xs[rr][kp] = x[row0 + rr, k0 + 2kp .. +1], ws[cc][kp] = w[col0 + cc, k0 + 2kp .. +1]:
    // 16-bit pairs, lower k in the low half; 16 pairs per row, padded to 20 words.
    __shared__ __align__(16) unsigned xs[64][20];
    __shared__ __align__(16) unsigned ws[64][20];
    const maxc_u64 rows = ${ROWS};
    const maxc_u64 col0 = (maxc_u64)blockIdx.x * 64;
    const maxc_u64 row0 = (maxc_u64)blockIdx.y * 64;
    if (row0 >= rows) return;
    const unsigned short* w_bits = reinterpret_cast<const unsigned short*>(w);
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned g = lane >> 2;
    const unsigned t = lane & 3u;
    const unsigned wm = (warp >> 1) * 32u;
    const unsigned wn = (warp & 1u) * 32u;
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;
    for (maxc_u64 k0 = 0; k0 < ${K}; k0 += 32) {
        for (unsigned e = threadIdx.x; e < 64u * 16u; e += blockDim.x) {
            const unsigned rr = e >> 4;
            const unsigned kp = e & 15u;
            const maxc_u64 kg = k0 + 2u * kp;
            const maxc_u64 row = row0 + rr;
            unsigned lo = 0u, hi = 0u;
            if (row < rows) {
                const float* x_row = x + row * ${K};
                if (kg < ${K}) lo = ${CVT}(x_row[kg]);
                if (kg + 1 < ${K}) hi = ${CVT}(x_row[kg + 1]);
            }
            xs[rr][kp] = lo | (hi << 16);
            const maxc_u64 col = col0 + rr;
            lo = 0u;
            hi = 0u;
            if (col < ${N}) {
                const unsigned short* w_row = w_bits + col * ${K};
                if (kg < ${K}) lo = w_row[kg];
                if (kg + 1 < ${K}) hi = w_row[kg + 1];
            }
            ws[rr][kp] = lo | (hi << 16);
        }
        __syncthreads();
#pragma unroll
        for (unsigned ks = 0; ks < 16u; ks += 8u) {
            unsigned a[2][4];
            unsigned b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const unsigned r0 = wm + 16u * mi + g;
                a[mi][0] = xs[r0][ks + t];
                a[mi][1] = xs[r0 + 8u][ks + t];
                a[mi][2] = xs[r0][ks + t + 4u];
                a[mi][3] = xs[r0 + 8u][ks + t + 4u];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const unsigned c0 = wn + 8u * ni + g;
                b[ni][0] = ws[c0][ks + t];
                b[ni][1] = ws[c0][ks + t + 4u];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) ${MMA}(acc[mi][ni], a[mi], b[ni]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const maxc_u64 col = col0 + wn + 8u * ni + 2u * t + c;
            if (col >= ${N}) continue;
            const float bias_v = ${BIAS};
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const maxc_u64 row = row0 + wm + 16u * mi + g;
                if (row < rows) out[row * ${N} + col] = acc[mi][ni][c] + bias_v;
                if (row + 8u < rows) out[(row + 8u) * ${N} + col] = acc[mi][ni][2 + c] + bias_v;
            }
        }
    }
"#,
        &[
            ("ROWS", rows_expr(shape.rows)),
            ("N", ull(shape.n)),
            ("K", ull(shape.k)),
            ("CVT", cvt.to_string()),
            ("MMA", mma.to_string()),
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
