//! Throughput of compiled artifacts against the reference interpreter, measured in the same run:
//! prefill and decode tokens/s of tiny-llama at batch 1 and 8, and generated against library
//! (gemm) matmuls. `cargo bench -p maxc-cli --bench step`.

use maxc_exporter::{compile, CompileOptions, CpuMatmul};
use maxc_golden::fixtures;
use maxc_graph::interp::{Interpreter, Session};
use maxc_graph::pipeline::{load_model, LoadOptions};
use maxc_graph::{DType, KvCacheParams, ModuleRuntime, Registry};
use maxc_lowering::cpu::{compile_kernel, CpuTarget};
use maxc_runtime::cpu::code::ExecutableCode;
use maxc_runtime::kernels::gemm as library;
use maxc_runtime::Session as RuntimeSession;
use maxc_schema::{KernelBody, Rows, StepDim};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PROMPT: usize = 128;
const DECODE: usize = 32;

fn runtime() -> ModuleRuntime {
    let mut rt = ModuleRuntime::default();
    rt.batch.max_batch_size = 8;
    rt.batch.max_seq_len = PROMPT + DECODE;
    rt.batch.max_batch_input_tokens = 8 * PROMPT;
    rt.kv = KvCacheParams {
        page_size: 16,
        num_pages: None,
        dtype: Default::default(),
    };
    rt
}

fn prompt(seq: usize) -> Vec<i64> {
    (0..PROMPT)
        .map(|i| ((i * 31 + seq * 7) % 1000 + 3) as i64)
        .collect()
}

/// Best of `reps` runs of `f`, which returns the tokens it processed.
fn best(reps: usize, mut f: impl FnMut() -> usize) -> (Duration, usize) {
    let mut best = (Duration::MAX, 0);
    for _ in 0..reps {
        let t = Instant::now();
        let n = f();
        best = best.min((t.elapsed(), n));
    }
    best
}

/// A backend's step over `(sequence, tokens)` chunks.
type StepFn<'a> = dyn FnMut(&[(u64, &[i64])]) + 'a;

/// (prefill tok/s, decode tok/s) at `batch` for a backend stepping `(seq, tokens)` chunks.
fn measure(
    batch: usize,
    reps: usize,
    step: &mut StepFn<'_>,
    reset: &mut dyn FnMut(),
) -> (f64, f64) {
    let prompts: Vec<Vec<i64>> = (0..batch).map(prompt).collect();
    let (t, n) = best(reps, || {
        reset();
        let chunks: Vec<(u64, &[i64])> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p.as_slice()))
            .collect();
        step(&chunks);
        batch * PROMPT
    });
    let prefill = n as f64 / t.as_secs_f64();
    let (t, n) = best(reps, || {
        reset();
        let chunks: Vec<(u64, &[i64])> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, &p[..16]))
            .collect();
        step(&chunks);
        for d in 0..DECODE {
            let toks: Vec<[i64; 1]> = (0..batch).map(|i| [((d * 13 + i) % 1000) as i64]).collect();
            let chunks: Vec<(u64, &[i64])> = toks
                .iter()
                .enumerate()
                .map(|(i, t)| (i as u64, t.as_slice()))
                .collect();
            step(&chunks);
        }
        batch * DECODE
    });
    (prefill, n as f64 / t.as_secs_f64())
}

/// Whether to also run the artifacts on the GPU (`MAXC_BENCH_CUDA=1`, scripts/gpu-check.sh).
fn cuda_bench() -> bool {
    std::env::var("MAXC_BENCH_CUDA").as_deref() == Ok("1")
}

fn engine_numbers(dir: &Path, batch: usize) -> (f64, f64) {
    engine_numbers_on(dir, batch, maxc_runtime::engine::Device::Cpu)
}

