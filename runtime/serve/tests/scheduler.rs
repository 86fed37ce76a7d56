//! The scheduler against a fake executor (no artifact): a model whose next token is a
//! function of the whole context *as read back through the KV pages* of each step. The fake
//! writes every token row into its page slots and reads every context from them, so a page
//! shared, evicted, freed or truncated wrongly changes the tokens that come out. Every test
//! checks the KV cache's invariants after every step.

use maxc_kv::{KvCache, FREED};
use maxc_runtime::engine::{RoleInfo, StepExecutor};
use maxc_runtime::schema::{StepDim, StepInputs, StepLimits};
use maxc_runtime::{Logits, Result, RuntimeError};
use maxc_serve::metrics::Metrics;
use maxc_serve::scheduler::{
    Event, FinishReason, Request, Scheduler, SchedulerConfig, Speculation,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedReceiver;

const VOCAB: usize = 61;
const PAGE: usize = 4;
const MAX_SEQ: usize = 64;

/// The fake model's next token after `context`.
fn next_token(context: &[i64]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
    }
    // Token 0 (the end of sequence) is never chosen: runs end at their length.
    1 + (h % (VOCAB as u64 - 1)) as i64
}

/// A draft that agrees with [`next_token`] on about two contexts in three.
fn draft_token(context: &[i64]) -> i64 {
    let t = next_token(context);
    if context.len().is_multiple_of(3) {
        1 + t % (VOCAB as i64 - 1)
    } else {
        t
    }
}

/// What the test sees of a fake's steps.
#[derive(Default)]
struct Log {
    /// Token rows of each step.
    rows: Vec<usize>,
    /// Steps to fail, by step number.
    fail: Vec<usize>,
    /// Steps whose group of ranks fails (a collective error), by step number.
    collective: Vec<usize>,
}

/// An executor of the fake model over its own KV memory.
struct Fake {
    info: RoleInfo,
    model: fn(&[i64]) -> i64,
    /// Token at each (page, slot).
    memory: HashMap<(i32, usize), i64>,
    log: Arc<Mutex<Log>>,
}

impl Fake {
    fn new(pages: usize, step_tokens: usize, batch: usize, n_logits: usize) -> Self {
        Fake {
            info: RoleInfo {
                vocab_size: VOCAB,
                max_seq_len: MAX_SEQ,
                max_step_tokens: step_tokens,
                max_batch_size: batch,
                page_size: PAGE,
                total_pages: pages,
                pages_per_seq: MAX_SEQ / PAGE,
                kv_windows: vec![None],
                max_logit_rows: batch * n_logits,
                max_return_n_logits: n_logits,
                eos_token_ids: vec![0],
                tokenizer_sha256: None,
            },
            model: next_token,
            memory: HashMap::new(),
            log: Arc::default(),
        }
    }

    /// The fake with a second page group, sliding with window `w`.
    fn windowed(mut self, w: usize) -> Self {
        self.info.kv_windows = vec![None, Some(w)];
        self
    }

    fn limits(&self) -> StepLimits {
        let mut bounds = [0u64; StepDim::COUNT];
        let i = &self.info;
        bounds[StepDim::TotalSeqLen as usize] = i.max_step_tokens as u64;
        bounds[StepDim::BatchSize as usize] = i.max_batch_size as u64;
        bounds[StepDim::MaxNumPages as usize] = i.pages_per_seq as u64;
        bounds[StepDim::TotalNumPages as usize] = i.total_pages as u64;
        bounds[StepDim::InputRowOffsetsLen as usize] = i.max_batch_size as u64 + 1;
        bounds[StepDim::LogitRows as usize] = i.max_logit_rows as u64;
        StepLimits {
            bounds,
            vocab_size: VOCAB as u64,
            page_size: PAGE as u64,
            max_seq_len: MAX_SEQ as u64,
            kv_windows: i.kv_windows.iter().map(|w| w.map(|w| w as u64)).collect(),
        }
    }
}

impl StepExecutor for Fake {
    fn info(&self) -> &RoleInfo {
        &self.info
    }

