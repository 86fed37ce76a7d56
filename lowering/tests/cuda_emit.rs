//! The CUDA C the backend emits, per kernel kind: the launch contract (buffers in documented
//! order, then the step dims), the bounds guards, the indexing that matters (GQA head
//! mapping, page-table addressing, the tensor-core path), launch shapes and determinism.

use maxc_lowering::cuda::{emit_kernel, module_source, CudaError, CudaKernel, CudaTarget};
use maxc_schema::{
    DType, EwInput, EwInstr, GatherIndex, GridExtent, KernelBody, KvDtype, Rows, StepDim,
};

const STEP: Rows = Rows::Step(StepDim::TotalSeqLen);
const DIMS: [&str; 6] = [
    "total_seq_len",
    "batch_size",
    "max_num_pages",
    "total_num_pages",
    "input_row_offsets_len",
    "logit_rows",
];

fn sm90() -> CudaTarget {
    CudaTarget::parse("sm_90").expect("sm_90 parses")
}

fn emit(body: &KernelBody) -> CudaKernel {
    emit_kernel(body.kind(), body, &sm90()).expect("emits")
}

/// The parameter names of the kernel's signature, in order.
fn params(k: &CudaKernel) -> Vec<String> {
    let head = format!("__launch_bounds__({}) {}(", k.launch.block[0], k.name);
    let start = k.source.find(&head).expect("signature") + head.len();
    let end = start + k.source[start..].find(')').expect("closing paren");
    k.source[start..end]
        .split(',')
        .map(|p| {
            p.split_whitespace()
                .last()
                .expect("named parameter")
                .to_string()
        })
        .collect()
}

/// Asserts the signature: `bufs` as `__restrict__` pointers in order, then the six dims.
fn assert_signature(k: &CudaKernel, bufs: &[&str]) {
    assert!(
        k.source
            .contains("extern \"C\" __global__ void __launch_bounds__("),
        "{}",
        k.source
    );
    let mut want: Vec<String> = bufs.iter().map(|s| s.to_string()).collect();
    want.extend(DIMS.iter().map(|s| s.to_string()));
    assert_eq!(params(k), want, "{}", k.source);
    for b in bufs {
        assert!(
            k.source.contains(&format!("* __restrict__ {b},")),
            "`{b}` is not a __restrict__ pointer:\n{}",
            k.source
        );
    }
    for d in DIMS {
        assert!(k.source.contains(&format!("const unsigned long long {d}")));
    }
}

fn assert_has(k: &CudaKernel, needles: &[&str]) {
    for n in needles {
        assert!(k.source.contains(n), "missing `{n}` in:\n{}", k.source);
    }
}

fn ceil_rows(rows: Rows, by: u64) -> GridExtent {
    GridExtent::CeilDiv { rows, by }
}

#[test]
fn gather_guards_rows_and_reads_the_chosen_row() {
    let k = emit(&KernelBody::Gather {
        rows: STEP,
        cols: 13,
        index: GatherIndex::Tokens,
        src_dtype: DType::BF16,
        scale: 1.0,
    });
    assert_signature(&k, &["src", "index", "out"]);
    assert_has(
        &k,
        &[
            "const __nv_bfloat16* __restrict__ src",
            "const long long* __restrict__ index",
            "if (i >= total_seq_len) return;",
            "maxc_ld(src, token * 13ULL + c)",
            "out[i * 13ULL + c]",
        ],
    );
    assert_eq!(k.launch.grid[0], ceil_rows(STEP, 1));
    assert_eq!(k.launch.block, [32, 1, 1]);

    let last = emit(&KernelBody::Gather {
        rows: Rows::Step(StepDim::LogitRows),
        cols: 300,
        index: GatherIndex::LogitRows,
        src_dtype: DType::F32,
        scale: 1.0,
    });
    assert_signature(&last, &["src", "index", "out"]);
    assert_has(
        &last,
        &[
            "const int* __restrict__ index",
            "if (i >= logit_rows) return;",
            "const long long row = (long long)index[i];",
            "row >= 0 && (maxc_u64)row < total_seq_len",
            ": 0.0f;",
        ],
    );
    assert_eq!(last.launch.block, [256, 1, 1]);

    let fixed = emit(&KernelBody::Gather {
        rows: Rows::Fixed(5),
        cols: 8,
        index: GatherIndex::Tokens,
        src_dtype: DType::F16,
        scale: 1.0,
    });
    assert_has(&fixed, &["if (i >= 5ULL) return;", "const __half*"]);
    assert_eq!(fixed.launch.grid[0], ceil_rows(Rows::Fixed(5), 1));
}

