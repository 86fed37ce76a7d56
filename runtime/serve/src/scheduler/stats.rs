//! What one step of the scheduler did, as numbers: the scheduler's phases fill a
//! [`StepStats`] and write no metric; [`StepStats::record`] turns it into MAX's serve metrics.

use crate::metrics::{BatchType, Metrics};

/// One step's statistics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Requests that finished, failed or were cancelled.
    pub finished: usize,
    /// Requests preempted for lack of pages.
    pub preempted: usize,
    /// First admissions: each request's prompt tokens served from the prefix cache and its
    /// prompt length (where prefix caching is on).
    pub admissions: Vec<(usize, usize)>,
    /// Cache pages that first admissions found in the prefix cache.
    pub blocks_served: usize,
    /// The pass that ran, if one did.
    pub batch: Option<BatchStats>,
    /// Data-parallel occupancy, where more than one replica runs.
    pub replicas: Option<ReplicaStats>,
    /// Draft tokens examined and accepted per position, where a draft proposed.
    pub acceptance: Option<AcceptanceStats>,
    /// The queues and the KV cache after the step.
    pub gauges: Gauges,
}

/// The forward pass of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchStats {
    /// Context encoding (some prefill row) or token generation.
    pub batch_type: BatchType,
    /// Sequences in the pass.
    pub sequences: usize,
    /// Token rows in the pass (draft tokens included).
    pub tokens: usize,
    /// Context tokens after the pass, summed over its sequences.
    pub context_tokens: usize,
    /// Time to plan it, in milliseconds.
    pub creation_ms: f64,
    /// Time to execute it, in milliseconds.
    pub exec_ms: f64,
    /// Requests that finished with it.
    pub finished: usize,
}

/// Data-parallel occupancy of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaStats {
    /// Token rows planned, over every replica.
    pub tokens: usize,
    /// Token rows the replicas could take.
    pub token_capacity: usize,
    /// Contexts running.
    pub contexts: usize,
    /// Contexts the replicas could hold.
    pub context_capacity: usize,
}

/// Speculative acceptance of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcceptanceStats {
    /// `(proposed, accepted)` per draft position.
    pub positions: Vec<(u64, u64)>,
    /// Sequences that proposed.
    pub sequences: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
}

impl AcceptanceStats {
    /// One sequence proposed `proposed` tokens and `accepted` of them were accepted.
    pub fn add(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if self.positions.len() < proposed {
            self.positions.resize(proposed, (0, 0));
        }
        for (j, p) in self.positions.iter_mut().take(proposed).enumerate() {
            p.0 += 1;
            p.1 += u64::from(j < accepted);
        }
        self.sequences += 1;
        self.accepted += accepted as u64;
    }
}

/// Queue lengths and KV occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Requests waiting for admission.
    pub queued: usize,
    /// Requests admitted.
    pub running: usize,
    /// KV pages in use (the prefix cache's included).
    pub used_pages: usize,
    /// KV pages in all.
    pub total_pages: usize,
    /// KV pages only the prefix cache holds.
    pub cached_only_pages: usize,
}

impl Gauges {
    /// Records the gauges.
    pub fn record(&self, m: &Metrics) {
        m.kv(self.used_pages, self.total_pages);
        m.cache_prefix_only_blocks
            .set(self.cached_only_pages as i64);
        m.num_requests_queued.set(self.queued as i64);
        m.num_requests_running.set(self.running as i64);
    }
}

impl StepStats {
    /// Records the step in `m`.
    pub fn record(&self, m: &Metrics) {
        for &(hit, prompt) in &self.admissions {
            m.cache_hits
                .get_or_create(&vec![("tier".into(), "g0".into())])
                .inc_by(hit as u64);
            m.cache_misses.inc_by((prompt - hit) as u64);
            m.cache_request_prefix_coverage
                .observe(100.0 * hit as f64 / prompt.max(1) as f64);
        }
        m.cache_device_blocks_served
            .inc_by(self.blocks_served as u64);
        m.cache_preemption_count.inc_by(self.preempted as u64);
        if let Some(r) = &self.replicas {
            m.dp_active_tokens.inc_by(r.tokens as u64);
            m.dp_step_capacity_tokens.inc_by(r.token_capacity as u64);
            m.dp_active_token_occupancy
                .observe(100.0 * r.tokens as f64 / r.token_capacity.max(1) as f64);
            m.dp_context_token_occupancy
                .observe(100.0 * r.contexts as f64 / r.context_capacity.max(1) as f64);
        }
        if let Some(b) = &self.batch {
            m.batch(b.batch_type).record(
                b.sequences,
                b.tokens,
                b.context_tokens,
                b.creation_ms,
                b.exec_ms,
                b.finished,
                self.gauges.queued,
            );
            let rate = b.tokens as f64 / (b.exec_ms / 1e3).max(1e-9);
            match b.batch_type {
                BatchType::Ce => m.batch_prompt_throughput.observe(rate),
                BatchType::Tg => m.batch_generation_throughput.observe(rate),
            }
        }
        if let Some(a) = self.acceptance.as_ref().filter(|a| a.sequences > 0) {
            m.spec_decode_avg_acceptance_length
                .observe(a.accepted as f64 / a.sequences as f64);
            for (j, &(proposed, accepted)) in a.positions.iter().enumerate() {
                m.spec_decode_acceptance_rate_per_position
                    .get_or_create(&vec![("position".into(), j.to_string())])
                    .observe(100.0 * accepted as f64 / proposed as f64);
            }
        }
        self.gauges.record(m);
    }
}