    fn execute(&mut self, s: &StepInputs) -> Result<Logits> {
        {
            let mut log = self.log.lock().unwrap();
            let n = log.rows.len();
            log.rows.push(s.tokens.len());
            if log.fail.contains(&n) {
                return Err(RuntimeError::Input(format!("step {n} fails on purpose")));
            }
            if log.collective.contains(&n) {
                return Err(RuntimeError::Collective(format!("rank 1 left at step {n}")));
            }
        }
        s.checked_dims(&self.limits())?;
        let n = s.logit_indices.len();
        let mut out = Logits {
            rows: n,
            vocab: VOCAB,
            data: vec![0.0; n * VOCAB],
        };
        // Every page group stores each token; a row reads its last `window` positions from a
        // sliding group's pages and the older ones from the first (full) group's, so a page
        // freed or reused too early shows as a wrong context.
        let window = self.info.kv_windows.iter().flatten().copied().min();
        let sliding = self.info.kv_windows.iter().position(Option::is_some);
        for b in 0..s.batch_size() {
            let page_in =
                |g: usize, pos: usize| s.lookup_table(g)[b * s.pages_per_seq + pos / PAGE];
            let (from, to) = (
                s.input_row_offsets[b] as usize,
                s.input_row_offsets[b + 1] as usize,
            );
            let cached = s.cache_lengths[b] as usize;
            for (j, &t) in s.tokens[from..to].iter().enumerate() {
                let pos = cached + j;
                for g in 0..s.kv_groups {
                    self.memory.insert((page_in(g, pos), pos % PAGE), t);
                }
            }
            // Each logit row of one of this sequence's rows: the next token after it.
            for (i, &r) in s.logit_indices.iter().enumerate() {
                let Ok(r) = usize::try_from(r) else { continue };
                if !(from..to).contains(&r) {
                    continue;
                }
                let end = cached + r - from + 1;
                let context: Vec<i64> = (0..end)
                    .map(|pos| {
                        let g = match (window, sliding) {
                            (Some(w), Some(g)) if pos + w >= end => g,
                            _ => 0,
                        };
                        self.memory
                            .get(&(page_in(g, pos), pos % PAGE))
                            .copied()
                            .unwrap_or(-1)
                    })
                    .collect();
                let next = (self.model)(&context) as usize;
                out.data[i * VOCAB + next] = 10.0;
            }
        }
        Ok(out)
    }
}

/// The tokens the fake model gives `prompt` alone.
fn alone(prompt: &[i64], max: usize) -> Vec<i64> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max && ctx.len() < MAX_SEQ {
        let t = next_token(&ctx);
        ctx.push(t);
        out.push(t);
    }
    out
}

fn config(batch: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_size: batch,
        max_batch_input_tokens: budget,
        data_parallel_degree: 1,
        enable_chunked_prefill: true,
        prefix_caching: true,
    }
}

fn submit(s: &mut Scheduler, prompt: Vec<i64>, max: usize) -> UnboundedReceiver<Event> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    s.submit(Request::greedy(prompt, max), tx);
    rx
}

/// The tokens and the last event of a request, and the prompt tokens it found cached.
#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<i64>,
    cached: usize,
    end: Option<Event>,
}

fn collect(rx: &mut UnboundedReceiver<Event>, o: &mut Outcome) {
    while let Ok(e) = rx.try_recv() {
        match e {
            Event::Token { id, .. } => o.tokens.push(id),
            Event::Admitted { cached_tokens } => o.cached = cached_tokens,
            e => o.end = Some(e),
        }
    }
}

/// Steps until no work is left (at most `limit` steps), checking the KV cache after each;
/// returns the outcomes and the preemptions.
fn drain(
    s: &mut Scheduler,
    rx: &mut [UnboundedReceiver<Event>],
    limit: usize,
) -> (Vec<Outcome>, usize) {
    let mut out: Vec<Outcome> = rx.iter().map(|_| Outcome::default()).collect();
    let mut preempted = 0;
    for _ in 0..limit {
        if !s.has_work() {
            break;
        }
        preempted += s.step().preempted;
        assert_eq!(s.kv().audit(), Ok(()));
        if let Some(spec) = s.speculation() {
            assert_eq!(spec.kv().audit(), Ok(()));
        }
        for (r, o) in rx.iter_mut().zip(&mut out) {
            collect(r, o);
        }
    }
    assert!(
        !s.has_work(),
        "the scheduler did not finish in {limit} steps"
    );
    (out, preempted)
}

fn prompts(n: usize, len: usize) -> Vec<Vec<i64>> {
    (0..n)
        .map(|i| {
            (0..len + i % 5)
                .map(|j| 1 + ((i * 7 + j * 3) % 50) as i64)
                .collect()
        })
        .collect()
}

