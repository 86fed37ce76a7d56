//! The first phase of a step, [`Scheduler::schedule`]: cancellation, the step's rows (decode
//! rows, prefill chunks, then admissions, within each replica's budget), the pages they need
//! (evicting cached pages, then preempting the youngest request where they run short), the
//! draft's proposals, and the step's inputs from the page table. What it hands on fits.

use super::active::Active;
use super::plan::{Planned, StepPlan};
use super::request::Event;
use super::speculative;
use super::state::Scheduler;
use super::stats::{ReplicaStats, StepStats};
use std::time::Instant;

/// Per-replica room left in a step being composed.
struct Room {
    budget: Vec<usize>,
    contexts: Vec<usize>,
    has_prefill: Vec<bool>,
    chunked: bool,
    /// Logit rows left in the step (over every replica).
    logits: usize,
}

impl Room {
    /// Of `n` rows a sequence could take, those that fit the logit rows left: all where one
    /// is left and it does not score (it takes one), else as many as are left.
    fn logit_cap(&self, n: usize, score: bool) -> usize {
        if score {
            n.min(self.logits)
        } else if self.logits == 0 {
            0
        } else {
            n
        }
    }

    /// Takes the logit rows of `n` rows (and `propose` proposals).
    fn take_logits(&mut self, n: usize, propose: usize, score: bool) {
        let rows = if score { n } else { 1 + propose };
        self.logits = self.logits.saturating_sub(rows);
    }

    /// Tokens a prompt with `pending` tokens left takes on replica `r`: as many as the budget
    /// allows with chunked prefill; else all or (when another prefill is there and they do not
    /// fit) none.
    fn take(&self, r: usize, pending: usize) -> usize {
        if self.chunked {
            pending.min(self.budget[r])
        } else if pending <= self.budget[r] || !self.has_prefill[r] {
            pending
        } else {
            0
        }
    }
}

impl Scheduler {
    /// Plans the next step and allocates its pages; `None` where no request can run.
    pub(super) fn schedule(&mut self, stats: &mut StepStats) -> Option<StepPlan> {
        stats.finished += self.drop_cancelled();
        self.release_forks();
        let t0 = Instant::now();
        let mut rows = self.compose(stats);
        if !self.fit(&mut rows, stats) {
            return None;
        }
        if let Some(spec) = self.spec.as_mut() {
            speculative::propose(spec, &mut self.running, &mut rows);
        }
        self.choose_profiling(&rows);
        let tokens: Vec<Vec<i64>> = rows
            .iter()
            .map(|p| {
                let a = &self.running[p.idx];
                let mut t = a.tokens[a.computed..a.computed + p.n].to_vec();
                t.extend(p.drafts.iter().map(|d| d.0));
                t
            })
            .collect();
        let chunks: Vec<(u64, &[i64])> = rows
            .iter()
            .zip(&tokens)
            .map(|(p, t)| (self.running[p.idx].seq, &t[..]))
            .collect();
        match self.kv.prepare(&chunks) {
            Ok(mut step) => {
                let mut start = 0;
                step.inputs.logit_indices.clear();
                for p in &rows {
                    step.inputs.logit_indices.extend(p.logit_indices(start));
                    start += p.rows();
                }
                Some(StepPlan {
                    rows,
                    step,
                    creation_ms: t0.elapsed().as_secs_f64() * 1e3,
                })
            }
            Err(e) => {
                let failed: Vec<usize> = rows.iter().map(|p| p.idx).collect();
                stats.finished += self.fail(&failed, &e.to_string());
                None
            }
        }
    }

