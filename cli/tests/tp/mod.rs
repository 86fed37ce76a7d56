//! What the tensor-parallel tests share: `maxc` (under `mpirun` where asked), compiling a
//! fixture at a degree, and a prompt's logits and greedy tokens.
#![allow(dead_code)]

pub mod hosts;

use maxc_golden::fixtures;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Every decoder fixture: Llama (2 KV heads: at 4 ranks each holds a copy of one), Qwen2
/// (q/k/v biases), Qwen3 (per-head norms), Gemma 3 (sandwich norms, sliding layers, a tied
/// head), Mistral (sliding window), Phi-3 (fused q/k/v and gate/up, split when the weights are
/// prepared), Mixtral and Qwen3-MoE (each expert split as a dense MLP, the router replicated),
/// DeepSeek-V3 (latent attention split by heads, the latent replicated; a grouped router,
/// shared experts and a dense first layer).
pub const MODELS: [&str; 9] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
    "tiny-mistral-swa",
    "tiny-phi3",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-deepseek-v3",
];

/// The prompt every test runs.
pub const PROMPT: &str = "1,5,9,200,31,7,77,3,12,40";

/// `o`, failing the test with its output unless it succeeded.
pub fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// `maxc args..`, under `mpirun -np ranks` where given.
pub fn maxc(ranks: Option<usize>, args: &[&str]) -> Output {
    maxc_via(&launcher(ranks), args)
}

/// The command line `maxc` runs under: `mpirun -np ranks` where given, nothing without.
pub fn launcher(ranks: Option<usize>) -> Vec<String> {
    match ranks {
        None => Vec::new(),
        // Root in CI containers; more ranks than the 2 cores here.
        Some(n) => [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &n.to_string(),
        ]
        .map(String::from)
        .to_vec(),
    }
}

/// `maxc args..` under the command line `launch` (run directly where it is empty).
pub fn maxc_via(launch: &[String], args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_maxc");
    let mut cmd = match launch.split_first() {
        None => Command::new(exe),
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(exe);
            c
        }
    };
    cmd.args(args)
        .output()
        .expect("maxc runs (mpirun: scripts/install-mpi.sh installs Open MPI)")
}

/// Fixture `model` compiled at tensor-parallel degree `degree` into `dir`.
pub fn compile(model: &str, degree: usize, dir: &Path) -> PathBuf {
    compile_at(model, "tensor", degree, dir)
}

/// Fixture `model` compiled at `kind`-parallel (`tensor`, `expert`) degree `degree` into `dir`.
pub fn compile_at(model: &str, kind: &str, degree: usize, dir: &Path) -> PathBuf {
    compile_with(
        model,
        &format!("{kind}{degree}"),
        &[&format!("--{kind}-parallel-degree"), &degree.to_string()],
        dir,
    )
}

/// Fixture `model` at tensor-parallel degree `degree`, its experts spread whole over the ranks
/// (expert-parallel degree `degree` too).
pub fn compile_spread(model: &str, degree: usize, dir: &Path) -> PathBuf {
    let d = degree.to_string();
    let flags = [
        "--tensor-parallel-degree",
        &d,
        "--expert-parallel-degree",
        &d,
    ];
    compile_with(model, &format!("spread{degree}"), &flags, dir)
}

/// Fixture `model` compiled with `flags` into `dir` (named by `tag`).
fn compile_with(model: &str, tag: &str, flags: &[&str], dir: &Path) -> PathBuf {
    let out = dir.join(format!("{model}-{tag}.maxc"));
    ok(maxc(
        None,
        &[
            "compile",
            fixtures().join(model).to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
            "--max-seq-len",
            "64",
            "--page-size",
            "16",
            "--max-batch-input-tokens",
            "64",
        ]
        .iter()
        .chain(flags)
        .copied()
        .collect::<Vec<_>>(),
    ));
    out
}

/// The logits of every prompt position, `[positions × vocab]`, through `maxc run`.
pub fn logits(ranks: Option<usize>, artifact: &Path, name: &str) -> Vec<f32> {
    logits_via(&launcher(ranks), artifact, name)
}

/// [`logits`] under the command line `launch`.
pub fn logits_via(launch: &[String], artifact: &Path, name: &str) -> Vec<f32> {
    let file = artifact.with_file_name(format!("{name}.logits"));
    ok(maxc_via(
        launch,
        &[
            "run",
            artifact.to_str().unwrap(),
            "--tokens",
            PROMPT,
            "--dump-logits",
            file.to_str().unwrap(),
        ],
    ));
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The largest difference between two sets of logits of one shape.
pub fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Eight greedy tokens after the prompt, through `maxc generate`.
pub fn greedy(ranks: Option<usize>, artifact: &Path) -> serde_json::Value {
    greedy_via(&launcher(ranks), artifact)
}

/// [`greedy`] under the command line `launch`.
pub fn greedy_via(launch: &[String], artifact: &Path) -> serde_json::Value {
    let o = ok(maxc_via(
        launch,
        &[
            "generate",
            artifact.to_str().unwrap(),
            "--tokens",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ],
    ));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["generated"].clone()
}
