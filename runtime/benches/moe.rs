//! `cargo bench -p maxc-runtime --bench moe`: one MoE layer (SwiGLU experts, top-2 routing)
//! before and after grouping tokens by expert, at tiny-mixtral's shapes and at a wider layer
//! whose experts do not fit in the caches, for decode (1 and 8 rows) and prefill (128 rows).
//!
//! "Before" runs each token's experts alone (every expert's weights read once per token that
//! chose it, as an ungrouped kernel does); "after" is the runtime's kernel, which gathers each
//! expert's tokens and reads its weights once per step. Both in the same run, medians of
//! interleaved repetitions; the ratio is before / after.

use maxc_kernels::moe::{moe_experts, swiglu_expert};
use std::time::Instant;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 0.1
        })
        .collect()
}

/// Each token's experts alone: `experts[e]` once per token routed to `e`.
#[allow(clippy::too_many_arguments)]
fn per_token(
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
    for t in 0..rows {
        for (e, (gate, up, down)) in experts.iter().enumerate() {
            let w = routing[t * e_count + e];
            if w == 0.0 {
                continue;
            }
            let y = swiglu_expert(
                &x[t * hidden..(t + 1) * hidden],
                gate,
                up,
                down,
                1,
                hidden,
                ffn,
            );
            for (o, v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&y) {
                *o += w * v;
            }
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    println!("{} threads", rayon::current_num_threads());
    // (name, hidden, ffn, experts, top_k)
    let shapes = [
        ("tiny-mixtral", 256usize, 344usize, 4usize, 2usize),
        ("wide (experts 88 MB, out of cache)", 512, 1792, 8, 2),
    ];
    for (name, hidden, ffn, n_exp, top_k) in shapes {
        let weights: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..n_exp as u64)
            .map(|e| {
                (
                    values(ffn * hidden, 3 * e + 1),
                    values(ffn * hidden, 3 * e + 2),
                    values(hidden * ffn, 3 * e + 3),
                )
            })
            .collect();
        let refs: Vec<(&[f32], &[f32], &[f32])> = weights
            .iter()
            .map(|(g, u, d)| (&g[..], &u[..], &d[..]))
            .collect();
        println!("{name}: hidden {hidden}, ffn {ffn}, {n_exp} experts, top-{top_k}");
        for rows in [1usize, 8, 128] {
            let x = values(rows * hidden, 99);
            // Each token's top_k experts: a spread that uses every expert.
            let mut routing = vec![0.0f32; rows * n_exp];
            for t in 0..rows {
                for j in 0..top_k {
                    let e = (t * 7 + j * 3 + t / 3) % n_exp;
                    routing[t * n_exp + e] += 1.0 / (j + 1) as f32;
                }
            }
            let mut a = vec![0.0; rows * hidden];
            let mut b = vec![0.0; rows * hidden];
            per_token(&x, &routing, &refs, &mut a, rows, hidden, ffn);
            moe_experts(&x, &routing, &refs, &mut b, rows, hidden, ffn);
            let diff = a
                .iter()
                .zip(&b)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-4, "the two agree ({diff})");
            let reps = if rows >= 128 { 9 } else { 31 };
            let (mut before, mut after) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let t = Instant::now();
                per_token(&x, &routing, &refs, &mut a, rows, hidden, ffn);
                before.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                moe_experts(&x, &routing, &refs, &mut b, rows, hidden, ffn);
                after.push(t.elapsed().as_secs_f64());
            }
            let (bm, am) = (median(before), median(after));
            println!(
                "  rows {rows:>3}: before {:>9.3} ms   after {:>9.3} ms   before/after {:>5.2}x",
                bm * 1e3,
                am * 1e3,
                bm / am
            );
        }
    }
}