    /// Makes room in the KV cache for `rows`: evicts cached pages, then preempts the youngest
    /// planned request until they fit. Returns whether a step is left to run.
    fn fit(&mut self, rows: &mut Vec<Planned>, stats: &mut StepStats) -> bool {
        loop {
            if rows.is_empty() {
                if self.running.is_empty() {
                    // Nothing runs and the head of the queue does not fit an empty cache.
                    if let Some(a) = self.waiting.pop_front() {
                        let _ = a.events.send(Event::Error(self.too_large()));
                        stats.finished += 1;
                    }
                }
                return false;
            }
            let needed: usize = rows
                .iter()
                .map(|p| {
                    let a = &self.running[p.idx];
                    self.kv.pages_needed(a.seq, a.computed + p.n + p.propose)
                })
                .sum();
            if self.kv.make_room(needed) {
                return true;
            }
            if self.running.len() == 1 {
                // Alone and still out of pages: the cache cannot hold it.
                let message = self.too_large();
                stats.finished += self.fail(&[0], &message);
                return false;
            }
            self.preempt_youngest(rows);
            stats.preempted += 1;
        }
    }

    /// The error of a request that an empty KV cache cannot hold.
    fn too_large(&self) -> String {
        format!(
            "the KV cache ({} pages of {}) cannot hold this request",
            self.kv.pages().total_pages(),
            self.kv.page_size()
        )
    }

    /// Ends the running requests at `idx` with `message`, freeing their pages; returns how
    /// many.
    pub(super) fn fail(&mut self, idx: &[usize], message: &str) -> usize {
        let mut idx = idx.to_vec();
        idx.sort_unstable();
        idx.dedup();
        for &i in idx.iter().rev() {
            let a = self.running.remove(i);
            let _ = a.events.send(Event::Error(message.to_string()));
            self.retire(&a);
        }
        idx.len()
    }

    /// Preempts the youngest running request in `rows` (freeing its pages and sending it back
    /// to the head of the queue to be recomputed).
    fn preempt_youngest(&mut self, rows: &mut Vec<Planned>) {
        let Some(victim) = rows.iter().map(|p| p.idx).max() else {
            return;
        };
        let mut a = self.running.remove(victim);
        self.kv.release(a.seq);
        if let Some(spec) = self.spec.as_mut() {
            spec.kv.release(a.seq);
        }
        a.computed = 0;
        a.draft_computed = 0;
        rows.retain(|p| p.idx != victim);
        for p in rows.iter_mut() {
            if p.idx > victim {
                p.idx -= 1;
            }
        }
        self.waiting.push_front(a);
    }

    /// Cancels the requests whose event receivers are gone; returns how many.
    fn drop_cancelled(&mut self) -> usize {
        let before = self.waiting.len();
        self.waiting.retain(|a| !a.events.is_closed());
        let mut n = before - self.waiting.len();
        for parked in self.parked.values_mut() {
            let before = parked.len();
            parked.retain(|a| !a.events.is_closed());
            n += before - parked.len();
        }
        self.parked.retain(|_, p| !p.is_empty());
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let a = self.running.remove(i);
                self.retire(&a);
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }

    /// Draft tokens `a` may have verified in its next step: none without speculation, while
    /// its draft is far behind, or where more tokens could not be used (max_tokens, the
    /// context length).
    fn proposals(&self, a: &Active) -> usize {
        let Some(spec) = &self.spec else {
            return 0;
        };
        if a.tokens.len() - a.draft_computed.min(a.tokens.len()) > spec.depth + 1 {
            return 0;
        }
        spec.depth
            .min(a.req.max_tokens.saturating_sub(a.generated + 1))
            .min(self.info.max_seq_len.saturating_sub(a.tokens.len() + 1))
    }

