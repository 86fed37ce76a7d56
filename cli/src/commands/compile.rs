//! `maxc compile MODEL --out DIR`: compiles a checkpoint into an artifact.

use crate::runtime_args::RuntimeArgs;
use anyhow::Result;
use maxc_exporter::{compile, CompileOptions, CpuMatmul};
use maxc_graph::pipeline::read_config;
use maxc_graph::pipeline::WeightFormat;
use maxc_graph::Registry;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `maxc compile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (config.json + safetensors).
    pub model: PathBuf,
    /// The artifact directory to write (conventionally NAME.maxc).
    #[arg(long)]
    pub out: PathBuf,
    /// Code targets: `cpu` (Cranelift), `cuda` (CUDA C through NVRTC to PTX) or `all`.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "all"])]
    pub target: String,
    /// The GPU architecture CUDA code is compiled and checked for.
    #[arg(long, default_value = "sm_90")]
    pub cuda_arch: String,
    /// The formats weights are stored in: `keep` (the checkpoint's own, GGUF blocks included),
    /// a float type (`f32`, `bf16`, `f16`; blocks dequantized) or a block type that matmul
    /// weights and embeddings are quantized to (`q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q4_k`).
    #[arg(long, alias = "dtype", default_value = "keep")]
    pub weights: WeightFormat,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Return logits for every token row of a full step (the logit-row bound becomes the step
    /// budget), so that prompts are scored at full prefill speed; every artifact scores
    /// prompts, in chunks of --max-logit-rows rows without it.
    #[arg(long, conflicts_with = "max_logit_rows")]
    pub all_logits: bool,
    /// How matmuls run on the CPU: `auto` (the runtime chooses per CPU: on AVX-512 the
    /// library's register tiles and blocked attention; elsewhere generated code for steps of 2
    /// to 16 rows, the library otherwise), `library` or `generated` (Cranelift, attention too).
    #[arg(long, default_value = "auto", value_parser = ["auto", "library", "generated"])]
    pub cpu_matmul: String,
    /// Make no more than N fusion rewrites in each role (0: the kernels as selected, unfused), to
    /// bisect a wrong lowering: the smallest N whose artifact is wrong names the rewrite.
    #[arg(long, value_name = "N")]
    pub stop_after_rewrites: Option<usize>,
    /// Replace an existing artifact.
    #[arg(long)]
    pub force: bool,
    /// Print nothing but errors.
    #[arg(long, short)]
    pub quiet: bool,
}

/// Compiles, showing each stage with its elapsed time on stderr.
pub fn run(args: Args) -> Result<()> {
    let (_, spec) = read_config(&args.model, &Registry::builtin())?;
    let opts = CompileOptions {
        runtime: args.runtime.runtime(spec.as_ref()),
        weights: args.weights,
        all_logits: args.all_logits,
        cpu_matmul: match args.cpu_matmul.as_str() {
            "generated" => CpuMatmul::Generated,
            "library" => CpuMatmul::Library,
            _ => CpuMatmul::Auto,
        },
        force: args.force,
        cpu: args.target != "cuda",
        cuda_arch: (args.target != "cpu").then(|| args.cuda_arch.clone()),
        stop_after_rewrites: args.stop_after_rewrites,
    };
    let start = Instant::now();
    let quiet = args.quiet;
    let mut progress = |stage: &str| {
        if !quiet {
            eprintln!("[{:>6.2}s] {stage}", start.elapsed().as_secs_f64());
        }
    };
    let summary = compile(&args.model, &args.out, &opts, &mut progress)?;
    if !quiet {
        let kernels: Vec<String> = summary
            .kernels
            .iter()
            .map(|(r, n)| {
                let Some(passes) = summary.passes.get(r) else {
                    return format!("{r}: {n} kernels");
                };
                let detail: Vec<String> = passes
                    .rewrites
                    .iter()
                    .map(|(pass, n)| format!("{pass} {n}"))
                    .collect();
                let stopped = if passes.stopped {
                    ", stopped there"
                } else {
                    ""
                };
                format!(
                    "{r}: {n} kernels, {} rewrites ({}){stopped}",
                    passes.total(),
                    detail.join(", ")
                )
            })
            .collect();
        eprintln!(
            "compiled {} ({}) in {:.2}s",
            summary.dir.display(),
            kernels.join(", "),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
