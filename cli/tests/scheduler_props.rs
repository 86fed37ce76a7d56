//! The scheduler's invariants over random workloads (proptest): requests arriving over time with
//! random prompts and lengths, some cancelled midway, a KV cache too small for all of them (so
//! requests are preempted), chunked prefill, prefix caching, with and without speculative
//! decoding. After every step: no more contexts or new tokens than the bounds allow, every KV
//! page owned as its reference count says (never by two sequences unless it is a full shared
//! page), the draft's cache only for running requests and never ahead of the decoder's. At the end: every request that was not
//! cancelled completed with exactly the tokens it gets alone, a cancelled one with a prefix of
//! them, and every page is back (the prefix cache's aside).

use maxc_golden::fixtures;
use maxc_runtime::kv::PageTable;
use maxc_runtime::sampling::SamplingParams;
use maxc_runtime::Engine;
use maxc_serve::metrics::Metrics;
use maxc_serve::scheduler::{generate, GenerateOptions};
use maxc_serve::scheduler::{
    Event, FinishReason, Request, Scheduler, SchedulerConfig, Speculation, SpeculationOptions,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const BATCH: usize = 4;
const BUDGET: usize = 32;
const PAGE: usize = 16;

/// One request of a workload.
#[derive(Clone, Debug)]
struct Job {
    prompt: Vec<i64>,
    max_tokens: usize,
    /// The step it is submitted before.
    arrives: usize,
    /// The step its client goes away before, if it does.
    cancel: Option<usize>,
}

fn job() -> impl Strategy<Value = Job> {
    (
        prop::collection::vec(3i64..1000, 1..60),
        0usize..20,
        0usize..12,
        prop::option::weighted(0.25, 1usize..30),
    )
        .prop_map(|(prompt, max_tokens, arrives, cancel)| Job {
            prompt,
            max_tokens,
            arrives,
            cancel: cancel.map(|c| arrives + c),
        })
}

/// Every page held as often as its reference count says; a page shared by two sequences is full
/// in both; free and used pages add up.
fn check_pages(t: &PageTable, what: &str) -> Result<(), TestCaseError> {
    let mut holders = vec![0u32; t.total_pages()];
    for seq in t.sequences() {
        let pages = t.pages(seq);
        prop_assert_eq!(pages.len(), t.len(seq).div_ceil(t.page_size()), "{}", what);
        for &p in pages {
            holders[p as usize] += 1;
        }
    }
    for seq in t.sequences() {
        for (i, &p) in t.pages(seq).iter().enumerate() {
            if holders[p as usize] > 1 {
                prop_assert!(
                    (i + 1) * t.page_size() <= t.len(seq),
                    "{}: page {} is shared but partly filled in sequence {}",
                    what,
                    p,
                    seq
                );
            }
        }
    }
    let mut used = 0;
    for (p, &h) in holders.iter().enumerate() {
        let rc = t.ref_count(p as u32);
        prop_assert_eq!(rc, h + t.external_holds(p as u32), "{}: page {}", what, p);
        used += usize::from(rc > 0);
    }
    prop_assert_eq!(used + t.free_pages(), t.total_pages(), "{}", what);
    Ok(())
}

/// Greedy tokens of a request run alone (by prompt, max_tokens, ignore_eos).
struct Alone {
    engine: Scheduler,
    memo: BTreeMap<(Vec<i64>, usize, bool), Vec<i64>>,
}

impl Alone {
    fn tokens(&mut self, prompt: &[i64], max: usize, ignore_eos: bool) -> Vec<i64> {
        let engine = &mut self.engine;
        self.memo
            .entry((prompt.to_vec(), max, ignore_eos))
            .or_insert_with(|| {
                let o = GenerateOptions {
                    max_new_tokens: max,
                    sampling: SamplingParams::default(),
                    stop_at_eos: !ignore_eos,
                };
                generate(engine, prompt, &o, |_| {}).unwrap()
            })
            .clone()
    }
}

#[derive(Default)]
struct Seen {
    preempted: usize,
    cancelled: usize,
    completed: usize,
    speculative_steps: u64,
}

/// Every other request goes on past end-of-sequence tokens.
fn ignores_eos(i: usize) -> bool {
    i.is_multiple_of(2)
}

fn run_case(
    artifact: &Path,
    jobs: &[Job],
    speculate: bool,
    alone: &mut Alone,
    seen: &mut Seen,
) -> Result<(), TestCaseError> {
    let engine = Engine::open(artifact, "decoder").unwrap();
    let eos = engine.artifact().manifest.eos_token_ids.clone();
    let cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
    let spec = speculate.then(|| {
        Speculation::open(
            &engine,
            &SpeculationOptions::default(),
            Default::default(),
            None,
        )
        .unwrap()
    });
    let mut s = Scheduler::new(engine, cfg, Arc::new(Metrics::new()));
    if let Some(spec) = spec {
        s = s.with_speculation(spec);
    }
    let mut rx: Vec<Option<_>> = jobs.iter().map(|_| None).collect();
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); jobs.len()];
    let mut ends: Vec<Option<Event>> = vec![None; jobs.len()];
    let mut step = 0;
    while step <= 12 || s.has_work() {
        for (i, j) in jobs.iter().enumerate() {
            if j.arrives == step {
                let (tx, r) = tokio::sync::mpsc::unbounded_channel();
                let mut req = Request::greedy(j.prompt.clone(), j.max_tokens);
                req.ignore_eos = ignores_eos(i);
                s.submit(req, tx);
                rx[i] = Some(r);
            }
            if j.cancel == Some(step) && ends[i].is_none() && rx[i].take().is_some() {
                seen.cancelled += 1;
            }
        }
        let report = s.step();
        seen.preempted += report.preempted;
        prop_assert!(report.sequences <= BATCH, "{:?}", report);
        prop_assert!(report.tokens <= BUDGET, "{:?}", report);
        prop_assert!(s.running() <= BATCH);
        check_pages(s.kv().pages(), "decoder")?;
        prop_assert_eq!(s.kv().audit(), Ok(()));
        if let Some(spec) = s.speculation() {
            let draft = spec.kv().pages();
            check_pages(draft, "draft")?;
            for seq in draft.sequences() {
                prop_assert!(
                    s.kv().pages().contains(seq),
                    "the draft holds sequence {} that the decoder does not",
                    seq
                );
                // Rejected proposals left the draft's cache: it never runs ahead.
                prop_assert!(
                    draft.len(seq) <= s.kv().pages().len(seq),
                    "the draft caches {} tokens of sequence {}, the decoder {}",
                    draft.len(seq),
                    seq,
                    s.kv().pages().len(seq)
                );
            }
        }
        for (i, r) in rx.iter_mut().enumerate() {
            while let Some(e) = r.as_mut().and_then(|r| r.try_recv().ok()) {
                match e {
                    Event::Token { id, .. } => {
                        prop_assert!(ends[i].is_none(), "request {} got a token after its end", i);
                        tokens[i].push(id);
                    }
                    Event::Admitted { .. } | Event::PromptLogprobs(_) => {}
                    end => {
                        prop_assert!(ends[i].is_none(), "request {} ended twice", i);
                        ends[i] = Some(end);
                    }
                }
            }
        }
        step += 1;
        prop_assert!(step < 5_000, "the scheduler does not finish");
    }
    for (i, j) in jobs.iter().enumerate() {
        let want = alone.tokens(&j.prompt, j.max_tokens, ignores_eos(i));
        let cancelled = rx[i].is_none();
        if cancelled {
            prop_assert!(want.starts_with(&tokens[i]), "cancelled request {}", i);
            continue;
        }
        prop_assert_eq!(&tokens[i], &want, "request {}", i);
        let stopped = !ignores_eos(i) && want.last().is_some_and(|t| eos.contains(t));
        match &ends[i] {
            Some(Event::Finished { reason, usage }) => {
                prop_assert_eq!(usage.completion_tokens, tokens[i].len());
                prop_assert_eq!(usage.prompt_tokens, j.prompt.len());
                let expected = if stopped {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                };
                prop_assert_eq!(*reason, expected, "request {}", i);
                seen.completed += 1;
            }
            other => prop_assert!(false, "request {} ended with {:?}", i, other),
        }
    }
    prop_assert_eq!(s.running() + s.queued(), 0);
    let pages = s.kv().pages();
    prop_assert_eq!(
        pages.free_pages() + s.cached_only_pages(),
        pages.total_pages()
    );
    if let Some(spec) = s.speculation() {
        let draft = spec.kv().pages();
        prop_assert_eq!(draft.free_pages(), draft.total_pages());
        seen.speculative_steps += spec.stats().verifications;
    }
    Ok(())
}