#[test]
fn positions_walk_each_sequence_within_the_step() {
    let k = emit(&KernelBody::Positions);
    assert_signature(&k, &["input_row_offsets", "cache_lengths", "out"]);
    assert_has(
        &k,
        &[
            "if (b >= batch_size || b + 1 >= input_row_offsets_len) return;",
            "(long long)cache_lengths[b] - lo",
            "(maxc_u64)r < total_seq_len",
            "out[r] = base + r;",
        ],
    );
    assert_eq!(
        k.launch.grid[0],
        ceil_rows(Rows::Step(StepDim::BatchSize), 1)
    );
}

#[test]
fn rms_norm_with_and_without_residual() {
    let with = emit(&KernelBody::RmsNorm {
        rows: STEP,
        cols: 37,
        width: 37,
        weight_offset: 0.0,
        eps: 1e-6,
        residual: true,
        weight_dtype: DType::F16,
    });
    assert_signature(&with, &["a", "b", "w", "sum", "out"]);
    assert_has(
        &with,
        &[
            "const __half* __restrict__ w",
            "if (r >= total_seq_len) return;",
            "a[r * 37ULL + c] + b[r * 37ULL + c]",
            "sum[r * 37ULL + c] = v;",
            "maxc_block_sum(sq)",
            "1.0f / sqrtf(sq / 37.0f + 1e-6f)",
            "out[r * 37ULL + c] = sum[r * 37ULL + c] * inv * maxc_ld(w, c);",
        ],
    );
    let without = emit(&KernelBody::RmsNorm {
        rows: Rows::Fixed(3),
        cols: 4096,
        width: 4096,
        weight_offset: 0.0,
        eps: 1e-5,
        residual: false,
        weight_dtype: DType::F32,
    });
    assert_signature(&without, &["x", "w", "out"]);
    assert_has(
        &without,
        &["if (r >= 3ULL) return;", "x[r * 4096ULL + c] * inv"],
    );
    assert!(!without.source.contains("sum["));
    assert_eq!(without.launch.block, [256, 1, 1]);
}

#[test]
fn elementwise_program_is_straight_line_c() {
    let body = KernelBody::Elementwise {
        rows: STEP,
        cols: 7,
        inputs: vec![
            EwInput {
                dtype: DType::F32,
                broadcast: false,
            },
            EwInput {
                dtype: DType::BF16,
                broadcast: true,
            },
            EwInput {
                dtype: DType::F32,
                broadcast: false,
            },
        ],
        program: vec![
            EwInstr::Input(0),
            EwInstr::Input(1),
            EwInstr::Mul(0, 1),
            EwInstr::Silu(2),
            EwInstr::Input(2),
            EwInstr::Add(3, 4),
        ],
    };
    let k = emit(&body);
    assert_signature(&k, &["in0", "in1", "in2", "out"]);
    assert_has(
        &k,
        &[
            "const __nv_bfloat16* __restrict__ in1",
            "if (r >= total_seq_len) return;",
            "c < 7ULL;",
            "const float v0 = maxc_ld(in0, r * 7ULL + c);",
            "const float v1 = maxc_ld(in1, c);",
            "const float v2 = v0 * v1;",
            "const float v3 = maxc_silu(v2);",
            "const float v4 = maxc_ld(in2, r * 7ULL + c);",
            "const float v5 = v3 + v4;",
            "out[r * 7ULL + c] = v5;",
        ],
    );
    assert_eq!(k.launch.grid[1], GridExtent::Fixed(1));

    let wide = emit(&KernelBody::Elementwise {
        rows: STEP,
        cols: 1000,
        inputs: vec![EwInput {
            dtype: DType::F32,
            broadcast: false,
        }],
        program: vec![EwInstr::Input(0), EwInstr::Silu(0)],
    });
    // 256 threads per block, 4 column blocks in y, grid-stride over the rest.
    assert_eq!(wide.launch.block, [256, 1, 1]);
    assert_eq!(wide.launch.grid[1], GridExtent::Fixed(4));
    assert_has(&wide, &["c += (maxc_u64)gridDim.y * blockDim.x"]);
}