    /// The step's rows: each running sequence's decode row or prefill chunk with the draft
    /// tokens it may propose, then admissions, in replica order.
    fn compose(&mut self, stats: &mut StepStats) -> Vec<Planned> {
        let dp = self.cfg.data_parallel_degree;
        let mut room = Room {
            budget: vec![self.cfg.max_batch_input_tokens; dp],
            contexts: vec![0; dp],
            has_prefill: vec![false; dp],
            chunked: self.cfg.enable_chunked_prefill,
            logits: self.info.max_logit_rows,
        };
        let mut plan: Vec<Vec<Planned>> = (0..dp).map(|_| Vec::new()).collect();
        for a in &self.running {
            room.contexts[a.replica] += 1;
        }
        // Decode rows, then prefill chunks of admitted requests.
        for decode in [true, false] {
            for (i, a) in self.running.iter().enumerate() {
                if a.is_decode() != decode || a.pending() == 0 {
                    continue;
                }
                let r = a.replica;
                let score = !decode && a.scores();
                let n = if decode {
                    usize::from(room.budget[r] > 0)
                } else {
                    room.take(r, a.pending())
                };
                let n = room.logit_cap(n, score);
                if n > 0 {
                    let propose = if decode {
                        self.proposals(a)
                            .min(room.budget[r] - n)
                            .min(room.logits - 1)
                    } else {
                        0
                    };
                    room.budget[r] = room.budget[r].saturating_sub(n + propose);
                    room.take_logits(n, propose, score);
                    room.has_prefill[r] |= !decode;
                    let mut p = Planned::new(i, n, propose);
                    p.score = score;
                    plan[r].push(p);
                }
            }
        }
        self.admit(&mut room, &mut plan, stats);
        if dp > 1 {
            stats.replicas = Some(ReplicaStats {
                tokens: plan.iter().flatten().map(|p| p.n + p.propose).sum(),
                token_capacity: self.cfg.max_batch_input_tokens * dp,
                contexts: room.contexts.iter().sum(),
                context_capacity: self.cfg.max_batch_size * dp,
            });
        }
        plan.into_iter().flatten().collect()
    }

    /// Admits waiting requests, first come first served, to the least loaded replica with
    /// room, while the KV cache's free and evictable pages last; shares their cached
    /// prefixes.
    fn admit(&mut self, room: &mut Room, plan: &mut [Vec<Planned>], stats: &mut StepStats) {
        let ps = self.kv.page_size();
        let mut free = self.kv.available_pages();
        for p in plan.iter().flatten() {
            let a = &self.running[p.idx];
            free = free.saturating_sub(self.kv.pages_needed(a.seq, a.computed + p.n + p.propose));
        }
        while let Some(head) = self.waiting.front() {
            let Some(r) = (0..plan.len())
                .filter(|&r| room.contexts[r] < self.cfg.max_batch_size && room.budget[r] > 0)
                .min_by_key(|&r| (room.contexts[r], r))
            else {
                break;
            };
            let first = room.take(r, head.tokens.len());
            if first == 0 || first.div_ceil(ps) > free || room.logits == 0 {
                break;
            }
            let Some(mut a) = self.waiting.pop_front() else {
                break;
            };
            self.next_seq += 1;
            a.seq = self.next_seq;
            a.replica = r;
            // Prompt log-probabilities need every prompt row computed: no cache for them. A
            // choice after the first of its prompt starts from the first's prompt pages.
            let leader = a
                .req
                .fork
                .filter(|f| !f.leader)
                .and_then(|f| self.leader(f.group))
                .map(|l| l.seq);
            // Mean pooling needs every prompt row's hidden state: no cache for it either.
            let whole = a.scores() || a.req.embed == Some(super::request::Pooling::Mean);
            a.computed = if whole {
                0
            } else {
                match leader.map(|l| self.kv.fork_prefix(l, a.seq, &a.tokens)) {
                    Some(n) if n > 0 => n,
                    _ => self.kv.attach_cached_prefix(a.seq, &a.tokens),
                }
            };
            if !a.admitted_once {
                a.admitted_once = true;
                let hit = a.computed.min(a.req.prompt.len());
                a.cached_tokens = hit;
                let _ = a.events.send(Event::Admitted { cached_tokens: hit });
                if self.kv.prefix_caching() {
                    stats.admissions.push((hit, a.req.prompt.len()));
                    stats.blocks_served += a.computed / ps;
                }
            }
            let score = a.scores();
            let n = room.logit_cap(room.take(r, a.pending()), score);
            free = free.saturating_sub(n.div_ceil(ps));
            room.budget[r] -= n.min(room.budget[r]);
            room.take_logits(n, 0, score);
            room.has_prefill[r] = true;
            room.contexts[r] += 1;
            self.running.push(a);
            let mut p = Planned::new(self.running.len() - 1, n, 0);
            p.score = score;
            plan[r].push(p);
        }
    }
}