/// Each prompt of `ps` got the `max` tokens it gets alone, and finished at that length.
fn each_alone_to_its_length(ps: &[Vec<i64>], out: &[Outcome], max: usize) {
    for (p, o) in ps.iter().zip(out) {
        assert_eq!(o.tokens, alone(p, max));
        assert!(matches!(
            o.end,
            Some(Event::Finished {
                reason: FinishReason::Length,
                ..
            })
        ));
    }
}

fn idle(kv: &KvCache) -> bool {
    let p = kv.pages();
    p.free_pages() + kv.cached_only_pages() == p.total_pages() && p.is_empty()
}

#[test]
fn batched_requests_get_exactly_their_tokens_alone() {
    let mut s = Scheduler::new(
        Fake::new(128, 64, 4, 1),
        config(4, 32),
        Arc::new(Metrics::new()),
    );
    let ps = prompts(9, 6);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 12)).collect();
    let (out, preempted) = drain(&mut s, &mut rx, 500);
    assert_eq!(preempted, 0);
    each_alone_to_its_length(&ps, &out, 12);
    assert!(idle(s.kv()));
}

#[test]
fn preemption_when_pages_run_out_recomputes_and_completes_every_request() {
    // 12 pages of 4 tokens: not enough for six requests of 10 + 20 tokens at once.
    let mut s = Scheduler::new(
        Fake::new(12, 64, 6, 1),
        config(6, 64),
        Arc::new(Metrics::new()),
    );
    let ps = prompts(6, 10);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 20)).collect();
    let (out, preempted) = drain(&mut s, &mut rx, 2000);
    assert!(preempted > 0, "a cache this small preempts");
    for (p, o) in ps.iter().zip(&out) {
        assert_eq!(
            o.tokens,
            alone(p, 20),
            "a preempted request's tokens are unchanged"
        );
    }
    assert!(idle(s.kv()));
}

#[test]
fn a_request_no_cache_can_hold_fails_alone_and_others_go_on() {
    // 4 pages of 4 tokens: a 20-token prompt never fits.
    let mut s = Scheduler::new(
        Fake::new(4, 64, 4, 1),
        config(4, 64),
        Arc::new(Metrics::new()),
    );
    let mut rx = vec![
        submit(&mut s, vec![5; 20], 4),
        submit(&mut s, vec![6; 3], 4),
    ];
    let (out, _) = drain(&mut s, &mut rx, 100);
    assert!(
        matches!(&out[0].end, Some(Event::Error(m)) if m.contains("cannot hold")),
        "{out:?}"
    );
    assert_eq!(out[1].tokens, alone(&[6; 3], 4));
    assert!(idle(s.kv()));
}

#[test]
fn prefix_sharing_serves_full_pages_and_gives_the_same_tokens() {
    let mut s = Scheduler::new(
        Fake::new(64, 64, 4, 1),
        config(4, 64),
        Arc::new(Metrics::new()),
    );
    let shared: Vec<i64> = (1..=13).collect();
    let mut first = vec![submit(&mut s, shared.clone(), 6)];
    let (out, _) = drain(&mut s, &mut first, 100);
    assert_eq!(out[0].cached, 0);
    assert!(
        s.cached_only_pages() > 0,
        "the finished request's full pages stay cached"
    );
    // Two more with the same 13-token start, running together: both share its three pages.
    let mut a = shared.clone();
    a.extend([40, 41]);
    let mut b = shared.clone();
    b.extend([50]);
    let mut rx = vec![submit(&mut s, a.clone(), 8), submit(&mut s, b.clone(), 8)];
    s.step();
    assert_eq!(s.kv().audit(), Ok(()));
    let pages = s.kv().pages();
    let shared_pages = (0..pages.total_pages() as u32)
        .filter(|&p| pages.ref_count(p) == 3)
        .count();
    assert_eq!(
        shared_pages, 3,
        "three full pages held by two sequences and the cache"
    );
    let (out, _) = drain(&mut s, &mut rx, 100);
    assert_eq!(out[0].cached, 12);
    assert_eq!(out[1].cached, 12);
    assert_eq!(out[0].tokens, alone(&a, 8));
    assert_eq!(out[1].tokens, alone(&b, 8));
    assert!(idle(s.kv()));
}

