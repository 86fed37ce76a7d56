//! Per-launch timings of a step, for `maxc profile` and traces, and how much of a pass the
//! executors time (`gpu_profiling`).

use crate::schema::{KernelBody, Program, Rows, StepDim};
use serde::Deserialize;

/// NVTX ranges on the CUDA executor (spans on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuProfiling {
    /// Nothing.
    #[default]
    Off,
    /// A range (span) around each forward pass.
    On,
    /// A range (span) around each forward pass and each kernel launch.
    Detailed,
}

impl std::str::FromStr for GpuProfiling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(GpuProfiling::Off),
            "on" => Ok(GpuProfiling::On),
            "detailed" => Ok(GpuProfiling::Detailed),
            other => Err(format!(
                "unknown gpu_profiling `{other}` (expected off, on or detailed)"
            )),
        }
    }
}

/// One kernel launch of a profiled step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchTiming {
    /// Index into the program's launches.
    pub launch: usize,
    /// Start, in nanoseconds since the step began.
    pub start_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// Whether it ran as generated code (else a library kernel).
    pub generated: bool,
}

/// A profiled step: its sizes and every launch's timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepProfile {
    /// The step's dims in [`StepDim`] slot order.
    pub dims: [u64; StepDim::COUNT],
    /// Wall time of the whole step (inputs, launches, logits), in nanoseconds.
    pub total_ns: u64,
    /// The launches in order.
    pub launches: Vec<LaunchTiming>,
    /// Each sequence's tokens cached before the step and its new rows: what attention reads.
    pub seqs: Vec<(u64, u64)>,
}

impl StepProfile {
    /// Keys the step's rows attend, summed over rows (`window`: a row sees at most that many
    /// positions), and keys read from the cache, each sequence's context once.
    pub fn attention_keys(&self, window: Option<u64>) -> (u64, u64) {
        let w = window.unwrap_or(u64::MAX);
        self.seqs
            .iter()
            .fold((0, 0), |(rows, ctx), &(cached, new)| {
                // Row j (position cached + j) sees min(cached + j + 1, w) keys.
                let seen: u64 = (0..new).map(|j| (cached + j + 1).min(w)).sum();
                (rows + seen, ctx + (cached + new).min(w.saturating_add(new)))
            })
    }
}

/// Bytes a kernel moves and floating-point operations it does in `step`, estimated from its
/// body: every operand read once and every output written once (weights at their dtype's size,
/// activations as f32), multiply-adds counted as two operations; attention by the keys its
/// sequences hold (each context read once, each row's scores and values over the keys it sees).
pub fn kernel_cost(body: &KernelBody, step: &StepProfile) -> (u64, u64) {
    let dims = &step.dims;
    let rows = |r: &Rows| match r {
        Rows::Step(d) => dims[*d as usize],
        Rows::Fixed(n) => *n,
    };
    let t = dims[StepDim::TotalSeqLen as usize];
    match body {
        KernelBody::Matmul {
            rows: r,
            n,
            k,
            weight_dtype,
            bias,
        } => {
            let m = rows(r);
            let w = weight_dtype.bytes_for(n * k).unwrap_or(0) + if *bias { n * 4 } else { 0 };
            (w + 4 * (m * k + m * n), 2 * m * n * k)
        }
        KernelBody::MoeExperts {
            rows: r,
            hidden,
            ffn,
            experts,
            weight_dtype,
        } => {
            let m = rows(r);
            let w = weight_dtype
                .bytes_for(3 * hidden * ffn * experts)
                .unwrap_or(0);
            (w + 8 * m * hidden, 6 * m * hidden * ffn * experts)
        }
        KernelBody::Attention {
            heads,
            kv_heads,
            head_dim,
            value_dim,
            planes,
            window,
            kv_dtype,
            ..
        } => {
            let (attended, ctx) = step.attention_keys(*window);
            let kv = planes * ctx * kv_heads * kv_dtype.row_bytes(*head_dim);
            (
                kv + 4 * t * heads * (head_dim + value_dim),
                2 * attended * heads * (head_dim + value_dim),
            )
        }
        other => {
            let elems = other.work(dims);
            (8 * elems, elems)
        }
    }
}

