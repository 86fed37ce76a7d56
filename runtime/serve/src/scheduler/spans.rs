//! The spans of a scheduler's passes: which passes time their launches (`gpu_profiling`, armed
//! kernel captures), `max.batch` spans linked to their requests, forward-pass and launch spans,
//! and each request's kernel capture.

use super::active::ArmedCapture;
use super::plan::{Planned, StepPlan};
use super::state::Scheduler;
use crate::trace::{GpuProfiling, Span, SpanContext, TraceLevel};
use std::collections::BTreeMap;

/// This thread's name (or id), for kernel spans.
fn thread_name() -> String {
    let t = std::thread::current();
    t.name()
        .map_or_else(|| format!("{:?}", t.id()), str::to_string)
}

impl Scheduler {
    /// Times launches in the coming step where a capture records it or `gpu_profiling` is
    /// `detailed`.
    pub(super) fn choose_profiling(&mut self, plan: &[Planned]) {
        let want = self.tracing.tracer.is_on()
            && (self.tracing.profiling.gpu_profiling == GpuProfiling::Detailed
                || plan.iter().any(|p| {
                    self.running[p.idx]
                        .capture
                        .as_ref()
                        .is_some_and(ArmedCapture::recording)
                }));
        if want != self.profiling_on {
            match self.exec.set_profiling(want) {
                Ok(()) => self.profiling_on = want,
                Err(e) => {
                    // Once: the tracer stays on, launches go untimed.
                    tracing::warn!("kernel timings: {e}");
                    self.tracing.profiling.gpu_profiling = GpuProfiling::Off;
                    for a in self.running.iter_mut().chain(self.waiting.iter_mut()) {
                        a.capture = None;
                    }
                    self.tracing.headers = false;
                }
            }
        }
    }

    /// The spans of a pass over `plan` that ran from `start` to `end` (Unix nanoseconds):
    /// `max.batch` (at level `batch`, or where a request in it carries a trace header) linked
    /// to the requests it ran, at most `kernel_trace_max_batch_links`; `gpu_profiling`'s
    /// forward-pass span (and launch spans where `detailed`); and the pass in each armed
    /// capture.
    pub(super) fn trace_pass(&mut self, plan: &StepPlan, start: u64, end: u64) {
        let plan = &plan.rows;
        let pass = self.passes;
        self.passes += 1;
        let t = &self.tracing;
        if !t.tracer.is_on() {
            return;
        }
        // Each traced request once (an HTTP request's `n` choices share its span).
        let mut traced: Vec<&crate::trace::RequestTrace> = Vec::new();
        for p in plan {
            if let Some(r) = self.running[p.idx].req.trace.as_ref() {
                if !traced.iter().any(|t| t.ctx == r.ctx) {
                    traced.push(r);
                }
            }
        }
        let rows: usize = plan.iter().map(|p| p.rows()).sum();
        let prefill = plan.iter().any(|p| !self.running[p.idx].is_decode());
        if t.level >= TraceLevel::Batch || traced.iter().any(|r| r.header.is_some()) {
            let cap =
                usize::try_from(t.profiling.kernel_trace_max_batch_links).unwrap_or(usize::MAX);
            let links: Vec<SpanContext> = traced.iter().take(cap).map(|r| r.ctx).collect();
            let mut attributes = BTreeMap::new();
            attributes.insert("max.batch.pass".into(), pass.into());
            attributes.insert("max.batch.size".into(), plan.len().into());
            attributes.insert("max.batch.tokens".into(), rows.into());
            attributes.insert(
                "max.batch.type".into(),
                if prefill { "CE" } else { "TG" }.into(),
            );
            attributes.insert(
                "max.batch.links_dropped".into(),
                (traced.len() - links.len()).into(),
            );
            t.tracer.export(Span {
                name: "max.batch".into(),
                ctx: SpanContext::new_root(),
                parent: None,
                start_unix_ns: start,
                end_unix_ns: end,
                attributes,
                links,
            });
        }
        let profile = if self.profiling_on {
            self.exec.last_profile().cloned()
        } else {
            None
        };
        if t.profiling.gpu_profiling != GpuProfiling::Off {
            let ctx = SpanContext::new_root();
            let mut attributes = BTreeMap::new();
            attributes.insert("max.pass".into(), pass.into());
            attributes.insert("max.pass.total_seq_len".into(), rows.into());
            attributes.insert("max.pass.batch_size".into(), plan.len().into());
            t.tracer.export(Span {
                name: "max.forward".into(),
                ctx,
                parent: None,
                start_unix_ns: start,
                end_unix_ns: end,
                attributes,
                links: Vec::new(),
            });
            if let (GpuProfiling::Detailed, Some(profile)) = (t.profiling.gpu_profiling, &profile) {
                let Some(program) = self.exec.program() else {
                    return;
                };
                for l in &profile.launches {
                    let Some(launch) = program.launches.get(l.launch) else {
                        continue;
                    };
                    let Some(k) = program.kernels.get(launch.kernel as usize) else {
                        continue;
                    };
                    let launch = crate::trace::capture::CapturedLaunch {
                        name: k.name.clone(),
                        kind: k.body.kind().to_string(),
                        nodes: launch.nodes.clone(),
                        start_unix_ns: start + l.start_ns,
                        dur_ns: l.dur_ns,
                        thread: thread_name(),
                    };
                    t.tracer
                        .export(crate::trace::capture::kernel_span(&launch, &ctx));
                }
            }
        }
        if let Some(profile) = &profile {
            let thread = thread_name();
            for p in plan {
                let a = &mut self.running[p.idx];
                let Some(armed) = a.capture.as_mut() else {
                    continue;
                };
                let Some(c) = armed.capture.as_mut() else {
                    continue;
                };
                let Some(program) = self.exec.program() else {
                    break;
                };
                if let Err(e) = c.record(program, profile, start, &thread) {
                    tracing::warn!("kernel capture: {e}; capture stopped");
                    armed.capture = None;
                    continue;
                }
                if c.is_full() {
                    armed.finish();
                }
            }
        }
    }
}