#[test]
fn eviction_makes_room_for_new_requests_and_never_serves_a_reused_page() {
    // 10 pages: each request's pages stay cached after it finishes, so later ones must evict.
    let mut s = Scheduler::new(
        Fake::new(10, 64, 2, 1),
        config(2, 64),
        Arc::new(Metrics::new()),
    );
    for (i, p) in prompts(12, 9).into_iter().enumerate() {
        let mut rx = vec![submit(&mut s, p.clone(), 7)];
        let (out, _) = drain(&mut s, &mut rx, 100);
        assert_eq!(out[0].tokens, alone(&p, 7), "request {i}");
        // And the same prompt again, from whatever the cache kept.
        let mut rx = vec![submit(&mut s, p.clone(), 7)];
        let (again, _) = drain(&mut s, &mut rx, 100);
        assert_eq!(again[0].tokens, alone(&p, 7), "request {i} again");
        assert!(again[0].cached > 0, "request {i} again hits the cache");
    }
}

#[test]
fn chunked_prefill_stays_within_the_budget_and_without_it_prompts_run_whole() {
    for chunked in [true, false] {
        let fake = Fake::new(128, 64, 4, 1);
        let log = fake.log.clone();
        let mut cfg = config(4, 8);
        cfg.enable_chunked_prefill = chunked;
        let mut s = Scheduler::new(fake, cfg, Arc::new(Metrics::new()));
        let ps = [vec![3; 30], vec![4; 5], vec![5; 7]];
        let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 5)).collect();
        let (out, _) = drain(&mut s, &mut rx, 200);
        for (p, o) in ps.iter().zip(&out) {
            assert_eq!(o.tokens, alone(p, 5), "chunked {chunked}");
        }
        let rows = log.lock().unwrap().rows.clone();
        if chunked {
            assert!(
                rows.iter().all(|&r| r <= 8),
                "steps {rows:?} within the budget of 8"
            );
            assert!(rows.iter().filter(|&&r| r == 8).count() >= 3, "{rows:?}");
        } else {
            // Each prompt runs whole: the 30-token one alone, the 7-token one landing on a
            // budget two decode rows have partly used (the budget is soft by one prompt).
            assert_eq!(rows[..3], [30, 1 + 5, 2 + 7], "{rows:?}");
            assert!(rows[3..].iter().all(|&r| r <= 3), "{rows:?}");
        }
    }
}

#[test]
fn a_cancelled_request_frees_its_pages_and_the_others_finish() {
    let mut s = Scheduler::new(
        Fake::new(64, 64, 4, 1),
        config(4, 64),
        Arc::new(Metrics::new()),
    );
    let ps = prompts(3, 9);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 30)).collect();
    s.step();
    s.step();
    let held = s.kv().pages().free_pages();
    drop(rx.remove(1));
    let report = s.step();
    assert_eq!(report.finished, 1, "the cancelled request ends");
    assert_eq!(s.running(), 2);
    assert!(s.kv().pages().free_pages() + s.cached_only_pages() > held);
    let (out, _) = drain(&mut s, &mut rx, 200);
    assert_eq!(out[0].tokens, alone(&ps[0], 30));
    assert_eq!(out[1].tokens, alone(&ps[2], 30));
    assert!(idle(s.kv()));
}

#[test]
fn a_failed_step_fails_its_requests_and_rolls_its_pages_back() {
    let fake = Fake::new(64, 64, 4, 1);
    fake.log.lock().unwrap().fail = vec![3];
    let mut s = Scheduler::new(fake, config(4, 64), Arc::new(Metrics::new()));
    let ps = prompts(2, 6);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 8)).collect();
    let (out, _) = drain(&mut s, &mut rx, 50);
    for o in &out {
        assert!(
            matches!(&o.end, Some(Event::Error(m)) if m.contains("on purpose")),
            "{o:?}"
        );
    }
    assert!(idle(s.kv()));
    // The scheduler goes on serving.
    let mut rx = vec![submit(&mut s, ps[0].clone(), 8)];
    let (out, _) = drain(&mut s, &mut rx, 50);
    assert_eq!(out[0].tokens, alone(&ps[0], 8));
}

