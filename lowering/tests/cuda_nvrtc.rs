//! NVRTC and ptxas over a module with every kernel kind in every weight type: it compiles for
//! sm_90 (and the fallback paths for sm_70), ptxas assembles it and reports every kernel, and
//! the PTX is the same bytes on every compile.
//!
//! Without NVRTC the tests print a skip line and pass, unless `MAXC_REQUIRE_NVRTC=1`, where
//! they fail with the install hint (`eval "$(bash scripts/install-cuda-tools.sh)"`).

use maxc_lowering::cuda::{
    compile_ptx, emit_kernel, module_source, nvrtc_status, ptxas_check, CudaError, CudaKernel,
    CudaTarget,
};
use maxc_schema::{
    DType, EwInput, EwInstr, GatherIndex, GroupScore, KernelBody, KvDtype, RouterScoring, Rows,
    StepDim,
};

fn required() -> bool {
    std::env::var("MAXC_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Whether NVRTC loads; otherwise a skip line, or a failure where it is required.
fn nvrtc_available(test: &str) -> bool {
    match nvrtc_status() {
        Ok(_) => true,
        Err(e) if required() => panic!("MAXC_REQUIRE_NVRTC=1 but {e}"),
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            false
        }
    }
}

const STEP: Rows = Rows::Step(StepDim::TotalSeqLen);
const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Every kernel kind, each float kind in every weight type, with widths that leave tails.
fn all_kinds() -> Vec<KernelBody> {
    let mut bodies = vec![
        KernelBody::Positions,
        KernelBody::Rope {
            heads: 4,
            head_dim: 128,
            rotary_dim: 128,
        },
        // Partial rotary (Phi-3): the first 24 of 32 elements rotated, the rest copied.
        KernelBody::Rope {
            heads: 8,
            head_dim: 32,
            rotary_dim: 24,
        },
        KernelBody::KvStore {
            planes: 2,
            layer: 0,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 128,
            page_size: 16,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Attention {
            planes: 2,
            value_dim: 128,
            layer: 1,
            num_layers: 2,
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            page_size: 16,
            scale: 0.088,
            window: None,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Attention {
            planes: 2,
            value_dim: 40,
            layer: 0,
            num_layers: 1,
            heads: 3,
            kv_heads: 3,
            head_dim: 40,
            page_size: 5,
            scale: 0.17,
            window: None,
            kv_dtype: KvDtype::F32,
        },
        // The KV dtypes: f16, bf16 and q8_0 rows stored and read (q8_0's warps quantize
        // whole groups of 32 with shuffles).
        KernelBody::KvStore {
            planes: 2,
            layer: 1,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            kv_dtype: KvDtype::F16,
        },
        KernelBody::Attention {
            planes: 2,
            value_dim: 64,
            layer: 1,
            num_layers: 2,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            scale: 0.125,
            window: None,
            kv_dtype: KvDtype::F16,
        },
        KernelBody::KvStore {
            planes: 2,
            layer: 1,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 128,
            page_size: 16,
            kv_dtype: KvDtype::Bf16,
        },
        KernelBody::KvStore {
            planes: 2,
            layer: 1,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            kv_dtype: KvDtype::Q8_0,
        },
        KernelBody::Attention {
            planes: 2,
            value_dim: 128,
            layer: 1,
            num_layers: 2,
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            page_size: 16,
            scale: 0.088,
            window: None,
            kv_dtype: KvDtype::Bf16,
        },
        KernelBody::Attention {
            planes: 1,
            value_dim: 512,
            layer: 0,
            num_layers: 1,
            heads: 4,
            kv_heads: 1,
            head_dim: 576,
            page_size: 16,
            scale: 0.07,
            window: None,
            kv_dtype: KvDtype::Q8_0,
        },
        // A sliding window (Mistral, Gemma 3's local layers).
        KernelBody::Attention {
            planes: 2,
            value_dim: 64,
            layer: 1,
            num_layers: 2,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            scale: 0.125,
            window: Some(512),
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Softmax {
            rows: STEP,
            cols: 301,
        },
        KernelBody::TopK {
            rows: STEP,
            cols: 64,
            k: 8,
            renormalize: true,
        },
        KernelBody::TopK {
            rows: Rows::Fixed(3),
            cols: 7,
            k: 9,
            renormalize: false,
        },
    ];
    for dtype in FLOATS {
        bodies.extend([
            KernelBody::Gather {
                rows: STEP,
                cols: 1000,
                index: GatherIndex::Tokens,
                src_dtype: dtype,
                scale: 25.3,
            },
            KernelBody::Gather {
                rows: Rows::Step(StepDim::LogitRows),
                cols: 13,
                index: GatherIndex::LogitRows,
                src_dtype: dtype,
                scale: 1.0,
            },
            KernelBody::RmsNorm {
                rows: STEP,
                cols: 2048,
                width: 2048,
                weight_offset: 0.0,
                eps: 1e-6,
                residual: true,
                weight_dtype: dtype,
            },
            KernelBody::RmsNorm {
                rows: STEP,
                cols: 37,
                width: 37,
                weight_offset: 0.0,
                eps: 1e-5,
                residual: false,
                weight_dtype: dtype,
            },
            // Per-head norms (q and k of Qwen3 and Gemma 3), with and without a residual.
            KernelBody::RmsNorm {
                rows: STEP,
                cols: 512,
                width: 64,
                weight_offset: 0.0,
                eps: 1e-6,
                residual: false,
                weight_dtype: dtype,
            },
            KernelBody::RmsNorm {
                rows: STEP,
                cols: 96,
                width: 32,
                weight_offset: 1.0,
                eps: 1e-6,
                residual: true,
                weight_dtype: dtype,
            },
            KernelBody::Elementwise {
                rows: STEP,
                cols: 333,
                inputs: vec![
                    EwInput {
                        dtype: DType::F32,
                        broadcast: false,
                    },
                    EwInput {
                        dtype,
                        broadcast: true,
                    },
                ],
                program: vec![
                    EwInstr::Input(0),
                    EwInstr::Silu(0),
                    EwInstr::Input(1),
                    EwInstr::Mul(1, 2),
                    EwInstr::Add(3, 0),
                ],
            },
            // GeGLU (Gemma): gelu_tanh(gate) · up.
            KernelBody::Elementwise {
                rows: STEP,
                cols: 512,
                inputs: vec![
                    EwInput {
                        dtype: DType::F32,
                        broadcast: false,
                    },
                    EwInput {
                        dtype: DType::F32,
                        broadcast: false,
                    },
                ],
                program: vec![
                    EwInstr::Input(0),
                    EwInstr::GeluTanh(0),
                    EwInstr::Input(1),
                    EwInstr::Mul(1, 2),
                ],
            },
            KernelBody::Matmul {
                rows: STEP,
                n: 1000,
                k: 4100,
                weight_dtype: dtype,
                bias: true,
            },
            KernelBody::Matmul {
                rows: Rows::Fixed(3),
                n: 13,
                k: 37,
                weight_dtype: dtype,
                bias: false,
            },
            KernelBody::MoeExperts {
                rows: STEP,
                hidden: 64,
                ffn: 3000,
                experts: 4,
                weight_dtype: dtype,
            },
            // DeepSeek-V3's absorbed up-projections: 128 heads, W_UKᵀ (512 × 128) and W_UV
            // (128 × 512) per head.
            KernelBody::HeadMatmul {
                rows: STEP,
                heads: 128,
                n: 512,
                k: 128,
                weight_dtype: dtype,
            },
            KernelBody::HeadMatmul {
                rows: Rows::Fixed(3),
                heads: 3,
                n: 7,
                k: 5,
                weight_dtype: dtype,
            },
            // DeepSeek-V3's router: 256 experts in 8 groups, 4 kept, 8 chosen; and V2's.
            KernelBody::MoeRouter {
                rows: STEP,
                experts: 256,
                top_k: 8,
                n_group: 8,
                topk_group: 4,
                scoring: RouterScoring::Sigmoid,
                group_score: GroupScore::TopTwoSum,
                renormalize: true,
                scale: 2.5,
                bias_dtype: dtype,
            },
            KernelBody::MoeRouter {
                rows: STEP,
                experts: 160,
                top_k: 6,
                n_group: 8,
                topk_group: 3,
                scoring: RouterScoring::Softmax,
                group_score: GroupScore::Max,
                renormalize: false,
                scale: 16.0,
                bias_dtype: dtype,
            },
        ]);
    }
    // Multi-head latent attention at DeepSeek-V3's sizes: a one-plane cache of 512 + 64 values
    // per token, 128 heads reading it, values its first 512.
    bodies.extend([
        KernelBody::KvStore {
            layer: 1,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 576,
            page_size: 64,
            planes: 1,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Attention {
            layer: 1,
            num_layers: 2,
            heads: 128,
            kv_heads: 1,
            head_dim: 576,
            page_size: 64,
            planes: 1,
            value_dim: 512,
            scale: 0.1352,
            window: None,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Concat {
            rows: STEP,
            groups: 128,
            a: 512,
            b: 64,
        },
    ]);
    bodies
}

fn emit_all(target: &CudaTarget) -> Vec<CudaKernel> {
    all_kinds()
        .iter()
        .enumerate()
        .map(|(i, b)| emit_kernel(&format!("k{i:02}_{}", b.kind()), b, target).expect("emits"))
        .collect()
}

#[test]
fn every_kernel_compiles_and_assembles_for_sm90() {
    if !nvrtc_available("every_kernel_compiles_and_assembles_for_sm90") {
        return;
    }
    let target = CudaTarget::default();
    let kernels = emit_all(&target);
    let source = module_source(&kernels);
    let ptx = compile_ptx(&source, &target).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.nvrtc_version.0 >= 12, "{:?}", ptx.nvrtc_version);
    assert!(ptx.ptx.contains(".target sm_90"), "PTX for another target");
    assert!(ptx
        .ptx
        .contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
    assert!(ptx
        .ptx
        .contains("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"));
    for k in &kernels {
        assert!(
            ptx.ptx.contains(&format!(".entry {}(", k.name)),
            "{} missing from the PTX",
            k.name
        );
    }
    let again = compile_ptx(&source, &target).expect("compiles again");
    assert!(again.ptx == ptx.ptx, "two compiles gave different PTX");

    let resources = match ptxas_check(&ptx.ptx, &target) {
        Ok(r) => r,
        Err(e @ CudaError::PtxasUnavailable { .. }) if !required() => {
            eprintln!("skipping the ptxas check: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    eprintln!(
        "{:<24} {:>4} {:>6} {:>6} {:>6}",
        "kernel", "regs", "spill>", "spill<", "smem"
    );
    for r in &resources {
        eprintln!(
            "{:<24} {:>4} {:>6} {:>6} {:>6}",
            r.name, r.registers, r.spill_stores, r.spill_loads, r.shared_bytes
        );
    }
    for k in &kernels {
        let r = resources
            .iter()
            .find(|r| r.name == k.name)
            .unwrap_or_else(|| panic!("{} missing from ptxas' report", k.name));
        assert!(r.registers > 0 && r.registers <= 255, "{r:?}");
        assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{r:?} spills");
        assert!(
            r.shared_bytes <= 48 * 1024,
            "{r:?} needs opt-in shared memory"
        );
    }
    assert_eq!(resources.len(), kernels.len());
}

#[test]
fn fallback_paths_compile_for_sm70() {
    if !nvrtc_available("fallback_paths_compile_for_sm70") {
        return;
    }
    let target = CudaTarget::parse("sm_70").expect("parses");
    let kernels = emit_all(&target);
    let ptx = compile_ptx(&module_source(&kernels), &target).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.ptx.contains(".target sm_70"));
    assert!(!ptx.ptx.contains("mma.sync"), "tensor-core code for sm_70");
}

#[test]
fn a_compile_error_shows_the_log_and_the_numbered_source() {
    if !nvrtc_available("a_compile_error_shows_the_log_and_the_numbered_source") {
        return;
    }
    let source =
        "extern \"C\" __global__ void broken(float* out)\n{\n    out[0] = no_such_name;\n}\n";
    let err = compile_ptx(source, &CudaTarget::default()).expect_err("does not compile");
    let msg = err.to_string();
    assert!(matches!(err, CudaError::Compile { .. }), "{msg}");
    assert!(msg.contains("no_such_name"), "{msg}");
    assert!(msg.contains("--gpu-architecture=compute_90"), "{msg}");
    assert!(msg.contains("    3 |     out[0] = no_such_name;"), "{msg}");
}
