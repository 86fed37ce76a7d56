//! `maxc profile ARTIFACT`: times every kernel launch of a prefill and of decode steps on the
//! CPU, prints per kernel its launches, time, share of the step and achieved GB/s and GFLOP/s
//! (from each kernel's estimated bytes and operations), and writes a Chrome / Perfetto trace.

use crate::args::parse_tokens;
use anyhow::{bail, Context, Result};
use maxc_runtime::profile::{summarize, trace_json, StepProfile};
use maxc_runtime::sampling::argmax;
use maxc_runtime::Session;
use std::path::PathBuf;

/// Arguments of `maxc profile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    pub artifact: PathBuf,
    /// The prompt as token ids [default: 128 tokens made up from the vocabulary].
    #[arg(long)]
    pub tokens: Option<String>,
    /// The prompt as text, tokenized with the artifact's tokenizer.
    #[arg(long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Decode steps to time after the prefill.
    #[arg(long, default_value = "16")]
    pub steps: usize,
    /// Sequences decoded together (each with the same prompt).
    #[arg(long, default_value = "1")]
    pub batch: usize,
    /// Write a trace-event JSON file (opens in Perfetto or chrome://tracing).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The role to profile.
    #[arg(long, default_value = "decoder")]
    pub role: String,
    #[command(flatten)]
    pub activations: crate::args::ActivationArgs,
}

