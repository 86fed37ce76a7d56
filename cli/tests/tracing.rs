//! Traces of the scheduler, without HTTP: `max.batch` spans link exactly the requests of their
//! pass (capped at `kernel_trace_max_batch_links`); a request's kernel capture stops at
//! `kernel_trace_max_passes` and its replay exports at most `kernel_trace_max_spans` spans;
//! an oversized capture stays on disk and exports none; `gpu_profiling: detailed` on the CPU
//! gives a forward-pass span with a span per launch.

use maxc_golden::fixtures;
use maxc_runtime::Engine;
use maxc_serve::metrics::Metrics;
use maxc_serve::scheduler::{Event, Request, Scheduler, SchedulerConfig};
use maxc_serve::trace::{
    ExportOptions, GpuProfiling, ProfilingConfig, RequestTrace, SpanContext, StepTracing,
    TraceLevel, Tracer,
};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use tokio::sync::mpsc::UnboundedReceiver;

/// tiny-llama compiled once for every test here.
fn artifact() -> &'static Path {
    static A: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &A.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tiny.maxc");
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
            .args(["compile"])
            .arg(fixtures().join("tiny-llama"))
            .arg("--out")
            .arg(&out)
            .args(["--quiet", "--max-seq-len", "128", "--page-size", "16"])
            .args(["--max-batch-size", "8", "--max-batch-input-tokens", "256"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (tmp, out)
    })
    .1
}

struct Traced {
    sched: Scheduler,
    tracer: Tracer,
    file: PathBuf,
    capture_dir: PathBuf,
    _tmp: tempfile::TempDir,
}

fn traced(level: TraceLevel, headers: bool, profiling: ProfilingConfig) -> Traced {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("spans.jsonl");
    let capture_dir = tmp.path().join("captures");
    let tracer = Tracer::start(&ExportOptions {
        file: Some(file.clone()),
        otlp: false,
    })
    .unwrap();
    let engine = Engine::open(artifact(), "decoder").unwrap();
    let mut cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
    cfg.prefix_caching = false;
    let sched = Scheduler::new(engine, cfg, Arc::new(Metrics::new())).with_tracing(StepTracing {
        tracer: tracer.clone(),
        level,
        headers,
        profiling,
        capture_dir: capture_dir.clone(),
    });
    Traced {
        sched,
        tracer,
        file,
        capture_dir,
        _tmp: tmp,
    }
}

impl Traced {
    fn submit(
        &mut self,
        prompt_len: usize,
        max_tokens: usize,
        header: Option<TraceLevel>,
        traced: bool,
    ) -> (Option<SpanContext>, UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let prompt = (0..prompt_len as i64)
            .map(|j| (j * 37 + max_tokens as i64) % 1000 + 1)
            .collect();
        let mut req = Request::greedy(prompt, max_tokens);
        req.ignore_eos = true;
        let ctx = traced.then(SpanContext::new_root);
        req.trace = ctx.map(|ctx| RequestTrace { ctx, header });
        self.sched.submit(req, tx);
        (ctx, rx)
    }