#[test]
fn a_group_of_ranks_that_failed_refuses_every_later_request_naming_why() {
    let fake = Fake::new(64, 64, 4, 1);
    fake.log.lock().unwrap().collective = vec![2];
    let mut s = Scheduler::new(fake, config(4, 64), Arc::new(Metrics::new()));
    assert_eq!(s.broken(), None);
    let ps = prompts(2, 6);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 8)).collect();
    let (out, _) = drain(&mut s, &mut rx, 50);
    for o in &out {
        assert!(
            matches!(&o.end, Some(Event::Error(m)) if m.contains("rank 1 left")),
            "{o:?}"
        );
    }
    assert_eq!(s.broken(), Some("rank 1 left at step 2"));
    // No step runs for a new request: it is refused at once, naming the failure.
    let mut rx = submit(&mut s, ps[0].clone(), 8);
    assert!(!s.has_work());
    let mut o = Outcome::default();
    collect(&mut rx, &mut o);
    assert!(
        matches!(&o.end, Some(Event::Error(m)) if m.contains("no more steps") && m.contains("rank 1 left")),
        "{o:?}"
    );
}

#[test]
fn speculative_acceptance_gives_exactly_the_plain_tokens() {
    // The decoder verifies up to three draft tokens per step.
    let decoder = Fake::new(64, 64, 4, 4);
    let mut draft = Fake::new(64, 64, 4, 1);
    draft.model = draft_token;
    let spec = Speculation::new(decoder.info(), draft, Some(3)).unwrap();
    let decoder_log = decoder.log.clone();
    let mut s =
        Scheduler::new(decoder, config(4, 64), Arc::new(Metrics::new())).with_speculation(spec);
    let ps = prompts(4, 7);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 24)).collect();
    let (out, _) = drain(&mut s, &mut rx, 300);
    for (p, o) in ps.iter().zip(&out) {
        assert_eq!(o.tokens, alone(p, 24));
    }
    let st = s.speculation().unwrap().stats();
    let proposed: u64 = st.positions.iter().map(|p| p.0).sum();
    assert!(st.accepted > 0 && st.accepted < proposed, "{st:?}");
    // Fewer decoder steps than tokens: accepted drafts saved steps.
    let steps = decoder_log.lock().unwrap().rows.len();
    assert!(steps < 4 * 24, "{steps} decoder steps");
    assert!(idle(s.kv()));
    assert!(s.speculation().unwrap().kv().pages().is_empty());
}

#[test]
fn a_small_cache_with_speculation_preempts_and_still_gives_the_plain_tokens() {
    let decoder = Fake::new(14, 64, 4, 3);
    let mut draft = Fake::new(64, 64, 4, 1);
    draft.model = draft_token;
    let spec = Speculation::new(decoder.info(), draft, None).unwrap();
    let mut s =
        Scheduler::new(decoder, config(4, 64), Arc::new(Metrics::new())).with_speculation(spec);
    let ps = prompts(5, 8);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 20)).collect();
    let (out, preempted) = drain(&mut s, &mut rx, 2000);
    assert!(preempted > 0);
    for (p, o) in ps.iter().zip(&out) {
        assert_eq!(o.tokens, alone(p, 20));
    }
}

/// The most pages a sequence of `len` tokens holds in a sliding group of window `w` between
/// steps: from the page of position `len + 1 - w` on.
fn window_pages(len: usize, w: usize) -> usize {
    len.div_ceil(PAGE) - (len + 1).saturating_sub(w) / PAGE
}

#[test]
fn a_sliding_page_group_hands_back_its_pages_and_every_request_gets_its_tokens_alone() {
    // Four requests of 9 + 40 tokens: 13 pages each in the full group. In a sliding group of
    // window 6 they hold at most 3, so 64 pages serve all four without preemption, where two
    // full groups would need 104.
    let mut s = Scheduler::new(
        Fake::new(64, 64, 4, 1).windowed(6),
        config(4, 16),
        Arc::new(Metrics::new()),
    );
    let ps = prompts(4, 9);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 40)).collect();
    let mut out: Vec<Outcome> = rx.iter().map(|_| Outcome::default()).collect();
    let mut most_held = 0;
    for _ in 0..500 {
        if !s.has_work() {
            break;
        }
        assert_eq!(s.step().preempted, 0);
        assert_eq!(s.kv().audit(), Ok(()));
        let t = s.kv().pages();
        for seq in t.sequences() {
            let held = t
                .group_pages(seq, 1)
                .iter()
                .filter(|&&p| p != FREED)
                .count();
            assert!(
                held <= window_pages(t.len(seq), 6),
                "{held} pages at {}",
                t.len(seq)
            );
            most_held = most_held.max(t.held_pages(seq));
        }
        for (r, o) in rx.iter_mut().zip(&mut out) {
            collect(r, o);
        }
    }
    assert!(!s.has_work());
    for (p, o) in ps.iter().zip(&out) {
        assert_eq!(o.tokens, alone(p, 40));
    }
    assert!(most_held <= 13 + 3, "{most_held}");
    assert!(idle(s.kv()));
}