fn artifact(dir: &Path) -> PathBuf {
    let a = dir.join("roles.maxc");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(["compile"])
        .arg(fixtures().join("tiny-roles"))
        .arg("--out")
        .arg(&a)
        .args([
            "--quiet",
            "--max-seq-len",
            "96",
            "--page-size",
            &PAGE.to_string(),
        ])
        .args(["--max-batch-size", &BATCH.to_string()])
        .args(["--max-batch-input-tokens", &BUDGET.to_string()])
        .args(["--kv-cache-pages", "8"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    a
}

#[test]
fn random_workloads_keep_the_schedulers_invariants() {
    let tmp = tempfile::tempdir().unwrap();
    let a = artifact(tmp.path());
    let alone = RefCell::new(Alone {
        engine: Scheduler::alone(Engine::open(&a, "decoder").unwrap()),
        memo: BTreeMap::new(),
    });
    let seen = RefCell::new(Seen::default());
    // A fixed seed: the same workloads on every run, so that CI is stable.
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 64,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let strategy = (prop::collection::vec(job(), 1..10), any::<bool>());
    runner
        .run(&strategy, |(jobs, speculate)| {
            run_case(
                &a,
                &jobs,
                speculate,
                &mut alone.borrow_mut(),
                &mut seen.borrow_mut(),
            )
        })
        .unwrap();
    let seen = seen.into_inner();
    // The workloads reached the paths the invariants are about.
    eprintln!(
        "{} preemptions, {} cancellations, {} completions, {} speculative steps",
        seen.preempted, seen.cancelled, seen.completed, seen.speculative_steps
    );
    assert!(seen.preempted > 0, "no preemption");
    assert!(seen.cancelled > 0, "no cancellation");
    assert!(seen.completed > 0, "no completion");
    assert!(seen.speculative_steps > 0, "no speculative step");
}