/// Profiles and prints.
pub fn run(args: Args) -> Result<()> {
    let mut engine = args.activations.open_cpu(&args.artifact, &args.role)?;
    let vocab = engine.engine().vocab_size() as i64;
    let prompt: Vec<i64> = match (&args.tokens, &args.prompt) {
        (Some(t), _) => parse_tokens(t)?,
        (None, Some(text)) => {
            maxc_serve::tokenizer::Tokenizer::of_artifact(engine.engine().artifact())?
                .with_context(|| {
                    format!(
                        "{} has no tokenizer; pass --tokens",
                        args.artifact.display()
                    )
                })?
                .encode(text, true)?
                .into_iter()
                .map(i64::from)
                .collect()
        }
        (None, None) => (0..128)
            .map(|i| (i * 7919 + 13) % vocab.min(1000) + 3.min(vocab - 1))
            .collect(),
    };
    if args.batch == 0 {
        bail!("--batch: expected at least 1");
    }
    if prompt.len() * args.batch > engine.engine().max_step_tokens() {
        bail!(
            "--batch {} × {} prompt tokens exceeds the artifact's step budget of {} tokens",
            args.batch,
            prompt.len(),
            engine.engine().max_step_tokens()
        );
    }
    if prompt.len() + args.steps > engine.engine().max_seq_len() {
        bail!(
            "{} prompt tokens + {} steps exceed the artifact's max_seq_len {}",
            prompt.len(),
            args.steps,
            engine.engine().max_seq_len()
        );
    }
    engine.engine_mut().set_profiling(true)?;
    let seqs: Vec<u64> = (0..args.batch as u64).collect();
    let chunks: Vec<(u64, &[i64])> = seqs.iter().map(|&s| (s, prompt.as_slice())).collect();
    let logits = engine.step(&chunks)?;
    let take = |e: &Session| {
        e.engine()
            .last_profile()
            .cloned()
            .context("no profile recorded")
    };
    let prefill: StepProfile = take(&engine)?;
    // The decode steps on the weights as they settle behind the first step (their huge-page
    // copy, the repacked ones).
    engine.engine_mut().settle_weights();
    let mut next: Vec<i64> = (0..args.batch)
        .map(|b| {
            argmax(logits.row(if logits.rows == args.batch {
                b
            } else {
                (b + 1) * prompt.len() - 1
            })) as i64
        })
        .collect();
    let mut decode = Vec::new();
    for _ in 0..args.steps {
        let toks: Vec<[i64; 1]> = next.iter().map(|&t| [t]).collect();
        let chunks: Vec<(u64, &[i64])> =
            seqs.iter().zip(&toks).map(|(&s, t)| (s, &t[..])).collect();
        let l = engine.step(&chunks)?;
        decode.push(take(&engine)?);
        next = (0..args.batch).map(|b| argmax(l.row(b)) as i64).collect();
    }
    let program = engine.engine().program().clone();
    println!("library kernels: {}", engine.engine().kernels().describe());
    if let Some(choices) = engine.engine().cpu_kernel_choices() {
        println!("kernels on this CPU (chosen at load):");
        for (k, c) in program.kernels.iter().zip(choices) {
            println!("  {:<32} {:<12} {}", k.name, k.body.kind(), c.describe());
        }
    }
    if let Some(plans) = engine.engine().cpu_matmul_plans() {
        println!("library matmul paths on this CPU (chosen at load, by weight format and k):");
        print_matmul_plans(
            plans
                .into_iter()
                .map(|(_, plan)| (plan.dtype(), plan.k() as u64, plan.describe())),
        );
    }
    if let Some(repacked) = engine.engine().cpu_repacked_weights() {
        let mut by: std::collections::BTreeMap<String, (usize, usize, usize)> = Default::default();
        for w in repacked {
            let layout = match w.layout {
                maxc_runtime::kernels::matmul::Layout::Rows => "",
                maxc_runtime::kernels::matmul::Layout::Columns => " in 32-column panels (at load)",
            };
            let e = by
                .entry(format!("{:?} as {:?}{layout}", w.stored, w.read_as))
                .or_default();
            *e = (e.0 + 1, e.1 + w.stored_bytes, e.2 + w.read_bytes);
        }
        for (what, (n, fb, tb)) in by {
            println!(
                "weights repacked (MAXC_REPACK=0 keeps them as stored): {n} {what}, {:.1} MB -> {:.1} MB",
                fb as f64 / 1e6,
                tb as f64 / 1e6
            );
        }
    }
    // The machine's probes, measured now: a streaming read and an f32 GEMM on every core.
    let probes = Probes {
        bytes_per_s: maxc_runtime::bench::bandwidth(),
        flops: maxc_runtime::bench::gemm_flops(),
    };
    println!(
        "machine probes: {:.2} GB/s streaming read, {:.1} GFLOP/s f32 GEMM (1024³), {} threads",
        probes.bytes_per_s / 1e9,
        probes.flops / 1e9,
        maxc_runtime::kernels::pool::threads()
    );
    report(
        &probes,
        &program,
        &format!(
            "prefill: {} sequence(s) × {} tokens",
            args.batch,
            prompt.len()
        ),
        std::slice::from_ref(&prefill),
        (args.batch * prompt.len()) as f64,
    );
    if !decode.is_empty() {
        report(
            &probes,
            &program,
            &format!(
                "decode: {} step(s) of {} sequence(s)",
                decode.len(),
                args.batch
            ),
            &decode,
            (args.batch * decode.len()) as f64,
        );
    }
    if let Some(path) = &args.trace {
        let mut steps = vec![("prefill".to_string(), prefill)];
        steps.extend(
            decode
                .into_iter()
                .enumerate()
                .map(|(i, s)| (format!("decode {i}"), s)),
        );
        let json = trace_json(&program, &steps);
        std::fs::write(path, serde_json::to_string(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("trace written to {}", path.display());
    }
    Ok(())
}

/// What the machine achieves, to rate kernels against.
struct Probes {
    bytes_per_s: f64,
    flops: f64,
}

fn report(
    probes: &Probes,
    program: &maxc_runtime::schema::Program,
    title: &str,
    steps: &[StepProfile],
    tokens: f64,
) {
    let total: u64 = steps.iter().map(|s| s.total_ns).sum();
    let launched: u64 = steps
        .iter()
        .flat_map(|s| &s.launches)
        .map(|l| l.dur_ns)
        .sum();
    println!(
        "{title}: {:.3} ms per step, {:.1} tokens/s ({:.1}% of the step in kernels)",
        total as f64 / 1e6 / steps.len() as f64,
        tokens / (total as f64 / 1e9),
        100.0 * launched as f64 / total.max(1) as f64
    );
    println!(
        "  {:<28} {:>8} {:>10} {:>9} {:>7} {:>8} {:>6} {:>9} {:>6}",
        "kernel", "launches", "total ms", "mean us", "share", "GB/s", "%BW", "GFLOP/s", "%GEMM"
    );
    for k in summarize(program, steps) {
        let secs = k.total_ns as f64 / 1e9;
        let (bw, fl) = (
            k.bytes as f64 / secs.max(1e-12),
            k.flops as f64 / secs.max(1e-12),
        );
        println!(
            "  {:<28} {:>8} {:>10.3} {:>9.1} {:>6.1}% {:>8.2} {:>5.0}% {:>9.2} {:>5.0}%",
            k.name,
            k.launches,
            k.total_ns as f64 / 1e6,
            k.total_ns as f64 / 1e3 / k.launches as f64,
            100.0 * k.total_ns as f64 / total.max(1) as f64,
            bw / 1e9,
            100.0 * bw / probes.bytes_per_s.max(1.0),
            fl / 1e9,
            100.0 * fl / probes.flops.max(1.0),
        );
    }
}

/// Prints matmul plans grouped by weight format, row length and path, with how many weights
/// each group holds: `(dtype, k, plan in words)` per weight.
pub fn print_matmul_plans(plans: impl Iterator<Item = (maxc_runtime::schema::DType, u64, String)>) {
    let mut groups: std::collections::BTreeMap<(String, u64, String), usize> = Default::default();
    for (dtype, k, plan) in plans {
        *groups.entry((dtype.to_string(), k, plan)).or_default() += 1;
    }
    for ((dtype, k, plan), count) in groups {
        println!("  {dtype:<6} k {k:<6} x{count:<4} {plan}");
    }
}