#[test]
fn rope_reads_the_positions_table_row() {
    let k = emit(&KernelBody::Rope {
        heads: 4,
        head_dim: 16,
        rotary_dim: 16,
    });
    assert_signature(&k, &["x", "positions", "table", "out"]);
    assert_has(
        &k,
        &[
            "if (r >= total_seq_len) return;",
            "const long long* __restrict__ positions",
            "table + pos * 16ULL",
            "cos_row + 8ULL",
            "i < 32ULL",
            "r * 64ULL + h * 16ULL + j",
            "out[lo] = x1 * c - x2 * s;",
            "out[hi] = x2 * c + x1 * s;",
        ],
    );
}

#[test]
fn kv_store_addresses_pages_through_the_lookup_table() {
    let k = emit(&KernelBody::KvStore {
        planes: 2,
        layer: 2,
        num_layers: 3,
        kv_heads: 2,
        head_dim: 128,
        page_size: 16,
        kv_dtype: KvDtype::F32,
    });
    assert_signature(
        &k,
        &[
            "k",
            "v",
            "kv_cache",
            "kv_lookup_table",
            "cache_lengths",
            "input_row_offsets",
        ],
    );
    assert_has(
        &k,
        &[
            "unsigned char* __restrict__ kv_cache",
            "if (r >= total_seq_len) return;",
            "maxc_sequence_of(input_row_offsets, batch_size, r)",
            "(long long)cache_lengths[b] + ((long long)r - (long long)input_row_offsets[b])",
            "(maxc_u64)p / 16ULL",
            "(maxc_u64)p % 16ULL",
            "if (page_index >= max_num_pages) return;",
            "kv_lookup_table[b * max_num_pages + page_index]",
            "(maxc_u64)page_entry >= total_num_pages",
            // [pages, num_layers, 2, kv_heads, page_size, head_dim], in bytes: layer 2 of 3,
            // K then V. A page is 3 × 2 × 2 × 16 × 128 × 4 = 98304 bytes; layer 2's keys start
            // (2·2 + 0)·2·16·512 = 65536 bytes in, its values (2·2 + 1)·2·16·512 = 81920; a
            // head's row is 512 bytes, its 16 rows 8192.
            "kv_cache + page * 98304ULL + 65536ULL + slot * 512ULL",
            "kv_cache + page * 98304ULL + 81920ULL + slot * 512ULL",
            "const float x = k[r * 256ULL + c];",
            "const float x = v[r * 256ULL + c];",
            "unsigned char* row = k_dst + (c / 128ULL) * 8192ULL;",
            "unsigned char* row = v_dst + (c / 128ULL) * 8192ULL;",
            "const maxc_u64 e = c % 128ULL;",
            "((float*)row)[e] = x;",
        ],
    );
    assert!(k.source.contains("const float* __restrict__ k,"));
}

#[test]
fn attention_maps_query_heads_to_kv_heads_and_pages() {
    let k = emit(&KernelBody::Attention {
        planes: 2,
        value_dim: 128,
        layer: 1,
        num_layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        page_size: 16,
        scale: 0.125,
        window: None,
        kv_dtype: KvDtype::F32,
    });
    assert_signature(
        &k,
        &[
            "q",
            "kv_cache",
            "kv_lookup_table",
            "cache_lengths",
            "input_row_offsets",
            "out",
        ],
    );
    assert_has(
        &k,
        &[
            "const unsigned char* __restrict__ kv_cache",
            "if (r >= total_seq_len || head >= 8ULL) return;",
            // GQA: 8 query heads over 2 KV heads, 4 per group.
            "const maxc_u64 kv_head = head / 4ULL;",
            "q + (r * 8ULL + head) * 128ULL",
            "for (long long pos = warp; pos <= p; pos += 4)",
            "kv_lookup_table[b * max_num_pages + page_index]",
            "if (page_index >= max_num_pages) continue;",
            "(maxc_u64)page_entry >= total_num_pages) continue;",
            // A page is 2 × 2 × 2 × 16 × 128 × 4 = 65536 bytes; layer 1's keys start
            // (1·2 + 0)·2·16·512 = 32768 bytes in, its values (1·2 + 1)·2·16·512 = 49152; a
            // KV head's row is 512 bytes and its rows (16) 8192, head-major.
            "kv_cache + page * 65536ULL + 32768ULL + slot * 512ULL + kv_head * 8192ULL",
            "kv_cache + page * 65536ULL + 49152ULL + slot * 512ULL + kv_head * 8192ULL",
            "maxc_warp_sum(dot) * 0.125f",
            "expf(m - m_new)",
            "acc[e] = acc[e] * corr + w * ((const float*)(v_ptr))[d];",
            "float qv[4];",
            "out_row[d] = l_all > 0.0f ? o / l_all : 0.0f;",
        ],
    );
    assert_eq!(k.launch.grid[0], ceil_rows(STEP, 1));
    assert_eq!(k.launch.grid[1], GridExtent::Fixed(8));
    assert_eq!(k.launch.block, [128, 1, 1]);
}

