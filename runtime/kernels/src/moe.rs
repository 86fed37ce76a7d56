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

/// The settings of a group-limited router (see `KernelBody::MoeRouter`).
#[derive(Clone, Copy, Debug)]
pub struct GroupedRouting {
    /// Experts chosen per row.
    pub top_k: usize,
    /// Groups of consecutive experts.
    pub n_group: usize,
    /// Groups kept per row.
    pub topk_group: usize,
    /// Scores are `sigmoid(logit)` (else the softmax over the row).
    pub sigmoid: bool,
    /// A group's score is the sum of its two largest choice scores (else its largest score).
    pub top_two: bool,
    /// The chosen weights are divided by their sum.
    pub renormalize: bool,
    /// What the chosen weights are multiplied by.
    pub scale: f32,
}

/// Group-limited top-k routing of `logits [rows, experts]` with the choice-score `bias
/// [experts]` into the dense routing matrix `out [rows, experts]` (zero for experts not chosen).
pub fn route_grouped(logits: &[f32], bias: &[f32], out: &mut [f32], r: &GroupedRouting) {
    let e = bias.len();
    if e == 0 {
        return;
    }
    let per = e / r.n_group.max(1);
    let mut s = vec![0.0f32; e];
    let mut c = vec![0.0f32; e];
    let mut group = vec![0.0f32; r.n_group];
    let mut order: Vec<usize> = Vec::with_capacity(e);
    for (row, orow) in logits.chunks_exact(e).zip(out.chunks_exact_mut(e)) {
        if r.sigmoid {
            for (s, &x) in s.iter_mut().zip(row) {
                *s = 1.0 / (1.0 + (-x).exp());
            }
        } else {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for (s, &x) in s.iter_mut().zip(row) {
                *s = (x - m).exp();
                sum += *s;
            }
            s.iter_mut().for_each(|v| *v /= sum);
        }
        for ((c, s), b) in c.iter_mut().zip(&s).zip(bias) {
            *c = s + b;
        }
        for (g, score) in group.iter_mut().enumerate() {
            let members = g * per..(g + 1) * per;
            *score = if r.top_two {
                let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in &c[members] {
                    if v > first {
                        (first, second) = (v, first);
                    } else if v > second {
                        second = v;
                    }
                }
                if per < 2 {
                    first
                } else {
                    first + second
                }
            } else {
                s[members].iter().copied().fold(f32::NEG_INFINITY, f32::max)
            };
        }
        // The kept groups: the `topk_group` best (ties: lower index).
        order.clear();
        order.extend(0..r.n_group);
        order.sort_by(|&a, &b| group[b].total_cmp(&group[a]).then(a.cmp(&b)));
        let mut kept = [false; 4096];
        for &g in &order[..r.topk_group] {
            kept[g] = true;
        }
        order.clear();
        order.extend((0..e).filter(|&x| kept[x / per]));
        order.sort_by(|&a, &b| c[b].total_cmp(&c[a]).then(a.cmp(&b)));
        let chosen = &order[..r.top_k.min(order.len())];
        let sum = chosen.iter().map(|&x| s[x]).sum::<f32>() + 1e-20;
        orow.fill(0.0);
        for &x in chosen {
            let w = if r.renormalize { s[x] / sum } else { s[x] };
            orow[x] = w * r.scale;
        }
    }
}

#[cfg(test)]
mod router_tests {
    use super::*;

    /// Hand-computed rows: a non-zero bias that moves the choice, a group kept by its top two
    /// though its best expert is not the best overall, and ties going to the lower index.
    #[test]
    fn grouped_routing_follows_the_bias_and_the_groups() {
        // 8 experts in 4 groups of 2, keep 2 groups, choose 2 experts.
        let r = GroupedRouting {
            top_k: 2,
            n_group: 4,
            topk_group: 2,
            sigmoid: true,
            top_two: true,
            renormalize: true,
            scale: 2.5,
        };
        let logit = |p: f32| (p / (1.0 - p)).ln(); // sigmoid⁻¹
                                                   // Scores: group 0 {0.9, 0.1} sum 1.0; group 1 {0.6, 0.6} sum 1.2; group 2 {0.5, 0.45}
                                                   // sum 0.95; group 3 {0.2, 0.2}. Kept: groups 1 and 0; chosen: experts 0 (0.9) and 2
                                                   // (0.6, the lower index of the tie 2/3).
        let s = [0.9, 0.1, 0.6, 0.6, 0.5, 0.45, 0.2, 0.2];
        let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
        let mut out = vec![0.0; 8];
        route_grouped(&logits, &[0.0; 8], &mut out, &r);
        let want0 = 0.9 / 1.5 * 2.5;
        let want2 = 0.6 / 1.5 * 2.5;
        assert!(
            (out[0] - want0).abs() < 1e-5 && (out[2] - want2).abs() < 1e-5,
            "{out:?}"
        );
        assert_eq!(out.iter().filter(|&&w| w != 0.0).count(), 2, "{out:?}");
        // A bias of 1.0 on expert 6 makes group 3 score 1.4 (kept with group 1) and expert 6
        // the first choice, weighted by its unbiased score 0.2; then expert 2 (0.6).
        let mut bias = [0.0; 8];
        bias[6] = 1.0;
        route_grouped(&logits, &bias, &mut out, &r);
        let sum = 0.2 + 0.6;
        assert!((out[6] - 0.2 / sum * 2.5).abs() < 1e-5, "{out:?}");
        assert!((out[2] - 0.6 / sum * 2.5).abs() < 1e-5, "{out:?}");
        // Negative biased scores: groups 3 and 1 are kept, and the third choice is expert 2
        // (choice score -1.4), not an expert of a masked group (a mask filling them with 0
        // would have chosen expert 0).
        let bias = [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0, 0.0, 0.0];
        let three = GroupedRouting { top_k: 3, ..r };
        route_grouped(&logits, &bias, &mut out, &three);
        let chosen: Vec<usize> = (0..8).filter(|&x| out[x] != 0.0).collect();
        assert_eq!(chosen, vec![2, 6, 7], "{out:?}");
    }
}
