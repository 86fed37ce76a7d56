//! The MoE experts: SwiGLU experts on the f32 matmuls of [`crate::gemm`], each expert's tokens
//! gathered so that its weights are read once per step.

use crate::gemm::{matmul, splits};

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
        let chunks = crate::pool::threads().min(used.len());
        crate::pool::run(chunks, &|c| {
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
