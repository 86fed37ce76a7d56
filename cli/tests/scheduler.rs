//! The scheduler without HTTP: continuous batching gives each request exactly the tokens it gets
//! alone; a shared prefix is served from the prefix cache with the same tokens; a KV cache too
//! small for the load preempts and still completes every request correctly; a cancelled
//! request frees its pages.

use maxc_golden::fixtures;
use maxc_runtime::sampling::SamplingParams;
use maxc_runtime::Engine;
use maxc_serve::metrics::Metrics;
use maxc_serve::scheduler::{generate, GenerateOptions};
use maxc_serve::scheduler::{Event, FinishReason, Request, Scheduler, SchedulerConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

fn compile(out: &Path, extra: &[&str]) {
    let model = fixtures().join("tiny-llama");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(["compile", model.to_str().unwrap(), "--out"])
        .arg(out)
        .args(["--quiet", "--max-seq-len", "128", "--page-size", "16"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Deterministic prompts of mixed lengths (token ids below tiny-llama's vocabulary of 1024).
fn prompts(n: usize) -> Vec<Vec<i64>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 45;
            (0..len)
                .map(|j| ((i * 131 + j * 17 + 3) % 1000) as i64 + 1)
                .collect()
        })
        .collect()
}

fn alone(artifact: &Path, prompt: &[i64], max: usize) -> Vec<i64> {
    let mut e = Scheduler::alone(Engine::open(artifact, "decoder").unwrap());
    let opts = GenerateOptions {
        max_new_tokens: max,
        sampling: SamplingParams::default(),
        stop_at_eos: true,
    };
    generate(&mut e, prompt, &opts, |_| {}).unwrap()
}

type Outcome = (Vec<i64>, Option<Event>);

/// Runs every request through `s` to the end; returns each one's tokens and finish event, the
/// largest number of requests running at once, and the preemptions.
fn drain_counting(
    s: &mut Scheduler,
    mut rx: Vec<UnboundedReceiver<Event>>,
) -> (Vec<Outcome>, usize, usize) {
    let mut out: Vec<Outcome> = vec![(Vec::new(), None); rx.len()];
    let mut peak = 0;
    let mut steps = 0;
    let mut preempted = 0;
    while s.has_work() {
        preempted += s.step().preempted;
        peak = peak.max(s.running());
        steps += 1;
        assert!(steps < 10_000, "the scheduler does not finish");
        for (i, r) in rx.iter_mut().enumerate() {
            while let Ok(e) = r.try_recv() {
                match e {
                    Event::Token { id, .. } => out[i].0.push(id),
                    Event::PromptLogprobs(_) | Event::Admitted { .. } => {}
                    other => out[i].1 = Some(other),
                }
            }
        }
    }
    (out, peak, preempted)
}

fn drain(s: &mut Scheduler, rx: Vec<UnboundedReceiver<Event>>) -> (Vec<Outcome>, usize) {
    let (out, peak, _) = drain_counting(s, rx);
    (out, peak)
}

fn scheduler(artifact: &Path, prefix_caching: bool) -> Scheduler {
    let engine = Engine::open(artifact, "decoder").unwrap();
    let mut cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
    cfg.prefix_caching = prefix_caching;
    Scheduler::new(engine, cfg, Arc::new(Metrics::new()))
}

fn tmp_artifact(name: &str, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join(name);
    compile(&a, extra);
    (tmp, a)
}

#[test]
fn batched_requests_get_exactly_their_tokens_alone() {
    let (_t, a) = tmp_artifact(
        "batch.maxc",
        &["--max-batch-size", "8", "--max-batch-input-tokens", "64"],
    );
    let mut s = scheduler(&a, true);
    let ps = prompts(32);
    let max = |i: usize| 4 + (i * 5) % 20;
    let rx: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            s.submit(Request::greedy(p.clone(), max(i)), tx);
            rx
        })
        .collect();
    let (out, peak) = drain(&mut s, rx);
    assert_eq!(peak, 8, "continuous batching fills the batch");
    for (i, (tokens, end)) in out.iter().enumerate() {
        let want = alone(&a, &ps[i], max(i));
        assert_eq!(tokens, &want, "request {i}");
        match end {
            Some(Event::Finished { usage, reason }) => {
                assert_eq!(usage.prompt_tokens, ps[i].len());
                assert_eq!(usage.completion_tokens, want.len());
                assert_eq!(*reason, FinishReason::Length);
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
    assert_eq!(
        s.kv().pages().free_pages() + s.cached_only_pages(),
        s.kv().pages().total_pages()
    );
}

#[test]
fn a_shared_prefix_is_served_from_the_cache_with_the_same_tokens() {
    let (_t, a) = tmp_artifact("prefix.maxc", &[]);
    let prefix: Vec<i64> = (0..40).map(|j| (j * 37 % 900) as i64 + 5).collect();
    let p1: Vec<i64> = prefix.iter().copied().chain([7, 8, 9]).collect();
    let p2: Vec<i64> = prefix.iter().copied().chain([11, 12]).collect();
    let run = |caching: bool| {
        let mut s = scheduler(&a, caching);
        let mut results = Vec::new();
        for p in [&p1, &p2] {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            s.submit(Request::greedy(p.clone(), 10), tx);
            results.push(drain(&mut s, vec![rx]).0.remove(0));
        }
        results
    };
    let with = run(true);
    let without = run(false);
    for (w, o) in with.iter().zip(&without) {
        assert_eq!(w.0, o.0);
    }
    let cached = |r: &Outcome| match &r.1 {
        Some(Event::Finished { usage, .. }) => usage.cached_tokens,
        other => panic!("{other:?}"),
    };
    assert_eq!(cached(&with[0]), 0);
    assert_eq!(
        cached(&with[1]),
        32,
        "two full pages of the shared 40 tokens"
    );
    assert_eq!(cached(&without[1]), 0);
    assert_eq!(with[1].0, alone(&a, &p2, 10));
}

#[test]
fn a_small_kv_cache_preempts_and_completes_every_request_correctly() {
    // 12 pages of 16 tokens; 8 requests of up to 60 tokens need 4 pages each.
    let (_t, a) = tmp_artifact(
        "small.maxc",
        &["--max-batch-size", "8", "--kv-cache-pages", "12"],
    );
    let mut s = scheduler(&a, true);
    let ps: Vec<Vec<i64>> = (0..8)
        .map(|i| {
            (0..30 + i)
                .map(|j| ((i * 53 + j * 11) % 1000) as i64 + 1)
                .collect()
        })
        .collect();
    let rx: Vec<_> = ps
        .iter()
        .map(|p| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let mut r = Request::greedy(p.clone(), 24);
            r.ignore_eos = true;
            s.submit(r, tx);
            rx
        })
        .collect();
    assert_eq!(s.kv().pages().total_pages(), 12);
    let (out, _, preempted) = drain_counting(&mut s, rx);
    assert!(preempted > 0, "the load must not fit without preemption");
    for (i, (tokens, end)) in out.iter().enumerate() {
        assert!(matches!(end, Some(Event::Finished { .. })), "{i}: {end:?}");
        let mut e = Scheduler::alone(Engine::open(&a, "decoder").unwrap());
        let opts = GenerateOptions {
            max_new_tokens: 24,
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        };
        assert_eq!(
            tokens,
            &generate(&mut e, &ps[i], &opts, |_| {}).unwrap(),
            "request {i}"
        );
    }
}

#[test]
fn a_cancelled_request_frees_its_pages() {
    let (_t, a) = tmp_artifact("cancel.maxc", &[]);
    let mut s = scheduler(&a, false);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut r = Request::greedy((1..40).collect(), 50);
    r.ignore_eos = true;
    s.submit(r, tx);
    s.step();
    s.step();
    assert!(s.kv().pages().free_pages() < s.kv().pages().total_pages());
    drop(rx);
    s.step();
    assert!(!s.has_work());
    assert_eq!(s.kv().pages().free_pages(), s.kv().pages().total_pages());
}

#[test]
fn data_parallel_replicas_fill_their_own_batches_in_one_step() {
    let (_t, a) = tmp_artifact(
        "dp.maxc",
        &[
            "--max-batch-size",
            "4",
            "--data-parallel-degree",
            "2",
            "--max-batch-input-tokens",
            "32",
        ],
    );
    let mut s = scheduler(&a, true);
    let ps = prompts(16);
    let rx: Vec<_> = ps
        .iter()
        .map(|p| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            s.submit(Request::greedy(p.clone(), 6), tx);
            rx
        })
        .collect();
    let (out, peak) = drain(&mut s, rx);
    assert_eq!(peak, 8, "two replicas of four contexts each");
    for (i, (tokens, _)) in out.iter().enumerate() {
        assert_eq!(tokens, &alone(&a, &ps[i], 6), "request {i}");
    }
}

/// Pages a sequence of `len` tokens holds between steps in a sliding group of window `w` over
/// pages of `page` tokens: from the page of position `len + 1 - w` on.
fn window_pages(len: usize, w: usize, page: usize) -> usize {
    len.div_ceil(page) - (len + 1).saturating_sub(w) / page
}

#[test]
fn sliding_layers_hold_only_their_windows_pages_as_a_long_request_runs() {
    // tiny-gemma3: five sliding layers (window 8) and one full, at max_seq_len 512 in pages of
    // 16 tokens: six page groups of one layer each.
    let fixture = fixtures().join("tiny-gemma3");
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("gemma3.maxc");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(["compile", fixture.to_str().unwrap(), "--out"])
        .arg(&a)
        .args(["--quiet", "--weights", "f32", "--max-seq-len", "512"])
        .args(["--page-size", "16", "--max-batch-size", "4"])
        .args(["--max-batch-input-tokens", "64"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // What `maxc inspect` says a sequence at max_seq_len holds: the full layer's 32 pages and
    // one page for each sliding layer, against 6 × 32 without windows.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(["inspect", a.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let kv = &r["roles"]["decoder"]["kv"];
    assert_eq!(kv["pages_per_sequence"], 32 + 5, "{kv}");
    assert_eq!(kv["pages_per_sequence_without_windows"], 6 * 32, "{kv}");
    assert_eq!(kv["bytes_per_sequence"], 37 * 16 * 2 * 2 * 32 * 4, "{kv}");

    // One request to max_seq_len with three short ones beside it that take the pages it hands
    // back; the used-blocks gauge follows what the sequences hold.
    let engine = Engine::open(&a, "decoder").unwrap();
    let mut cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
    cfg.prefix_caching = false;
    let metrics = Arc::new(Metrics::new());
    let mut s = Scheduler::new(engine, cfg, metrics.clone());
    let reference =
        maxc_graph::weights::read_safetensors_file(&fixture.join("reference.safetensors")).unwrap();
    let prompt = reference.get("p0.tokens").unwrap().to_i64("p0").unwrap();
    let long_max = 512 - prompt.len();
    let mut rx = Vec::new();
    let mut submit = |s: &mut Scheduler, p: Vec<i64>, max: usize| {
        let (tx, r) = tokio::sync::mpsc::unbounded_channel();
        let mut req = Request::greedy(p, max);
        req.ignore_eos = true;
        s.submit(req, tx);
        rx.push(r);
    };
    submit(&mut s, prompt.clone(), long_max);
    for p in prompts(3) {
        submit(&mut s, p.iter().map(|t| t % 1000).collect(), 60);
    }
    let mut series = Vec::new();
    let mut steps = 0;
    while s.has_work() {
        s.step();
        steps += 1;
        assert!(steps < 2000);
        assert_eq!(s.kv().audit(), Ok(()));
        let t = s.kv().pages();
        let used = metrics.cache_num_used_blocks.get() as usize;
        let held: usize = t.sequences().map(|q| t.held_pages(q)).sum();
        assert_eq!(used, held, "the gauge counts the pages sequences hold");
        for q in t.sequences() {
            let len = t.len(q);
            assert_eq!(
                t.held_pages(q),
                len.div_ceil(16) + 5 * window_pages(len, 8, 16),
                "sequence {q} at {len} tokens"
            );
        }
        if let Some(q) = t
            .sequences()
            .next()
            .filter(|&q| t.len(q).is_multiple_of(64))
        {
            series.push((t.len(q), used));
        }
    }
    println!("tiny-gemma3 long request (tokens, maxserve_cache_num_used_blocks): {series:?}");
    assert!(series.len() >= 6, "{series:?}");

    // Its tokens against the interpreter run over the whole sequence at once (no page ever
    // freed): equal wherever the interpreter's margin is above 1e-2.
    let mut tokens = Vec::new();
    while let Ok(e) = rx[0].try_recv() {
        if let Event::Token { id, .. } = e {
            tokens.push(id);
        }
    }
    assert_eq!(tokens.len(), long_max);
    let opts = maxc_graph::pipeline::LoadOptions::default();
    let mut loaded =
        maxc_graph::pipeline::load_model(&fixture, &maxc_graph::Registry::builtin(), &opts)
            .unwrap();
    let rg = loaded.roles.pop_first().unwrap().1;
    let interp = maxc_graph::interp::Interpreter::new(rg.graph, &rg.weights).unwrap();
    let mut session = maxc_graph::interp::Session::new(&interp, 32, 32);
    let mut all = prompt.clone();
    all.extend(&tokens[..tokens.len() - 1]);
    let logits = session.step_all(&[(0, &all)]).unwrap();
    let mut checked = 0;
    for (i, &t) in tokens.iter().enumerate() {
        let row = logits.row(prompt.len() - 1 + i);
        let mut sorted: Vec<f32> = row.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 1e-2 {
            let best = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap();
            assert_eq!(t, best as i64, "token {i}");
            checked += 1;
        }
    }
    println!(
        "{checked} of {} tokens past the margin, all equal",
        tokens.len()
    );
    assert!(
        checked > tokens.len() * 9 / 10,
        "{checked} of {}",
        tokens.len()
    );
}
