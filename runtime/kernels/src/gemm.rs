//! f32 matmuls on the `gemm` crate (and the AVX-512 packed tiles for many rows).

use gemm::Parallelism;

/// Splits of a matmul of `macs` multiply-adds across the executor's threads: small ones run on
/// the calling thread.
pub(crate) fn splits(macs: usize) -> usize {
    if macs < 1 << 21 {
        1
    } else {
        crate::pool::threads()
    }
}

/// `out[rows, j0..j1] = x[rows, k] · w[j0..j1, k]ᵀ` with one `gemm` call on this thread.
///
/// # Safety
/// `out` points to `rows × n` values; `x` holds `rows × k`, `w` at least `j1 × k`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_columns(
    x: &[f32],
    w: &[f32],
    out: *mut f32,
    rows: usize,
    n: usize,
    k: usize,
    j0: usize,
    j1: usize,
) {
    // SAFETY: as the caller guarantees; strides describe x row-major, wᵀ via w's rows, and
    // the output columns j0..j1 of each row.
    unsafe {
        gemm::gemm::<f32>(
            rows,
            j1 - j0,
            k,
            out.add(j0),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr().add(j0 * k),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `out[rows, n] = x[rows, k] · w[n, k]ᵀ (+ bias)`, output columns split across the
/// executor's threads.
pub fn matmul(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
) {
    debug_assert!(x.len() >= rows * k && w.len() >= n * k && out.len() >= rows * n);
    if rows == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::tiles_available() && rows >= 32 {
        crate::matmul::tile::packed_f32(x, w, out, rows, n, k, crate::pool::threads());
        if let Some(b) = bias {
            for row in out[..rows * n].chunks_exact_mut(n) {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
        return;
    }
    let chunks = splits(rows * n * k).min(n.div_ceil(16));
    let o = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        // Column ranges on 16-column boundaries, disjoint across calls.
        let (j0, j1) = ((n * c / chunks) & !15, (n * (c + 1) / chunks) & !15);
        let j1 = if c + 1 == chunks { n } else { j1 };
        // SAFETY: the slices hold rows·k, n·k and rows·n elements (checked above in debug
        // builds and guaranteed by the program's buffer sizes).
        unsafe { gemm_columns(x, w, o.get(), rows, n, k, j0, j1) };
    });
    if let Some(b) = bias {
        for row in out[..rows * n].chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}