#[test]
fn a_sliding_group_shares_a_prefix_whose_window_pages_were_cached() {
    let mut s = Scheduler::new(
        Fake::new(64, 64, 4, 1).windowed(6),
        config(4, 64),
        Arc::new(Metrics::new()),
    );
    // The first request runs far past the shared 13 tokens, so its window leaves them.
    let shared: Vec<i64> = (1..=13).collect();
    let mut long = shared.clone();
    long.extend(20..40);
    let mut first = vec![submit(&mut s, long.clone(), 10)];
    let (out, _) = drain(&mut s, &mut first, 100);
    assert_eq!(out[0].tokens, alone(&long, 10));
    let mut b = shared.clone();
    b.push(50);
    let mut rx = vec![submit(&mut s, b.clone(), 8)];
    let (out, _) = drain(&mut s, &mut rx, 100);
    assert_eq!(
        out[0].cached, 12,
        "the window's pages were cached as they filled"
    );
    assert_eq!(out[0].tokens, alone(&b, 8));
    assert!(idle(s.kv()));
}

#[test]
fn sliding_groups_with_speculation_and_preemption_give_the_plain_tokens() {
    let decoder = Fake::new(30, 64, 4, 4).windowed(5);
    let mut draft = Fake::new(64, 64, 4, 1).windowed(7);
    draft.model = draft_token;
    let spec = Speculation::new(decoder.info(), draft, Some(3)).unwrap();
    let mut s =
        Scheduler::new(decoder, config(4, 64), Arc::new(Metrics::new())).with_speculation(spec);
    let ps = prompts(5, 8);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 30)).collect();
    let (out, preempted) = drain(&mut s, &mut rx, 3000);
    assert!(preempted > 0, "a cache this small preempts");
    for (p, o) in ps.iter().zip(&out) {
        assert_eq!(o.tokens, alone(p, 30));
    }
    let st = s.speculation().unwrap().stats();
    assert!(st.accepted > 0, "{st:?}");
    assert!(idle(s.kv()));
}

/// Scores `prompts` (`echo` with `logprobs`) beside plain requests on a fake whose steps return
/// at most `logit_rows` logit rows, with `pages` pages; checks every prompt log-probability
/// against the fake model's and every continuation against the model alone; returns the
/// preemptions.
fn score_beside_plain_requests(pages: usize, logit_rows: usize) -> usize {
    let mut fake = Fake::new(pages, 64, 4, 1);
    fake.info.max_logit_rows = logit_rows;
    let log = fake.log.clone();
    let mut s = Scheduler::new(fake, config(4, 24), Arc::new(Metrics::new()));
    let ps = prompts(6, 17);
    let mut rx = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let mut req = Request::greedy(p.clone(), 6);
        // The youngest score, so that preemption catches them mid-prompt.
        if i >= 3 {
            req.prompt_logprobs = Some(0);
        }
        let (tx, r) = tokio::sync::mpsc::unbounded_channel();
        s.submit(req, tx);
        rx.push(r);
    }
    let mut scored: Vec<Vec<Vec<f32>>> = vec![Vec::new(); ps.len()];
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); ps.len()];
    let mut preempted = 0;
    for _ in 0..1000 {
        if !s.has_work() {
            break;
        }
        preempted += s.step().preempted;
        assert_eq!(s.kv().audit(), Ok(()));
        for (i, r) in rx.iter_mut().enumerate() {
            while let Ok(e) = r.try_recv() {
                match e {
                    Event::PromptLogprobs(lp) => {
                        scored[i].push(lp.iter().map(|t| t.logprob).collect())
                    }
                    Event::Token { id, .. } => tokens[i].push(id),
                    _ => {}
                }
            }
        }
    }
    assert!(!s.has_work());
    // The fake puts 10 on its next token and 0 on the other VOCAB - 1.
    let lse = (10f32.exp() + (VOCAB - 1) as f32).ln();
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(tokens[i], alone(p, 6), "request {i}'s tokens");
        if i < 3 {
            assert!(scored[i].is_empty(), "request {i} asked for no scores");
            continue;
        }
        assert_eq!(scored[i].len(), 1, "request {i}'s prompt is scored once");
        let got = &scored[i][0];
        assert_eq!(got.len(), p.len());
        assert!(got[0].is_nan());
        for j in 1..p.len() {
            let want = if next_token(&p[..j]) == p[j] {
                10.0 - lse
            } else {
                -lse
            };
            assert!((got[j] - want).abs() < 1e-5, "request {i}, token {j}");
        }
    }
    // No step scored more rows than the artifact returns (the fake checks each step's
    // inputs), and scoring took several steps of the prompt.
    assert!(log.lock().unwrap().rows.len() > 17 / logit_rows);
    preempted
}

