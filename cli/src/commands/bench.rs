//! `maxc bench ARTIFACT`: prefill (128 and 512 tokens) and decode (batch 1, 8, 32) tokens/s,
//! load time and peak memory, each next to its roofline measured in the same run: decode bytes
//! per step over a memory-bandwidth probe, prefill FLOP/s over a GEMM probe.
//!
//! A shared machine's bandwidth moves with its neighbours' load (by several GB/s within
//! minutes), so one probe at the start and a measurement a minute later
//! can disagree by more than the kernels' own variation. Each measurement therefore runs in
//! rounds, each round right after its own probe, and its ratio is the median of the rounds'
//! ratios. The compute peaks (f32 FMA, 16-bit dot product) move with the neighbours too (a
//! sibling hyperthread's work takes issue slots), so the compute ratios are taken the same way:
//! each round over the peak measured just before it.

use anyhow::Result;
use maxc_runtime::bench::{bandwidth, fma_peak, gemm_flops, int16_peak, peak_rss, reset_peak_rss};
use maxc_runtime::profile::kernel_cost;
use maxc_runtime::Session;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `maxc bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    pub artifact: PathBuf,
    /// Decode steps timed per batch size and round.
    #[arg(long, default_value = "32")]
    pub steps: usize,
    /// Rounds per measurement, each after its own probe (the ratio is their median).
    #[arg(long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The role to benchmark.
    #[arg(long, default_value = "decoder")]
    pub role: String,
    /// Also decode one sequence after this many tokens of context (comma-separated, e.g.
    /// `2048,8192`): a row `decode_b1_ctx<N>` each, its prompt prefilled in step-budget
    /// chunks first. Needs an artifact whose max_seq_len holds the context and the steps.
    #[arg(long, value_delimiter = ',')]
    pub context: Vec<usize>,
    #[command(flatten)]
    pub activations: crate::args::ActivationArgs,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A made-up prompt of `n` tokens inside the vocabulary.
fn prompt(n: usize, vocab: i64, salt: i64) -> Vec<i64> {
    (0..n as i64)
        .map(|i| (i * 7919 + 13 + salt * 31) % vocab.clamp(1, 1000) + 3.min(vocab - 1))
        .collect()
}

/// Bytes and FLOPs of the last step's launches (the program at the step's dims).
fn step_cost(engine: &Session) -> (u64, u64) {
    let Some(p) = engine.engine().last_profile() else {
        return (0, 0);
    };
    let program = engine.engine().program();
    let (bytes, flops) = program.launches.iter().fold((0, 0), |(b, f), l| {
        let (lb, lf) = kernel_cost(&program.kernels[l.kernel as usize].body, p);
        (b + lb, f + lf)
    });
    // Repacked weights are read in their repacked format: each matmul that reads one
    // reads its repacked bytes, not the stored ones.
    let repacked = engine.engine().cpu_repacked_weights().unwrap_or_default();
    let extra: u64 = repacked
        .iter()
        .map(|w| {
            let readers = program
                .launches
                .iter()
                .filter(|l| l.buffers.get(1) == Some(&w.buffer))
                .count() as u64;
            readers * (w.read_bytes as u64).saturating_sub(w.stored_bytes as u64)
        })
        .sum();
    (bytes + extra, flops)
}

/// What [`timed_decode`] measured.
struct Decode {
    /// The median step, seconds.
    step_s: f64,
    /// Bytes and FLOPs of a step.
    bytes: u64,
    flops: u64,
    /// The median of each round's achieved bandwidth over the probe just before it.
    ratio: f64,
    /// The bandwidth probes' median, bytes/s.
    probe: f64,
    /// The median of each round's achieved FLOP/s over the compute ceiling measured just
    /// before it, where one was asked for and the CPU has it.
    compute_ratio: Option<f64>,
    /// The ceiling's probes' median, operations/s.
    compute_probe: Option<f64>,
}

impl Decode {
    /// A measurement row of `batch` sequences: speed, bytes and FLOPs against the bandwidth
    /// probe.
    fn row(&self, name: String, batch: usize) -> Value {
        let s = self.step_s;
        json!({
            "name": name,
            "tokens_per_s": batch as f64 / s,
            "step_ms": s * 1e3,
            "bytes_per_step": self.bytes,
            "achieved_gbs": self.bytes as f64 / s / 1e9,
            "roofline": "bandwidth_probe",
            "probe_gbs": self.probe / 1e9,
            "roofline_ratio": self.ratio,
            "flop_per_step": self.flops,
            "achieved_gflops": self.flops as f64 / s / 1e9,
        })
    }
}

/// The compute ceiling a measurement is taken against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ceiling {
    /// Independent f32 FMAs in registers ([`fma_peak`]).
    Fma,
    /// 16-bit integer dot products in registers ([`int16_peak`]).
    Int16,
}

impl Ceiling {
    fn name(self) -> &'static str {
        match self {
            Ceiling::Fma => "fma_peak",
            Ceiling::Int16 => "int16_dot_peak",
        }
    }
}

/// `rounds` rounds of `steps` decode steps of the sequences `seqs` (already prefilled), each
/// round after a bandwidth probe (and a probe of `ceiling`, where given); each step feeds back
/// its argmax (flipped every other step, so that no sequence settles into a loop).
fn timed_decode(
    engine: &mut Session,
    probes: &mut Probes,
    seqs: &[u64],
    steps: usize,
    rounds: usize,
    vocab: i64,
    ceiling: Option<Ceiling>,
) -> Result<Decode> {
    let mut next: Vec<[i64; 1]> = (0..seqs.len())
        .map(|b| [(b as i64 * 17 + 5) % vocab])
        .collect();
    let (mut times, mut ratios, mut bws) = (vec![], vec![], vec![]);
    let (mut peaks, mut compute) = (vec![], vec![]);
    let (mut bytes, mut flops) = (0u64, 0u64);
    for round in 0..rounds {
        let peak = ceiling.and_then(|c| probes.peak(c));
        let bw = probes.bandwidth();
        let mut round_times = Vec::new();
        for step in 0..steps {
            let chunks: Vec<(u64, &[i64])> =
                seqs.iter().zip(&next).map(|(&s, t)| (s, &t[..])).collect();
            let t = Instant::now();
            let l = engine.step(&chunks)?;
            round_times.push(t.elapsed().as_secs_f64());
            (bytes, flops) = step_cost(engine);
            for (b, n) in next.iter_mut().enumerate() {
                n[0] = maxc_runtime::sampling::argmax(l.row(b)) as i64
                    ^ ((round * steps + step) as i64 & 1);
            }
        }
        ratios.push(bytes as f64 / median(round_times.clone()) / bw);
        if let Some(p) = peak {
            compute.push(flops as f64 / median(round_times.clone()) / p);
            peaks.push(p);
        }
        bws.push(bw);
        times.extend(round_times);
    }
    Ok(Decode {
        step_s: median(times),
        bytes,
        flops,
        ratio: median(ratios),
        probe: median(bws),
        compute_ratio: (!compute.is_empty()).then(|| median(compute)),
        compute_probe: (!peaks.is_empty()).then(|| median(peaks)),
    })
}

/// The probes of one run: every value each probe read, and the model's own peak resident
/// memory (the bandwidth probe's buffer, freed, is taken out of the peak after each probe).
#[derive(Default)]
struct Probes {
    bandwidth: Vec<f64>,
    gemm: Vec<f64>,
    fma: Vec<f64>,
    int16: Vec<f64>,
    model_peak_rss: Option<u64>,
}

impl Probes {
    /// Memory bandwidth now, in bytes per second.
    fn bandwidth(&mut self) -> f64 {
        self.model_peak_rss = self.model_peak_rss.max(peak_rss());
        let bw = bandwidth();
        reset_peak_rss();
        self.bandwidth.push(bw);
        bw
    }

    /// f32 GEMM throughput now, in FLOP per second.
    fn gemm(&mut self) -> f64 {
        let g = gemm_flops();
        self.gemm.push(g);
        g
    }

    /// The compute ceiling now, in operations per second, where the CPU has it.
    fn peak(&mut self, ceiling: Ceiling) -> Option<f64> {
        let (p, all) = match ceiling {
            Ceiling::Fma => (fma_peak(), &mut self.fma),
            Ceiling::Int16 => (int16_peak(), &mut self.int16),
        };
        all.extend(p);
        p
    }

    /// The median of a ceiling's probes so far (one taken now if none was).
    fn peak_median(&mut self, ceiling: Ceiling) -> Option<f64> {
        let all = match ceiling {
            Ceiling::Fma => &self.fma,
            Ceiling::Int16 => &self.int16,
        };
        if all.is_empty() {
            self.peak(ceiling)
        } else {
            Some(median(all.clone()))
        }
    }

    /// The model's peak resident memory so far.
    fn peak_rss(&self) -> Option<u64> {
        self.model_peak_rss.max(peak_rss())
    }
}

/// Runs the benchmark and prints it.
pub fn run(args: Args) -> Result<()> {
    // Load time with the files in the page cache (the first open warms it).
    let mut loads = Vec::new();
    for _ in 0..4 {
        let t = Instant::now();
        drop(args.activations.open_cpu(&args.artifact, &args.role)?);
        loads.push(t.elapsed().as_secs_f64());
    }
    loads.remove(0);
    let mut engine = args.activations.open_cpu(&args.artifact, &args.role)?;
    // Staged weights move to huge pages, and repacked ones to theirs, behind the first step:
    // measure after they have.
    engine.step(&[(u64::MAX, &[1])])?;
    engine.release(u64::MAX);
    engine.engine_mut().settle_weights();
    engine.engine_mut().set_profiling(true)?;
    let vocab = engine.engine().vocab_size() as i64;
    let rounds = args.rounds as usize;
    let mut probes = Probes::default();
    let mut rows: Vec<Value> = Vec::new();
    let mut seq = 0u64;

    for n in [128usize, 512] {
        if n > engine.engine().max_step_tokens() || n > engine.engine().max_seq_len() {
            rows.push(json!({"name": format!("prefill_{n}"), "skipped": format!("the artifact's step budget is {} tokens", engine.engine().max_step_tokens())}));
            continue;
        }
        let p = prompt(n, vocab, 0);
        let (mut times, mut ratios, mut peaks, mut gemms) = (vec![], vec![], vec![], vec![]);
        let mut cost = (0, 0);
        for _ in 0..rounds {
            let peak = probes.peak(Ceiling::Fma);
            let gemm = probes.gemm();
            seq += 1;
            let t = Instant::now();
            engine.step(&[(seq, &p)])?;
            let s = t.elapsed().as_secs_f64();
            cost = step_cost(&engine);
            engine.release(seq);
            let flops = cost.1 as f64 / s;
            times.push(s);
            ratios.push(flops / gemm);
            gemms.push(gemm);
            if let Some(p) = peak {
                peaks.push(flops / p);
            }
        }
        let s = median(times);
        rows.push(json!({
            "name": format!("prefill_{n}"),
            "tokens_per_s": n as f64 / s,
            "step_ms": s * 1e3,
            "flop_per_step": cost.1,
            "achieved_gflops": cost.1 as f64 / s / 1e9,
            "roofline": "gemm_probe",
            "probe_gflops": median(gemms) / 1e9,
            "roofline_ratio": median(ratios),
            "fma_peak_ratio": (!peaks.is_empty()).then(|| median(peaks)),
        }));
    }

    let max_batch = engine.engine().max_batch_size();
    for batch in [1usize, 8, 32] {
        if batch > max_batch {
            rows.push(json!({"name": format!("decode_b{batch}"), "skipped": format!("the artifact's max batch size is {max_batch}")}));
            continue;
        }
        if 16 + args.steps * rounds > engine.engine().max_seq_len() {
            anyhow::bail!(
                "--steps {} × --rounds {}: 16 prompt tokens + the steps exceed max_seq_len {}",
                args.steps,
                rounds,
                engine.engine().max_seq_len()
            );
        }
        let seqs: Vec<u64> = (0..batch as u64).map(|i| 1000 + i).collect();
        let prompts: Vec<Vec<i64>> = (0..batch).map(|b| prompt(16, vocab, b as i64)).collect();
        for (s, p) in seqs.iter().zip(&prompts) {
            engine.step(&[(*s, p)])?;
        }
        // The compute ceiling of the kernels most matmuls take at this batch: the 16-bit dot
        // product's where they run on 16-bit activations, else the f32 FMA's.
        let plans = engine.engine().cpu_matmul_plans().unwrap_or_default();
        let on_int16 = plans
            .iter()
            .filter(|(_, p)| p.path(batch) == maxc_runtime::kernels::matmul::Path::I16Stream)
            .count();
        let ceiling = if 2 * on_int16 > plans.len() {
            Ceiling::Int16
        } else {
            Ceiling::Fma
        };
        let d = timed_decode(
            &mut engine,
            &mut probes,
            &seqs,
            args.steps,
            rounds,
            vocab,
            Some(ceiling),
        )?;
        for s in &seqs {
            engine.release(*s);
        }
        let mut row = d.row(format!("decode_b{batch}"), batch);
        row["compute_ceiling"] = json!(ceiling.name());
        row["compute_ceiling_gops"] = json!(d.compute_probe.map(|p| p / 1e9));
        row["compute_ratio"] = json!(d.compute_ratio);
        rows.push(row);
    }
    for &ctx in &args.context {
        let need = ctx + args.steps * rounds;
        let max_len = engine.engine().max_seq_len();
        if ctx == 0 || need > max_len {
            anyhow::bail!(
                "--context {ctx}: the context and --steps × --rounds ({need} tokens) must fit \
                 the artifact's max_seq_len {max_len} (compile with --max-seq-len {need} or more)"
            );
        }
        let seq = 5000 + ctx as u64;
        let p = prompt(ctx, vocab, 7);
        for chunk in p.chunks(engine.engine().max_step_tokens().max(1)) {
            engine.step(&[(seq, chunk)])?;
        }
        let d = timed_decode(
            &mut engine,
            &mut probes,
            &[seq],
            args.steps,
            rounds,
            vocab,
            None,
        )?;
        engine.release(seq);
        let mut row = d.row(format!("decode_b1_ctx{ctx}"), 1);
        row["context"] = json!(ctx);
        rows.push(row);
    }
    // Every measurement ran; the probes' medians are the machine's.
    let bw = if probes.bandwidth.is_empty() {
        probes.bandwidth()
    } else {
        median(probes.bandwidth.clone())
    };
    let gemm = if probes.gemm.is_empty() {
        probes.gemm()
    } else {
        median(probes.gemm.clone())
    };
    let peak = probes.peak_median(Ceiling::Fma);
    let int_peak = probes.peak_median(Ceiling::Int16);
    let activations = args.activations.activations.name();
    let report = json!({
        "artifact": args.artifact.display().to_string(),
        "role": args.role,
        "threads": maxc_runtime::kernels::pool::threads(),
        "threads_choice": maxc_runtime::kernels::pool::choice(),
        "weight_kernels": maxc_runtime::kernels::isa::isa_name(),
        "activations": activations,
        "kv_cache_dtype": engine.engine().program().kv.as_ref().map(|kv| kv.dtype.name()),
        "load_s": median(loads.clone()),
        "rounds": rounds,
        "peak_rss_bytes": probes.peak_rss(),
        "probes": {"bandwidth_gbs": bw / 1e9, "gemm_gflops": gemm / 1e9, "fma_peak_gflops": peak.map(|p| p / 1e9), "int16_dot_peak_gops": int_peak.map(|p| p / 1e9)},
        "measurements": rows,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{}: {}, weight kernels {}, activations {}, KV cache {}",
        args.artifact.display(),
        maxc_runtime::kernels::pool::choice(),
        report["weight_kernels"].as_str().unwrap_or(""),
        activations,
        report["kv_cache_dtype"].as_str().unwrap_or("none")
    );
    println!(
        "probes (medians; each ratio is the median of {rounds} rounds, each over the probe just \
         before it): memory bandwidth {:.1} GB/s, f32 GEMM {:.1} GFLOP/s, f32 FMA peak {}, \
         16-bit dot-product peak {}",
        bw / 1e9,
        gemm / 1e9,
        peak.map_or("unknown".into(), |p| format!("{:.1} GFLOP/s", p / 1e9)),
        int_peak.map_or("unknown".into(), |p| format!("{:.1} GOP/s", p / 1e9))
    );
    println!(
        "load {:.3} s (files cached), peak resident memory {}",
        median(loads),
        probes.peak_rss().map_or("unknown".into(), |b| format!(
            "{:.0} MiB",
            b as f64 / 1048576.0
        ))
    );
    for r in &rows {
        let name = r["name"].as_str().unwrap_or("");
        if let Some(why) = r["skipped"].as_str() {
            println!("{name:<12} skipped: {why}");
            continue;
        }
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        if name.starts_with("prefill") {
            println!(
                "{name:<12} {:>9.1} tokens/s  {:>8.2} ms/step  {:>7.1} GFLOP/s  {:>5.2} of the GEMM probe, {:>5.2} of the FMA peak",
                f("tokens_per_s"),
                f("step_ms"),
                f("achieved_gflops"),
                f("roofline_ratio"),
                f("fma_peak_ratio")
            );
        } else {
            if r.get("context").is_some() {
                println!(
                    "{name:<12} {:>9.1} tokens/s  {:>8.2} ms/step  {:>7.1} GB/s     {:>5.2} of the bandwidth probe",
                    f("tokens_per_s"),
                    f("step_ms"),
                    f("achieved_gbs"),
                    f("roofline_ratio"),
                );
                continue;
            }
            println!(
                "{name:<12} {:>9.1} tokens/s  {:>8.2} ms/step  {:>7.1} GB/s     {:>5.2} of the bandwidth probe, {:>5.2} of the {}",
                f("tokens_per_s"),
                f("step_ms"),
                f("achieved_gbs"),
                f("roofline_ratio"),
                f("compute_ratio"),
                match r["compute_ceiling"].as_str() {
                    Some("int16_dot_peak") => "16-bit dot-product peak",
                    _ => "FMA peak",
                }
            );
        }
    }
    Ok(())
}