#[test]
fn softmax_and_top_k_per_row() {
    let s = emit(&KernelBody::Softmax {
        rows: STEP,
        cols: 13,
    });
    assert_signature(&s, &["x", "out"]);
    assert_has(
        &s,
        &[
            "if (r >= total_seq_len) return;",
            "maxc_block_max(m)",
            "expf(x_row[c] - m)",
            "maxc_block_sum(s)",
            "out_row[c] / s",
        ],
    );
    let t = emit(&KernelBody::TopK {
        rows: STEP,
        cols: 13,
        k: 2,
        renormalize: true,
    });
    assert_signature(&t, &["x", "out"]);
    assert_has(
        &t,
        &[
            "(maxc_u64)blockIdx.x * 4ULL + (threadIdx.x >> 5)",
            "if (r >= total_seq_len) return;",
            "pass < 2ULL",
            "v < pv || (v == pv && (long long)j > pi)",
            "ov > bv || (ov == bv && oi < bi)",
            "out_row[j] = kept ? v / sum : 0.0f;",
        ],
    );
    assert_eq!(t.launch.grid[0], ceil_rows(STEP, 4));
    // k above cols keeps every entry; without renormalize the value is kept as is.
    let all = emit(&KernelBody::TopK {
        rows: STEP,
        cols: 13,
        k: 70,
        renormalize: false,
    });
    assert_has(&all, &["pass < 13ULL", "out_row[j] = kept ? v : 0.0f;"]);
}