#[test]
fn prompts_are_scored_in_chunks_of_the_logit_rows_left_beside_other_requests() {
    assert_eq!(score_beside_plain_requests(128, 6), 0);
    assert_eq!(score_beside_plain_requests(128, 4), 0);
}

#[test]
fn a_preempted_prompt_is_scored_once() {
    // 8 or 11 pages of 4 tokens: six requests of 17 to 21 + 6 tokens do not fit at once.
    assert!(score_beside_plain_requests(8, 5) > 0);
    assert!(score_beside_plain_requests(11, 5) > 0);
}

/// The fake run in loops of co-driven steps: `begin` computes a step (as `execute` does) and
/// its walk stalls the loop's owner now and then, as a descheduled thread would, so that the
/// pool's worker ends steps and begins the next.
struct Looping {
    inner: Fake,
    owner: std::thread::ThreadId,
    logits: Option<Result<Logits>>,
    begun: usize,
}

struct Walk {
    owner: std::thread::ThreadId,
    stall: bool,
}

impl maxc_runtime::StepWalk for Walk {
    fn walk(&self) {
        if self.stall && std::thread::current().id() == self.owner {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    fn done(&self) -> bool {
        true
    }
}

impl StepExecutor for Looping {
    fn info(&self) -> &RoleInfo {
        &self.inner.info
    }
    fn execute(&mut self, s: &StepInputs) -> Result<Logits> {
        self.inner.execute(s)
    }
    fn loops(&self) -> bool {
        true
    }
    fn begin(&mut self, s: &StepInputs) -> Result<Option<Arc<dyn maxc_runtime::StepWalk>>> {
        assert!(
            self.logits.is_none(),
            "a step begun before the last one ended"
        );
        self.logits = Some(self.inner.execute(s));
        self.begun += 1;
        Ok(Some(Arc::new(Walk {
            owner: self.owner,
            stall: self.begun.is_multiple_of(2),
        })))
    }
    fn finish(&mut self) -> Result<Logits> {
        self.logits.take().expect("a step begun")
    }
}

#[test]
fn a_loop_of_co_driven_steps_that_either_thread_advances_gets_every_request_its_tokens() {
    maxc_runtime::kernels::pool::set_threads(2);
    let exec = Looping {
        inner: Fake::new(128, 64, 4, 1),
        owner: std::thread::current().id(),
        logits: None,
        begun: 0,
    };
    let mut s = Scheduler::new(exec, config(4, 32), Arc::new(Metrics::new()));
    assert!(s.loops());
    let ps = prompts(9, 6);
    let mut rx: Vec<_> = ps.iter().map(|p| submit(&mut s, p.clone(), 12)).collect();
    let mut out: Vec<Outcome> = rx.iter().map(|_| Outcome::default()).collect();
    let (mine, workers) = maxc_serve::scheduler::loop_steps();
    let mut turns = 0;
    while s.has_work() {
        // Between steps, on whichever thread ends one: the cache holds, and events arrive.
        s.run_loop(&mut |s| {
            turns += 1;
            assert_eq!(s.kv().audit(), Ok(()));
            for (r, o) in rx.iter_mut().zip(&mut out) {
                collect(r, o);
            }
            turns < 1000
        });
    }
    for (r, o) in rx.iter_mut().zip(&mut out) {
        collect(r, o);
    }
    each_alone_to_its_length(&ps, &out, 12);
    assert!(idle(s.kv()));
    let (mine, workers) = {
        let (m, w) = maxc_serve::scheduler::loop_steps();
        (m - mine, w - workers)
    };
    assert!(
        mine + workers > 10,
        "{mine} + {workers} steps begun in loops"
    );
    if maxc_runtime::kernels::pool::max_threads() >= 2 {
        assert!(workers > 0, "the pool's worker began no step");
    }
}
