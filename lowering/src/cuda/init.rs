//! The init kernels of the `ep_init` program: zeroed state and a rank's experts.

use super::source::{self, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, DType, GridExtent, Rows};

/// Threads per block of the init kernels.
const THREADS: u32 = 256;

/// [`maxc_schema::KernelBody::Zeros`]: one thread per element, stored at its width.
pub(crate) fn emit_zeros(cx: Ctx, elements: u64, dtype: DType) -> Result<Emitted, CudaError> {
    let n = cx.size("elements", elements)?;
    cx.product("the buffer's bytes", &[n, dtype.size() as u64])?;
    let ty = match dtype.size() {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        _ => {
            return Err(cx.invalid(format!(
                "zeros of {dtype}, expected a 1-, 2-, 4- or 8-byte type"
            )))
        }
    };
    let body = source::fill(
        r#"
    const maxc_u64 i = (maxc_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < ${N}) out[i] = 0;
"#,
        &[("N", source::ull(n))],
    );
    let launch = CudaLaunch {
        grid: [
            GridExtent::CeilDiv {
                rows: Rows::Fixed(n),
                by: u64::from(THREADS),
            },
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
    };
    Ok((
        source::kernel(cx.name, THREADS, &[Buf::output(ty, "out")], &body),
        launch,
    ))
}

/// [`maxc_schema::KernelBody::RankExperts`]: one block, `out[i] = rank[0] · per + i`.
pub(crate) fn emit_rank_experts(cx: Ctx, experts_per_rank: u64) -> Result<Emitted, CudaError> {
    let per = cx.size("experts_per_rank", experts_per_rank)?;
    let threads = source::row_threads(per, THREADS);
    let body = source::fill(
        r#"
    for (maxc_u64 i = threadIdx.x; i < ${PER}; i += blockDim.x)
        out[i] = (int)((long long)rank[0] * (long long)${PER} + (long long)i);
"#,
        &[("PER", source::ull(per))],
    );
    let bufs = [Buf::input("int", "rank"), Buf::output("int", "out")];
    let launch = CudaLaunch {
        grid: [
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}
