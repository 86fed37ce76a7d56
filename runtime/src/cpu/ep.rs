//! Expert parallelism on the CPU: `degree` ranks in one process, each holding
//! `experts / degree` consecutive experts, exchanging token slots through buffers sized once
//! from the artifact's records (see `runtime/docs/expert-parallelism.md`).
//!
//! A step's token rows are split evenly over the ranks (rank `r` owns a contiguous share). Per
//! MoE layer: **dispatch** copies each owned token's hidden state, once per chosen expert, into
//! the receive buffer of the rank holding that expert; each rank runs its received slots
//! grouped by expert (every expert's weights read once); **combine** sends each result back to
//! its token's rank, which adds them weighted, in expert order. A count above
//! `max_tokens_per_rank` fails the step before anything is written past a buffer.

use crate::error::{Result, RuntimeError};
use std::collections::BTreeMap;

/// The deployment the artifact records (`ep.degree`, `ep.max_tokens_per_rank`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpPlan {
    /// Ranks.
    pub degree: usize,
    /// Experts per rank.
    pub experts_per_rank: usize,
    /// Slots one rank may receive in a step (the worst case).
    pub max_tokens_per_rank: usize,
    /// Hidden size (a slot's width).
    pub hidden: usize,
}

impl EpPlan {
    /// The plan of an artifact's records; `None` without expert parallelism (degree 1 or no
    /// records). A record of the wrong type is an error naming it.
    pub fn from_records(records: &BTreeMap<String, serde_json::Value>) -> Result<Option<Self>> {
        let Some(d) = records.get("ep.degree") else {
            return Ok(None);
        };
        let num = |k: &str| -> Result<usize> {
            records
                .get(k)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    RuntimeError::Input(format!(
                        "the artifact's export record `{k}` is missing or not a whole number"
                    ))
                })
        };
        let degree = d.as_u64().map(|v| v as usize).ok_or_else(|| {
            RuntimeError::Input(
                "the artifact's export record `ep.degree` is not a whole number".into(),
            )
        })?;
        if degree <= 1 {
            return Ok(None);
        }
        Ok(Some(EpPlan {
            degree,
            experts_per_rank: num("ep.experts_per_rank")?,
            max_tokens_per_rank: num("ep.max_tokens_per_rank")?,
            hidden: num("moe.hidden_size")?,
        }))
    }
}

/// One rank's exchange state: the dispatch group (received slots: hidden states, their source
/// token and expert and weight) and the combine group (results of the received slots).
#[derive(Debug)]
struct Rank {
    recv: Vec<f32>,
    recv_meta: Vec<(u32, u32, f32)>,
    results: Vec<f32>,
}

/// N in-process ranks and their exchange buffers, allocated once at their bounds.
#[derive(Debug)]
pub struct InProcessExchange {
    plan: EpPlan,
    ranks: Vec<Rank>,
    /// The most slots any rank received in one layer so far (for tests and metrics).
    pub peak_slots: usize,
}

impl InProcessExchange {
    /// The exchange of `plan`, every buffer allocated at its bound.
    pub fn new(plan: EpPlan) -> Self {
        let ranks = (0..plan.degree)
            .map(|_| Rank {
                recv: vec![0.0; plan.max_tokens_per_rank * plan.hidden],
                recv_meta: Vec::with_capacity(plan.max_tokens_per_rank),
                results: vec![0.0; plan.max_tokens_per_rank * plan.hidden],
            })
            .collect();
        InProcessExchange {
            plan,
            ranks,
            peak_slots: 0,
        }
    }

    /// The plan.
    pub fn plan(&self) -> &EpPlan {
        &self.plan
    }