fn engine_numbers_on(dir: &Path, batch: usize, device: maxc_runtime::engine::Device) -> (f64, f64) {
    let mut engine = RuntimeSession::open_on(dir, "decoder", device).expect("artifact");
    let engine = std::cell::RefCell::new(&mut engine);
    measure(
        batch,
        5,
        &mut |c| {
            engine.borrow_mut().step(c).expect("step");
        },
        &mut || {
            for s in 0..8 {
                engine.borrow_mut().release(s);
            }
        },
    )
}

fn matmul_bench() {
    let target = CpuTarget::host_baseline().expect("host target");
    println!("\nmatmul, out = x · wᵀ (f32), best of 20: generated (Cranelift) vs library (gemm)");
    println!(
        "{:<22} {:>12} {:>12} {:>8}",
        "rows x n x k", "generated", "gemm", "ratio"
    );
    for (rows, n, k) in [
        (1, 688, 256),
        (8, 688, 256),
        (128, 688, 256),
        (128, 1024, 256),
        (1, 1024, 256),
    ] {
        let body = KernelBody::Matmul {
            rows: Rows::Step(StepDim::TotalSeqLen),
            n,
            k,
            weight_dtype: maxc_schema::DType::F32,
            bias: false,
        };
        let code =
            ExecutableCode::new(&compile_kernel(&body, &target).expect("compiles")).expect("loads");
        // SAFETY: the code is a kernel for this host at offset 0.
        let f = unsafe { code.kernel(0) };
        let (n, k) = (n as usize, k as usize);
        let x: Vec<f32> = (0..rows * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut out = vec![0.0f32; rows * n];
        let mut dims = [0u64; StepDim::COUNT];
        dims[StepDim::TotalSeqLen as usize] = rows as u64;
        let (tg, _) = best(20, || {
            let bufs = [
                x.as_ptr() as *mut u8,
                w.as_ptr() as *mut u8,
                out.as_mut_ptr().cast(),
            ];
            let threads = rayon::current_num_threads() as u64;
            let p = (bufs.as_ptr() as usize, dims.as_ptr() as usize);
            rayon::scope(|s| {
                for c in 0..threads {
                    s.spawn(move |_| {
                        let (start, end) = (n as u64 * c / threads, n as u64 * (c + 1) / threads);
                        // SAFETY: disjoint column ranges of the same buffers.
                        unsafe { f(p.0 as *const *mut u8, p.1 as *const u64, start, end) };
                    });
                }
            });
            0
        });
        let (tl, _) = best(20, || {
            library::matmul(&x, &w, None, &mut out, rows, n, k);
            0
        });
        println!(
            "{:<22} {:>10.1}us {:>10.1}us {:>7.2}x",
            format!("{rows} x {n} x {k}"),
            tg.as_secs_f64() * 1e6,
            tl.as_secs_f64() * 1e6,
            tg.as_secs_f64() / tl.as_secs_f64()
        );
    }
}

fn main() {
    let model = fixtures().join("tiny-llama");
    let tmp = std::env::temp_dir().join(format!("maxc-bench-{}", std::process::id()));
    let mut artifacts = Vec::new();
    for (label, dtype, mm) in [
        ("artifact f32, auto (default)", DType::F32, CpuMatmul::Auto),
        ("artifact f32, gemm", DType::F32, CpuMatmul::Library),
        (
            "artifact f32, generated mm",
            DType::F32,
            CpuMatmul::Generated,
        ),
        ("artifact bf16, gemm", DType::BF16, CpuMatmul::Library),
    ] {
        let out = tmp.join(format!("{}.maxc", artifacts.len()));
        let opts = CompileOptions {
            runtime: runtime(),
            weights: dtype.into(),
            all_logits: false,
            cpu_matmul: mm,
            force: true,
            cpu: true,
            cuda_arch: cuda_bench().then(|| "sm_90".to_string()),
            stop_after_rewrites: None,
        };
        compile(&model, &out, &opts, &mut |_| {}).expect("compile");
        artifacts.push((label, out));
    }
    let opts = LoadOptions {
        runtime: runtime(),
        ..Default::default()
    };
    let mut loaded = load_model(&model, &Registry::builtin(), &opts).expect("load");
    let rg = loaded.roles.pop_first().expect("decoder").1;
    let interp = Interpreter::new(rg.graph, &rg.weights).expect("interpreter");

    println!("tiny-llama, prompt {PROMPT} tokens, {DECODE} decode steps; tokens/s (best of runs)");
    println!(
        "{:<28} {:>6} {:>12} {:>12} {:>10} {:>10}",
        "backend", "batch", "prefill", "decode", "vs interp", ""
    );
    for batch in [1usize, 8] {
        let pages = 8 * (PROMPT + DECODE).div_ceil(16);
        let session =
            std::cell::RefCell::new(Session::new(&interp, pages, (PROMPT + DECODE).div_ceil(16)));
        let (ip, id) = measure(
            batch,
            2,
            &mut |c| {
                session.borrow_mut().step(c).expect("interp");
            },
            &mut || {
                *session.borrow_mut() = Session::new(&interp, pages, (PROMPT + DECODE).div_ceil(16))
            },
        );
        println!(
            "{:<28} {:>6} {:>12.0} {:>12.0} {:>10} {:>10}",
            "reference interpreter", batch, ip, id, "1.00x", "1.00x"
        );
        for (label, dir) in &artifacts {
            if cuda_bench() {
                let (p, d) = engine_numbers_on(dir, batch, maxc_runtime::engine::Device::Cuda);
                println!(
                    "{:<28} {batch:>6} {p:>12.0} {d:>12.0} {:>9.1}x {:>9.1}x",
                    format!("{label} (CUDA)"),
                    p / ip,
                    d / id
                );
            }
            let (p, d) = engine_numbers(dir, batch);
            println!(
                "{label:<28} {batch:>6} {p:>12.0} {d:>12.0} {:>9.1}x {:>9.1}x",
                p / ip,
                d / id
            );
        }
    }
    smollm2_bench(&tmp);
    matmul_bench();
    let _ = std::fs::remove_dir_all(&tmp);
}

/// SmolLM2-135M (the default model) at batch 1: prefill of 128 tokens and decode, f32 and bf16.
fn smollm2_bench(tmp: &Path) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("bash")
        .arg("scripts/fetch-smollm2.sh")
        .current_dir(&root)
        .output();
    let Some(gguf) = out
        .ok()
        .filter(|o| o.status.success())
        .map(|o| root.join(String::from_utf8_lossy(&o.stdout).trim()))
    else {
        println!("\nSmolLM2: skipped (scripts/fetch-smollm2.sh failed)");
        return;
    };
    println!("\nSmolLM2-135M, batch 1, prompt {PROMPT} tokens, {DECODE} decode steps; tokens/s (best of 3)");
    println!("{:<28} {:>12} {:>12}", "weights", "prefill", "decode");
    for dtype in [DType::F32, DType::BF16] {
        let dir = tmp.join(format!("smollm2-{dtype}.maxc"));
        let mut rt = runtime();
        rt.batch.max_batch_size = 1;
        rt.batch.max_batch_input_tokens = PROMPT;
        let opts = CompileOptions {
            runtime: rt,
            weights: dtype.into(),
            all_logits: false,
            cpu_matmul: CpuMatmul::Auto,
            force: true,
            cpu: true,
            cuda_arch: None,
            stop_after_rewrites: None,
        };
        compile(&gguf, &dir, &opts, &mut |_| {}).expect("compile SmolLM2");
        let mut engine = RuntimeSession::open(&dir, "decoder").expect("artifact");
        let engine = std::cell::RefCell::new(&mut engine);
        let (p, d) = measure(
            1,
            3,
            &mut |c| {
                engine.borrow_mut().step(c).expect("step");
            },
            &mut || engine.borrow_mut().release(0),
        );
        println!("{:<28} {p:>12.1} {d:>12.1}", dtype.to_string());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
