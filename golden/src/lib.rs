//! Golden artifacts: the cases whose compiled dumps are checked in under `golden/cases/`, and
//! the check that recompiles a case and diffs its dump against the checked-in one.
//!
//! After reviewing a change to the compiler's output, bless it with:
//!
//! ```text
//! MAXC_BLESS=1 cargo test -p maxc-golden
//! ```

use maxc_exporter::{compile, CompileOptions, CpuMatmul};
use maxc_graph::{DType, KvCacheParams, ModuleRuntime};
use maxc_runtime::diff::{diff_dumps, report};
use maxc_runtime::dump::{dump, read_dump, write_dump};
use maxc_runtime::Artifact;
use std::path::{Path, PathBuf};

/// The command that accepts new golden output.
pub const BLESS: &str = "MAXC_BLESS=1 cargo test -p maxc-golden";

/// One golden case: a fixture model compiled with one runtime setting.
#[derive(Clone, Debug)]
pub struct Case {
    /// The case's folder under `golden/cases/`.
    pub name: String,
    /// The fixture folder under [`fixtures`].
    pub model: &'static str,
    /// Compile options.
    pub options: CompileOptions,
}

impl Case {
    /// Whether compiling the case needs NVRTC (CUDA target).
    pub fn needs_nvrtc(&self) -> bool {
        self.options.cuda_arch.is_some()
    }
}

fn runtime(batch: usize, len: usize, budget: usize, chunked: bool) -> ModuleRuntime {
    let mut rt = ModuleRuntime::default();
    rt.batch.max_batch_size = batch;
    rt.batch.max_seq_len = len;
    rt.batch.max_batch_input_tokens = budget;
    rt.batch.enable_chunked_prefill = chunked;
    rt.kv = KvCacheParams {
        page_size: 16,
        num_pages: None,
        dtype: Default::default(),
    };
    rt
}

/// `rt` for `model`: tiny-roles verifies its checkpoint's 3 draft tokens per step (as
/// `maxc compile` defaults to), so its goldens show a speculative decoder's logit rows.
fn for_model(model: &str, rt: &ModuleRuntime) -> ModuleRuntime {
    let mut rt = rt.clone();
    if model == "tiny-roles" {
        rt.batch.num_speculative_tokens = 3;
    }
    rt
}

/// A case's compile options: `rt`, weights stored as `weights`, CPU code where `cpu`, CUDA
/// code for `cuda_arch` where given.
fn options(
    runtime: ModuleRuntime,
    weights: maxc_graph::pipeline::WeightFormat,
    cpu: bool,
    cuda_arch: Option<String>,
) -> CompileOptions {
    CompileOptions {
        runtime,
        weights,
        all_logits: false,
        cpu_matmul: CpuMatmul::Auto,
        force: true,
        cpu,
        cuda_arch,
        stop_after_rewrites: None,
    }
}

/// Every golden case: each tiny model at two runtime settings on the CPU, and once for CUDA
/// (sm_90, bf16 weights, so the tensor-core matmuls are covered); tiny-mixtral also at
/// expert-parallel degree 2, on both; tiny-deepseek-v3 (latent attention) at degree 2 on the
/// CPU; tiny-llama at tensor-parallel degree 2 on the CPU.
pub fn cases() -> Vec<Case> {
    let settings = [
        ("b8-len128", runtime(8, 128, 256, true)),
        ("b2-len64-nochunk", runtime(2, 64, 64, false)),
    ];
    let mut out = Vec::new();
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-mixtral",
        "tiny-roles",
        "tiny-deepseek-v3",
    ] {
        for (label, rt) in &settings {
            out.push(Case {
                name: format!("{model}-cpu-{label}"),
                model,
                options: options(for_model(model, rt), DType::F32.into(), true, None),
            });
        }
    }
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-mixtral",
        "tiny-roles",
        "tiny-deepseek-v3",
    ] {
        out.push(Case {
            name: format!("{model}-cuda-sm90-bf16-b8-len128"),
            model,
            options: options(
                for_model(model, &settings[0].1),
                DType::BF16.into(),
                false,
                Some("sm_90".into()),
            ),
        });
    }
    // tiny-mixtral's experts over 2 ranks: the export records and the EP init program, on the
    // CPU and for CUDA.
    let ep2 = ModuleRuntime {
        expert_parallel_degree: 2,
        ..settings[0].1.clone()
    };
    for (target, cuda) in [("cpu", false), ("cuda-sm90-bf16", true)] {
        out.push(Case {
            name: format!("tiny-mixtral-{target}-b8-len128-ep2"),
            model: "tiny-mixtral",
            options: options(
                ep2.clone(),
                if cuda { DType::BF16 } else { DType::F32 }.into(),
                !cuda,
                cuda.then(|| "sm_90".into()),
            ),
        });
    }
    // tiny-llama over 2 tensor-parallel ranks: each rank's role, its all-reduces and its share
    // of the weights (the replicated ones stored once, under rank 0).
    out.push(Case {
        name: "tiny-llama-cpu-b8-len128-tp2".into(),
        model: "tiny-llama",
        options: options(
            ModuleRuntime {
                tensor_parallel_degree: 2,
                ..settings[0].1.clone()
            },
            DType::F32.into(),
            true,
            None,
        ),
    });
    // tiny-deepseek-v3's routed experts over 2 ranks (the shared expert on each).
    out.push(Case {
        name: "tiny-deepseek-v3-cpu-b8-len128-ep2".into(),
        model: "tiny-deepseek-v3",
        options: options(ep2, DType::F32.into(), true, None),
    });
    out
}

/// The test fixtures: `MAXC_FIXTURES` where set, else the copy in `golden/fixtures` (test data
/// made with Hugging Face transformers; `tests/fixtures.rs` keeps it equal to `../shared/fixtures`).
pub fn fixtures() -> PathBuf {
    std::env::var_os("MAXC_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures"))
}

/// The checked-in dump of `case`.
pub fn golden_dir(case: &Case) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("cases")
        .join(&case.name)
}

/// Compiles `case` into `work` and compares its dump with the golden one. With `bless`, writes
/// the new dump instead. Returns the readable differences (empty when identical).
pub fn check(case: &Case, work: &Path, bless: bool) -> Result<String, String> {
    let out = work.join(format!("{}.maxc", case.name));
    compile(
        &fixtures().join(case.model),
        &out,
        &case.options,
        &mut |_| {},
    )
    .map_err(|e| format!("{}: {e}", case.name))?;
    let artifact = Artifact::open(&out).map_err(|e| e.to_string())?;
    let got = dump(&artifact);
    let dir = golden_dir(case);
    if bless {
        let _ = std::fs::remove_dir_all(&dir);
        write_dump(&got, &dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        return Ok(String::new());
    }
    let want = if dir.exists() {
        read_dump(&dir).map_err(|e| format!("{}: {e}", dir.display()))?
    } else {
        Default::default()
    };
    let changes = diff_dumps(&want, &got, "golden", "compiled");
    Ok(report(&changes))
}