    /// SwiGLU experts (`experts[e] = (gate, up, down)`) weighted by the dense `routing`
    /// (`rows × experts`), over the ranks: dispatch, grouped expert compute, combine.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts(
        &mut self,
        x: &[f32],
        routing: &[f32],
        experts: &[(&[f32], &[f32], &[f32])],
        out: &mut [f32],
        rows: usize,
        hidden: usize,
        ffn: usize,
    ) -> Result<()> {
        let (d, per) = (self.plan.degree, self.plan.experts_per_rank);
        let e_count = experts.len();
        if hidden != self.plan.hidden || per * d != e_count {
            return Err(RuntimeError::Input(format!(
                "expert parallelism: the kernel has {e_count} experts of width {hidden}; the records say {d} ranks × {per} experts of width {}",
                self.plan.hidden
            )));
        }
        // Dispatch: every rank's tokens, in token order, each to the ranks of its experts.
        for r in &mut self.ranks {
            r.recv_meta.clear();
        }
        // Rank `src` owns rows [src·rows/d, (src+1)·rows/d).
        for src in 0..d {
            for t in src * rows / d..(src + 1) * rows / d {
                for e in 0..e_count {
                    let w = routing[t * e_count + e];
                    if w == 0.0 {
                        continue;
                    }
                    let dest = &mut self.ranks[e / per];
                    let slot = dest.recv_meta.len();
                    if slot >= self.plan.max_tokens_per_rank {
                        return Err(RuntimeError::Input(format!(
                            "expert parallelism: rank {} received more than max_tokens_per_rank ({}) slots",
                            e / per,
                            self.plan.max_tokens_per_rank
                        )));
                    }
                    dest.recv[slot * hidden..(slot + 1) * hidden]
                        .copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
                    dest.recv_meta.push((t as u32, e as u32, w));
                }
            }
        }
        // Each rank: its slots grouped by expert, every expert's weights read once.
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            self.peak_slots = self.peak_slots.max(rank.recv_meta.len());
            for le in 0..per {
                let e = r * per + le;
                let picked: Vec<usize> = (0..rank.recv_meta.len())
                    .filter(|&s| rank.recv_meta[s].1 as usize == e)
                    .collect();
                if picked.is_empty() {
                    continue;
                }
                let m = picked.len();
                let mut xs = Vec::with_capacity(m * hidden);
                for &s in &picked {
                    xs.extend_from_slice(&rank.recv[s * hidden..(s + 1) * hidden]);
                }
                let (gate, up, down) = experts[e];
                let y = super::library::swiglu_expert(&xs, gate, up, down, m, hidden, ffn);
                for (i, &s) in picked.iter().enumerate() {
                    rank.results[s * hidden..(s + 1) * hidden]
                        .copy_from_slice(&y[i * hidden..(i + 1) * hidden]);
                }
            }
        }
        // Combine: each token adds its results weighted, in expert order (as on one rank).
        out[..rows * hidden].fill(0.0);
        let mut slots: Vec<(u32, u32, usize, usize)> = Vec::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            for (s, &(t, e, _)) in rank.recv_meta.iter().enumerate() {
                slots.push((t, e, r, s));
            }
        }
        slots.sort_unstable();
        for (t, _, r, s) in slots {
            let rank = &self.ranks[r];
            let w = rank.recv_meta[s].2;
            let t = t as usize;
            for (o, v) in out[t * hidden..(t + 1) * hidden]
                .iter_mut()
                .zip(&rank.results[s * hidden..(s + 1) * hidden])
            {
                *o += w * v;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{EpPlan, InProcessExchange};
    use crate::cpu::library;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    struct Layer {
        weights: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    }

    impl Layer {
        fn new(experts: usize, hidden: usize, ffn: usize) -> Self {
            let weights = (0..experts as u64)
                .map(|e| {
                    (
                        values(ffn * hidden, 3 * e + 1),
                        values(ffn * hidden, 3 * e + 2),
                        values(hidden * ffn, 3 * e + 3),
                    )
                })
                .collect();
            Layer { weights }
        }
        fn refs(&self) -> Vec<(&[f32], &[f32], &[f32])> {
            self.weights
                .iter()
                .map(|(g, u, d)| (&g[..], &u[..], &d[..]))
                .collect()
        }
    }

    /// A crafted router that sends every token to experts 0 and 1: the worst case for the
    /// rank(s) holding them, which must receive exactly the bound and no more.
    #[test]
    fn a_router_sending_every_token_to_one_rank_fills_it_exactly_to_the_bound() {
        let (experts, hidden, ffn, rows, top_k) = (4, 8, 6, 5, 2);
        let layer = Layer::new(experts, hidden, ffn);
        let x = values(rows * hidden, 99);
        let mut routing = vec![0.0f32; rows * experts];
        for t in 0..rows {
            routing[t * experts] = 0.6;
            routing[t * experts + 1] = 0.4;
        }
        let mut want = vec![0.0; rows * hidden];
        library::moe_experts(&x, &routing, &layer.refs(), &mut want, rows, hidden, ffn);
        for degree in [2usize, 4] {
            let per = experts / degree;
            // The records' bound at these settings (max_batch_active_tokens = rows).
            let bound = rows * top_k.min(per);
            let plan = EpPlan {
                degree,
                experts_per_rank: per,
                max_tokens_per_rank: bound,
                hidden,
            };
            let mut ex = InProcessExchange::new(plan);
            let mut got = vec![0.0; rows * hidden];
            ex.moe_experts(&x, &routing, &layer.refs(), &mut got, rows, hidden, ffn)
                .unwrap();
            assert_eq!(
                ex.peak_slots, bound,
                "degree {degree}: one rank at the bound"
            );
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(d < 1e-5, "degree {degree}: max |diff| {d} against one rank");
            // One slot less room: the step fails cleanly instead of writing past the buffer.
            let mut small = InProcessExchange::new(EpPlan {
                max_tokens_per_rank: bound - 1,
                ..plan
            });
            let e = small
                .moe_experts(&x, &routing, &layer.refs(), &mut got, rows, hidden, ffn)
                .unwrap_err()
                .to_string();
            assert!(e.contains("max_tokens_per_rank"), "{e}");
        }
    }

    #[test]
    fn spread_routing_matches_one_rank() {
        let (experts, hidden, ffn, rows) = (4, 16, 12, 9);
        let layer = Layer::new(experts, hidden, ffn);
        let x = values(rows * hidden, 7);
        let mut routing = vec![0.0f32; rows * experts];
        for t in 0..rows {
            routing[t * experts + t % experts] = 0.7;
            routing[t * experts + (t * 3 + 1) % experts] += 0.3;
        }
        let mut want = vec![0.0; rows * hidden];
        library::moe_experts(&x, &routing, &layer.refs(), &mut want, rows, hidden, ffn);
        for degree in [1usize, 2, 4] {
            let mut ex = InProcessExchange::new(EpPlan {
                degree,
                experts_per_rank: experts / degree,
                max_tokens_per_rank: rows * 2,
                hidden,
            });
            let mut got = vec![0.0; rows * hidden];
            ex.moe_experts(&x, &routing, &layer.refs(), &mut got, rows, hidden, ffn)
                .unwrap();
            assert_eq!(
                got, want,
                "degree {degree}: the same sums in the same order"
            );
        }
    }
}