    /// Runs to the end; returns the spans written.
    fn run(&mut self) -> Vec<Value> {
        let mut steps = 0;
        while self.sched.has_work() {
            self.sched.step();
            steps += 1;
            assert!(steps < 1000);
        }
        self.tracer.flush();
        std::fs::read_to_string(&self.file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

fn links(span: &Value) -> BTreeSet<String> {
    span["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["span_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn batch_spans_link_exactly_the_requests_of_each_pass_capped_at_the_limit() {
    let cap = 4;
    let mut t = traced(
        TraceLevel::Batch,
        false,
        ProfilingConfig {
            kernel_trace_max_batch_links: cap,
            ..Default::default()
        },
    );
    // Request i runs i + 1 passes: its prefill, then i decode steps; all fit one batch.
    let n = 6;
    let reqs: Vec<_> = (0..n).map(|i| t.submit(5 + i, i + 1, None, true)).collect();
    let spans = t.run();
    let mut batches = named(&spans, "max.batch");
    batches.sort_by_key(|s| s["attributes"]["max.batch.pass"].as_u64().unwrap());
    assert_eq!(batches.len(), n, "one max.batch span per pass");
    for (j, b) in batches.iter().enumerate() {
        // Pass j runs the requests with more than j passes.
        let expected: BTreeSet<String> = reqs[j..]
            .iter()
            .map(|(ctx, _)| ctx.unwrap().span_hex())
            .collect();
        let got = links(b);
        let a = &b["attributes"];
        assert_eq!(
            a["max.batch.size"].as_u64(),
            Some((n - j) as u64),
            "pass {j}"
        );
        if expected.len() <= cap as usize {
            assert_eq!(
                got, expected,
                "pass {j}: the links name exactly its requests"
            );
            assert_eq!(a["max.batch.links_dropped"].as_u64(), Some(0));
        } else {
            assert_eq!(got.len(), cap as usize, "pass {j}: capped");
            assert!(
                got.is_subset(&expected),
                "pass {j}: links name only its requests"
            );
            assert_eq!(
                a["max.batch.links_dropped"].as_u64(),
                Some((expected.len() - cap as usize) as u64),
                "pass {j}: the rest are counted"
            );
        }
        assert_eq!(b["parent_span_id"], Value::Null);
        assert!(b["end_unix_nano"].as_u64() >= b["start_unix_nano"].as_u64());
    }
    assert_eq!(batches[0]["attributes"]["max.batch.type"], "CE");
    assert_eq!(batches[1]["attributes"]["max.batch.type"], "TG");
}

#[test]
fn at_level_none_only_a_request_with_a_header_gets_batch_spans() {
    let mut t = traced(TraceLevel::None, false, ProfilingConfig::default());
    let (_, _a) = t.submit(6, 3, None, false);
    let (ctx, _b) = t.submit(7, 2, Some(TraceLevel::Batch), true);
    let spans = t.run();
    let batches = named(&spans, "max.batch");
    // The traced request runs 2 passes; the other one a third pass alone, untraced.
    assert_eq!(batches.len(), 2, "{spans:#?}");
    for b in batches {
        assert_eq!(links(b), BTreeSet::from([ctx.unwrap().span_hex()]));
    }
}

#[test]
fn a_kernel_capture_stops_at_max_passes_and_exports_at_most_max_spans() {
    let (passes, max_spans) = (3u64, 10u64);
    let mut t = traced(
        TraceLevel::None,
        true,
        ProfilingConfig {
            kernel_trace_max_passes: passes,
            kernel_trace_max_spans: max_spans,
            ..Default::default()
        },
    );
    let (ctx, _rx) = t.submit(9, 8, Some(TraceLevel::Kernel), true);
    let (_, _other) = t.submit(4, 8, None, false);
    let spans = t.run();
    let ctx = ctx.unwrap();
    let in_trace: Vec<&Value> = spans
        .iter()
        .filter(|s| s["trace_id"] == ctx.trace_hex().as_str() && s["name"] != "max.batch")
        .collect();
    let pass_spans: Vec<&Value> = in_trace
        .iter()
        .copied()
        .filter(|s| s["name"] == "max.pass")
        .collect();
    assert_eq!(
        pass_spans.len() as u64,
        passes,
        "the capture stops after {passes} of 8 passes"
    );
    assert_eq!(
        in_trace.len() as u64,
        max_spans,
        "at most kernel_trace_max_spans spans"
    );
    for p in &pass_spans {
        assert_eq!(p["parent_span_id"], ctx.span_hex().as_str());
    }
    let pass_ids: BTreeSet<&str> = pass_spans
        .iter()
        .map(|p| p["span_id"].as_str().unwrap())
        .collect();
    let kernels: Vec<&&Value> = in_trace
        .iter()
        .filter(|s| s["name"] != "max.pass")
        .collect();
    assert_eq!(
        kernels.len() as u64,
        max_spans - passes,
        "pass summaries first, then kernels"
    );
    for k in &kernels {
        assert!(pass_ids.contains(k["parent_span_id"].as_str().unwrap()));
        assert!(k["attributes"]["max.kernel.kind"].is_string());
        assert_eq!(
            k["attributes"]["thread.name"].as_str(),
            std::thread::current().name(),
            "launched on the thread that ran the step"
        );
        assert!(!k["attributes"]["max.kernel.nodes"]
            .as_array()
            .unwrap()
            .is_empty());
    }
    // Every launch of the captured passes was counted; those over the limit were dropped.
    let launches: u64 = pass_spans
        .iter()
        .map(|p| p["attributes"]["max.pass.launches"].as_u64().unwrap())
        .sum();
    let stats = t.tracer.stats().unwrap();
    assert_eq!(
        stats.spans_dropped.load(Ordering::Relaxed),
        passes + launches - max_spans
    );
    // The replayed capture file is gone.
    assert_eq!(std::fs::read_dir(&t.capture_dir).unwrap().count(), 0);
}

#[test]
fn an_oversized_capture_stays_on_disk_and_exports_nothing() {
    let mut t = traced(
        TraceLevel::None,
        true,
        ProfilingConfig {
            kernel_trace_max_capture_bytes: 100,
            ..Default::default()
        },
    );
    let (ctx, _rx) = t.submit(5, 2, Some(TraceLevel::Kernel), true);
    let spans = t.run();
    let ctx = ctx.unwrap();
    assert!(
        spans
            .iter()
            .all(|s| s["trace_id"] != ctx.trace_hex().as_str() || s["name"] == "max.batch"),
        "no capture spans"
    );
    assert_eq!(named(&spans, "max.pass").len(), 0);
    let stats = t.tracer.stats().unwrap();
    assert_eq!(stats.captures_oversized.load(Ordering::Relaxed), 1);
    let kept: Vec<_> = std::fs::read_dir(&t.capture_dir).unwrap().collect();
    assert_eq!(kept.len(), 1, "the capture stays on disk");
    let file = kept[0].as_ref().unwrap().path();
    assert!(std::fs::metadata(&file).unwrap().len() > 100);
    // It holds both passes, readable.
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.lines().count(), 2);
}

#[test]
fn without_headers_a_kernel_header_arms_no_capture() {
    let mut t = traced(TraceLevel::Batch, false, ProfilingConfig::default());
    let (_, _rx) = t.submit(5, 3, Some(TraceLevel::Kernel), true);
    let spans = t.run();
    assert_eq!(named(&spans, "max.batch").len(), 3);
    assert_eq!(named(&spans, "max.pass").len(), 0);
    assert!(!t.capture_dir.exists() || std::fs::read_dir(&t.capture_dir).unwrap().count() == 0);
}

#[test]
fn detailed_gpu_profiling_on_the_cpu_gives_a_forward_span_with_each_launch() {
    let mut t = traced(
        TraceLevel::None,
        false,
        ProfilingConfig {
            gpu_profiling: GpuProfiling::Detailed,
            ..Default::default()
        },
    );
    let launches = Engine::open(artifact(), "decoder")
        .unwrap()
        .program()
        .launches
        .len();
    let (_, _rx) = t.submit(5, 3, None, false);
    let spans = t.run();
    let forwards = named(&spans, "max.forward");
    assert_eq!(forwards.len(), 3);
    for f in forwards {
        let children = spans
            .iter()
            .filter(|s| s["parent_span_id"] == f["span_id"])
            .count();
        assert_eq!(children, launches, "one span per launch of the pass");
    }
    assert_eq!(
        named(&spans, "max.batch").len(),
        0,
        "level none: no batch spans"
    );
}