#[test]
fn matmul_uses_tensor_cores_for_16_bit_weights_on_sm80_and_later() {
    let body = |weight_dtype, bias| KernelBody::Matmul {
        rows: STEP,
        n: 13,
        k: 37,
        weight_dtype,
        bias,
    };
    let bf16 = emit(&body(DType::BF16, true));
    assert_signature(&bf16, &["x", "w", "bias", "out"]);
    assert_has(
        &bf16,
        &[
            "maxc_mma_bf16(acc[mi][ni], a[mi], b[ni])",
            "maxc_bf16_bits(x_row[kg])",
            "if (kg + 1 < 37ULL) hi = maxc_bf16_bits(x_row[kg + 1]);",
            "if (col < 13ULL)",
            "if (row < rows)",
            "if (row + 8u < rows)",
            "const maxc_u64 rows = total_seq_len;",
            "maxc_ld(bias, col)",
        ],
    );
    assert!(!bf16.source.contains("maxc_mma_f16"));
    assert_eq!(
        bf16.launch.grid,
        [
            GridExtent::Fixed(1),
            ceil_rows(STEP, 64),
            GridExtent::Fixed(1)
        ]
    );
    assert_eq!(bf16.launch.block, [128, 1, 1]);

    let f16 = emit(&body(DType::F16, false));
    assert_signature(&f16, &["x", "w", "out"]);
    assert_has(&f16, &["maxc_mma_f16(", "maxc_f16_bits(x_row[kg])"]);
    assert!(!f16.source.contains("maxc_ld(bias"));
    assert_has(&f16, &["const float bias_v = 0.0f;"]);

    let f32 = emit(&body(DType::F32, true));
    assert_signature(&f32, &["x", "w", "bias", "out"]);
    assert!(!f32.source.contains("mma"), "{}", f32.source);
    assert_has(
        &f32,
        &[
            "__shared__ float xs[16][64 + 1];",
            "(row < rows && kg < 37ULL) ? x[row * 37ULL + kg] : 0.0f",
            "(col < 13ULL && kg < 37ULL) ? maxc_ld(w, col * 37ULL + kg) : 0.0f",
            "if (col >= 13ULL) continue;",
            "if (row < rows) out[row * 13ULL + col] = acc[i][j] + bias_v;",
        ],
    );
    assert_eq!(f32.launch.block, [256, 1, 1]);

    // Before sm_80, 16-bit weights take the tiled kernel.
    let volta = CudaTarget::parse("sm_70").expect("parses");
    let old = emit_kernel("mm", &body(DType::BF16, false), &volta).expect("emits");
    assert!(!old.source.contains("mma"), "{}", old.source);
    assert_has(&old, &["maxc_ld(w, col * 37ULL + kg)"]);

    // The prelude holds the PTX the wrappers issue.
    let module = module_source(&[bf16]);
    assert!(module.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
    assert!(module.contains("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"));
}

#[test]
fn moe_experts_run_every_routed_expert_in_one_kernel_grouped_by_row_tile() {
    let k = emit(&KernelBody::MoeExperts {
        rows: STEP,
        hidden: 64,
        ffn: 3000,
        experts: 3,
        weight_dtype: DType::BF16,
    });
    assert_signature(
        &k,
        &[
            "x", "routing", "gate0", "up0", "down0", "gate1", "up1", "down1", "gate2", "up2",
            "down2", "out",
        ],
    );
    assert_has(
        &k,
        &[
            "static __device__ __noinline__ void moe_experts_expert(",
            // A block per tile of 8 rows; every expert in order, skipped inside where no row
            // of the tile is routed to it.
            "const maxc_u64 row0 = (maxc_u64)blockIdx.x * 8ULL;",
            "if (row0 >= total_seq_len) return;",
            "moe_experts_expert(x, routing, row0, total_seq_len, 0ULL, gate0, up0, down0, out, h);",
            "moe_experts_expert(x, routing, row0, total_seq_len, 2ULL, gate2, up2, down2, out, h);",
            "route[m] = row0 + m < rows ? routing[(row0 + m) * 3ULL + e] : 0.0f;",
            "if (!any) return;",
            // Each weight element is loaded once and used for every routed row of the tile.
            "const float gw = maxc_ld(gate, w_row + c);",
            "const float dw = maxc_ld(down, d_row + f);",
            // ffn 3000 in chunks of 1024 activations per row.
            "__shared__ float h[8ULL * 1024ULL];",
            "f0 += 1024ULL",
            "h[m * 1024ULL + f] = maxc_silu(gs) * us;",
            "out[(row0 + m) * 64ULL + j] += route[m] * ys;",
            "out[(row0 + m) * 64ULL + j] = 0.0f;",
        ],
    );
    // The expert order of each row's sum is fixed: 0, 1, 2.
    let calls: Vec<usize> = (0..3)
        .map(|e| {
            k.source
                .find(&format!(", {e}ULL, gate{e}"))
                .expect("a call")
        })
        .collect();
    assert!(calls.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(k.launch.grid[0], ceil_rows(STEP, 8));
}

/// One kernel of every kind.
fn all_kinds() -> Vec<KernelBody> {
    vec![
        KernelBody::Gather {
            rows: STEP,
            cols: 13,
            index: GatherIndex::Tokens,
            src_dtype: DType::BF16,
            scale: 1.0,
        },
        KernelBody::Positions,
        KernelBody::RmsNorm {
            rows: STEP,
            cols: 37,
            width: 37,
            weight_offset: 0.0,
            eps: 1e-6,
            residual: true,
            weight_dtype: DType::F16,
        },
        KernelBody::Elementwise {
            rows: STEP,
            cols: 7,
            inputs: vec![EwInput {
                dtype: DType::F32,
                broadcast: false,
            }],
            program: vec![EwInstr::Input(0), EwInstr::Silu(0)],
        },
        KernelBody::Rope {
            heads: 4,
            head_dim: 16,
            rotary_dim: 16,
        },
        KernelBody::KvStore {
            planes: 2,
            layer: 0,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 8,
            page_size: 16,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Attention {
            planes: 2,
            value_dim: 32,
            layer: 1,
            num_layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            page_size: 16,
            scale: 0.17,
            window: None,
            kv_dtype: KvDtype::F32,
        },
        KernelBody::Softmax {
            rows: STEP,
            cols: 13,
        },
        KernelBody::TopK {
            rows: STEP,
            cols: 13,
            k: 2,
            renormalize: true,
        },
        KernelBody::Matmul {
            rows: STEP,
            n: 13,
            k: 37,
            weight_dtype: DType::BF16,
            bias: true,
        },
        KernelBody::MoeExperts {
            rows: STEP,
            hidden: 8,
            ffn: 8,
            experts: 2,
            weight_dtype: DType::F32,
        },
    ]
}

#[test]
fn emission_is_deterministic_and_the_module_holds_every_kernel() {
    let emit_all = || -> Vec<CudaKernel> {
        all_kinds()
            .iter()
            .enumerate()
            .map(|(i, b)| emit_kernel(&format!("k{i}_{}", b.kind()), b, &sm90()).expect("emits"))
            .collect()
    };
    let (a, b) = (emit_all(), emit_all());
    assert_eq!(a, b);
    let module = module_source(&a);
    assert_eq!(module, module_source(&b));
    assert!(module.starts_with("// Generated by maxc"));
    assert!(module.contains("#include <cuda_bf16.h>"));
    let mut at = 0;
    for k in &a {
        let found = module[at..]
            .find(&k.source)
            .unwrap_or_else(|| panic!("{} missing or out of order", k.name));
        at += found + k.source.len();
    }
}

#[test]
fn errors_name_the_kernel_and_the_problem() {
    let t = sm90();
    let invalid = |name: &str, body: &KernelBody| match emit_kernel(name, body, &t) {
        Err(e @ CudaError::Invalid { .. }) => e.to_string(),
        other => panic!("expected an Invalid error, got {other:?}"),
    };
    let softmax = KernelBody::Softmax {
        rows: STEP,
        cols: 4,
    };
    assert!(invalid("3d", &softmax).contains("not a C identifier"));
    assert!(invalid("maxc_softmax", &softmax).contains("reserved prefix"));
    let zero = KernelBody::Softmax {
        rows: STEP,
        cols: 0,
    };
    assert!(invalid("s", &zero).contains("`cols` is 0"));

    let bad_gqa = KernelBody::Attention {
        planes: 2,
        value_dim: 8,
        layer: 0,
        num_layers: 1,
        heads: 3,
        kv_heads: 2,
        head_dim: 8,
        page_size: 4,
        scale: 1.0,
        window: None,
        kv_dtype: KvDtype::F32,
    };
    let msg = invalid("attn", &bad_gqa);
    assert!(msg.starts_with("kernel `attn` (attention)"), "{msg}");
    assert!(msg.contains("kv_heads"), "{msg}");

    let bad_layer = KernelBody::KvStore {
        planes: 2,
        layer: 2,
        num_layers: 2,
        kv_heads: 1,
        head_dim: 8,
        page_size: 4,
        kv_dtype: KvDtype::F32,
    };
    assert!(invalid("kv", &bad_layer).contains("`layer` is 2"));

    let odd = KernelBody::Rope {
        heads: 1,
        head_dim: 7,
        rotary_dim: 7,
    };
    assert!(invalid("rope", &odd).contains("even"));

    let int_weights = KernelBody::Matmul {
        rows: Rows::Fixed(1),
        n: 4,
        k: 4,
        weight_dtype: DType::I32,
        bias: false,
    };
    assert!(invalid("mm", &int_weights).contains("weight_dtype"));

    let forward = KernelBody::Elementwise {
        rows: Rows::Fixed(1),
        cols: 4,
        inputs: vec![EwInput {
            dtype: DType::F32,
            broadcast: false,
        }],
        program: vec![EwInstr::Input(0), EwInstr::Add(0, 1)],
    };
    assert!(invalid("ew", &forward).contains("operand 1"));
    let missing_input = KernelBody::Elementwise {
        rows: Rows::Fixed(1),
        cols: 4,
        inputs: vec![],
        program: vec![EwInstr::Input(0)],
    };
    assert!(invalid("ew", &missing_input).contains("reads input 0"));
}

#[test]
fn targets_parse_and_name_their_architectures() {
    let t = CudaTarget::default();
    assert_eq!(
        (t.arch.as_str(), t.sm(), t.compute()),
        ("sm_90", 90, "compute_90".to_string())
    );
    let a = CudaTarget::parse("sm_90a").expect("parses");
    assert_eq!((a.sm(), a.compute()), (90, "compute_90a".to_string()));
    assert_eq!(CudaTarget::parse("sm_120").expect("parses").sm(), 120);
    for bad in ["sm_61", "compute_90", "sm_9x", "sm_", "90", "sm_90b"] {
        let err = CudaTarget::parse(bad).expect_err(bad);
        assert!(err.to_string().contains(bad), "{err}");
    }
}
