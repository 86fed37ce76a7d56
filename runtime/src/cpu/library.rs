//! Library kernels of the CPU executor: matmuls on the `gemm` crate, and the MoE experts built
//! on them. Weights reach them as f32.

use gemm::Parallelism;

/// Splits of a matmul of `macs` multiply-adds across the executor's threads: small ones run on
/// the calling thread.
fn splits(macs: usize) -> usize {
    if macs < 1 << 21 {
        1
    } else {
        super::pool::threads()
    }
}

#[derive(Clone, Copy)]
struct Ptr(*mut f32);
// SAFETY: each split writes its own output columns.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}
impl Ptr {
    fn get(self) -> *mut f32 {
        self.0
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
    if super::weights::tiles_available() && rows >= 32 {
        super::weights::packed_f32(x, w, out, rows, n, k, super::pool::threads());
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
    let o = Ptr(out.as_mut_ptr());
    super::pool::run(chunks, &|c| {
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

/// One SwiGLU expert over `m` rows `xs` (`m × hidden`): `down · (silu(gate · x) ⊙ (up · x))`,
/// `m × hidden`.
pub fn swiglu_expert(
    xs: &[f32],
    gate: &[f32],
    up: &[f32],
    down: &[f32],
    m: usize,
    hidden: usize,
    ffn: usize,
) -> Vec<f32> {
    let mut g = vec![0.0; m * ffn];
    let mut u = vec![0.0; m * ffn];
    matmul(xs, gate, None, &mut g, m, ffn, hidden);
    matmul(xs, up, None, &mut u, m, ffn, hidden);
    for (g, u) in g.iter_mut().zip(&u) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
    let mut y = vec![0.0; m * hidden];
    matmul(&g, down, None, &mut y, m, hidden, ffn);
    y
}

/// SwiGLU experts weighted by a dense routing matrix (see `KernelBody::MoeExperts`). Each
/// expert's rows are gathered (its weights read once per step), run as three matmuls, and added
/// back weighted, each row's experts in order. Where every expert's matmuls are too small to
/// split across threads (decode, short prefill chunks), the experts themselves run in parallel,
/// one thread each; the sums stay in expert order, so the result is the same either way.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    x: &[f32],
    routing: &[f32],
    experts: &[(&[f32], &[f32], &[f32])],
    out: &mut [f32],
    rows: usize,
    hidden: usize,
    ffn: usize,
) {
    let e_count = experts.len();
    out[..rows * hidden].fill(0.0);
    let picked: Vec<Vec<usize>> = (0..e_count)
        .map(|e| {
            (0..rows)
                .filter(|&t| routing[t * e_count + e] != 0.0)
                .collect()
        })
        .collect();
    let run = |e: usize| -> Option<Vec<f32>> {
        let rows_e = &picked[e];
        if rows_e.is_empty() {
            return None;
        }
        let m = rows_e.len();
        let mut xs = Vec::with_capacity(m * hidden);
        for &t in rows_e {
            xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let (gate, up, down) = experts[e];
        Some(swiglu_expert(&xs, gate, up, down, m, hidden, ffn))
    };
    let used: Vec<usize> = (0..e_count).filter(|&e| !picked[e].is_empty()).collect();
    let largest = used.iter().map(|&e| picked[e].len()).max().unwrap_or(0) * ffn * hidden;
    let ys: Vec<Option<Vec<f32>>> = if used.len() > 1 && splits(largest) == 1 {
        // Each matmul runs on its caller's thread (below the split threshold), so experts
        // spread over the pool's threads without nesting jobs.
        let slots: Vec<std::sync::Mutex<Option<Vec<f32>>>> =
            (0..e_count).map(|_| std::sync::Mutex::new(None)).collect();
        let chunks = super::pool::threads().min(used.len());
        super::pool::run(chunks, &|c| {
            for &e in used.iter().skip(c).step_by(chunks) {
                let y = run(e);
                *slots[e].lock().unwrap_or_else(|p| p.into_inner()) = y;
            }
        });
        slots
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()))
            .collect()
    } else {
        (0..e_count).map(run).collect()
    };
    for (e, y) in ys.iter().enumerate() {
        let Some(y) = y else { continue };
        for (i, &t) in picked[e].iter().enumerate() {
            let w = routing[t * e_count + e];
            for (o, v) in out[t * hidden..(t + 1) * hidden]
                .iter_mut()
                .zip(&y[i * hidden..(i + 1) * hidden])
            {
                *o += w * v;
            }
        }
    }
}