/// One kernel's share of a set of profiled steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelSummary {
    /// The kernel's name.
    pub name: String,
    /// Its kind.
    pub kind: &'static str,
    /// Launches.
    pub launches: u64,
    /// Total time, in nanoseconds.
    pub total_ns: u64,
    /// Estimated bytes moved.
    pub bytes: u64,
    /// Estimated floating-point operations.
    pub flops: u64,
}

/// Per-kernel totals over `steps`, most expensive first.
pub fn summarize(program: &Program, steps: &[StepProfile]) -> Vec<KernelSummary> {
    let mut by: Vec<KernelSummary> = program
        .kernels
        .iter()
        .map(|k| KernelSummary {
            name: k.name.clone(),
            kind: k.body.kind(),
            ..Default::default()
        })
        .collect();
    for s in steps {
        for l in &s.launches {
            let k = program.launches[l.launch].kernel as usize;
            let (bytes, flops) = kernel_cost(&program.kernels[k].body, s);
            let e = &mut by[k];
            e.launches += 1;
            e.total_ns += l.dur_ns;
            e.bytes += bytes;
            e.flops += flops;
        }
    }
    by.retain(|k| k.launches > 0);
    by.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then(a.name.cmp(&b.name)));
    by
}

/// The steps as Chrome / Perfetto trace-event JSON: one `step` span per pass (thread 1) and
/// one span per launch inside it (thread 2), times in microseconds.
pub fn trace_json(program: &Program, steps: &[(String, StepProfile)]) -> serde_json::Value {
    let mut events = Vec::new();
    let mut t0 = 0u64;
    for (label, s) in steps {
        events.push(serde_json::json!({
            "name": label, "cat": "step", "ph": "X", "pid": 1, "tid": 1,
            "ts": t0 as f64 / 1e3, "dur": s.total_ns as f64 / 1e3,
            "args": {"total_seq_len": s.dims[0], "batch_size": s.dims[1]},
        }));
        for l in &s.launches {
            let launch = &program.launches[l.launch];
            let k = &program.kernels[launch.kernel as usize];
            events.push(serde_json::json!({
                "name": k.name, "cat": k.body.kind(), "ph": "X", "pid": 1, "tid": 2,
                "ts": (t0 + l.start_ns) as f64 / 1e3, "dur": l.dur_ns as f64 / 1e3,
                "args": {"launch": l.launch, "nodes": launch.nodes, "generated": l.generated},
            }));
        }
        t0 += s.total_ns;
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(seqs: Vec<(u64, u64)>) -> StepProfile {
        let mut dims = [0; StepDim::COUNT];
        dims[StepDim::TotalSeqLen as usize] = seqs.iter().map(|s| s.1).sum();
        // A page table as wide as the artifact allows: attention's cost must not follow it.
        dims[StepDim::MaxNumPages as usize] = 128;
        StepProfile {
            dims,
            total_ns: 0,
            launches: Vec::new(),
            seqs,
        }
    }

    #[test]
    fn attention_is_costed_by_the_keys_its_rows_see() {
        // A decode row after 9 cached tokens sees 10 keys; a 3-row prefill from empty sees
        // 1 + 2 + 3.
        let s = step(vec![(9, 1), (0, 3)]);
        assert_eq!(s.attention_keys(None), (16, 13));
        // A window of 4: the decode row sees 4 keys, the prefill rows 1 + 2 + 3.
        assert_eq!(s.attention_keys(Some(4)), (10, 5 + 3));
        let body = KernelBody::Attention {
            planes: 2,
            value_dim: 64,
            layer: 0,
            num_layers: 1,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            scale: 0.125,
            window: None,
            kv_dtype: crate::schema::KvDtype::F32,
        };
        let (bytes, flops) = kernel_cost(&body, &s);
        // Scores and values: 2 · (64 + 64) per head per key seen.
        assert_eq!(flops, 2 * 16 * 4 * 128);
        // Every context's keys and values once, plus each row's query and output.
        assert_eq!(bytes, 2 * 13 * 2 * 64 * 4 + 4 * 4 * 4 * 128);
    }
}
