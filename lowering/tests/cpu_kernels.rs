//! Every generated CPU kernel kind, run on deterministic pseudo-random data (odd widths,
//! several sequences, interleaved pages), split into two calls over its parallel range, and
//! compared against a plain scalar reference. Skips on hosts the baseline target cannot run on.

use maxc_lowering::cpu::{compile_kernel, CpuError, CpuTarget};
use maxc_runtime::cpu::code::ExecutableCode;
use maxc_schema::{DType, EwInput, EwInstr, GatherIndex, KernelBody, KvDtype, Rows, StepDim};

// ---------------------------------------------------------------------------------------------
// Harness

/// A small LCG: deterministic data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    fn below(&mut self, n: u64) -> u64 {
        u64::from(self.next_u32()) % n
    }
}

/// The host's baseline target, or `None` where this host cannot run it (tests then skip).
fn target() -> Option<CpuTarget> {
    let target = CpuTarget::host_baseline()?;
    target.host_supports().then_some(target)
}

/// A compiled kernel, ready to run.
struct Kernel {
    body: KernelBody,
    exe: ExecutableCode,
}

impl Kernel {
    fn new(body: KernelBody) -> Option<Self> {
        let target = target()?;
        let code = compile_kernel(&body, &target)
            .unwrap_or_else(|e| panic!("{} kernel does not compile: {e}", body.kind()));
        let exe = ExecutableCode::new(&code).expect("executable memory");
        Some(Kernel { body, exe })
    }

    /// Runs the kernel over its whole parallel range as two calls (`0..mid`, `mid..end`).
    fn run(&self, bufs: &[*mut u8], dims: [u64; StepDim::COUNT]) {
        let extent = self.body.parallel_extent(&dims);
        let mid = extent * 2 / 5;
        // SAFETY: the code was compiled for this host with the kernel signature; every test
        // passes the buffers its body documents, sized for `dims`.
        unsafe {
            let f = self.exe.kernel(0);
            f(bufs.as_ptr(), dims.as_ptr(), 0, mid);
            f(bufs.as_ptr(), dims.as_ptr(), mid, extent);
        }
    }
}

/// Raw buffer pointers, in `bufs` order.
macro_rules! ptrs {
    ($($b:expr),* $(,)?) => { [$($b.as_mut_ptr().cast::<u8>()),*] };
}

/// The step sizes, by [`StepDim`] slot.
fn dims(t: usize, b: usize, max_pages: usize, pages: usize) -> [u64; StepDim::COUNT] {
    let mut d = [0u64; StepDim::COUNT];
    d[StepDim::TotalSeqLen as usize] = t as u64;
    d[StepDim::BatchSize as usize] = b as u64;
    d[StepDim::MaxNumPages as usize] = max_pages as u64;
    d[StepDim::TotalNumPages as usize] = pages as u64;
    d[StepDim::InputRowOffsetsLen as usize] = b as u64 + 1;
    d[StepDim::LogitRows as usize] = b as u64;
    d
}

/// Asserts `|got - want| <= tol · max(1, |want|)` elementwise.
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs() / w.abs().max(1.0);
        assert!(!err.is_nan(), "{what}[{i}]: got {g}, want {w}");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= tol,
        "{what}: error {:.3e} at {i}: got {}, want {}",
        worst.0,
        got[i],
        want[i]
    );
}

/// A weight buffer: its bytes as stored, and the f32 values they decode to.
struct Weights {
    bytes: Vec<u8>,
    values: Vec<f32>,
}

/// `n` pseudo-random weights stored as `dtype`.
fn weights(rng: &mut Rng, n: usize, dtype: DType) -> Weights {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for i in 0..n {
        let v = rng.f32();
        match dtype {
            DType::F32 => {
                bytes.extend(v.to_le_bytes());
                values.push(v);
            }
            DType::BF16 => {
                let bits = (v.to_bits() >> 16) as u16;
                bytes.extend(bits.to_le_bytes());
                values.push(f32::from_bits(u32::from(bits) << 16));
            }
            DType::F16 => {
                // Mostly normals of magnitude 2^-6..2^1, every 7th a subnormal.
                let sign = (rng.next_u32() & 1) as u16;
                let mant = (rng.next_u32() & 0x3ff) as u16;
                let exp = if i % 7 == 3 {
                    0
                } else {
                    9 + (rng.next_u32() % 8) as u16
                };
                let bits = sign << 15 | exp << 10 | mant;
                bytes.extend(bits.to_le_bytes());
                values.push(f16_to_f32(bits));
            }
            other => panic!("no weights of {other:?}"),
        }
    }
    Weights { bytes, values }
}

/// Reference binary16 decoding, by arithmetic.
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let mant = f32::from(h & 0x3ff);
    match exp {
        0 => sign * mant * 2f32.powi(-24),
        31 if mant == 0.0 => sign * f32::INFINITY,
        31 => {
            f32::from_bits(u32::from(h & 0x8000) << 16 | 0x7f80_0000 | u32::from(h & 0x3ff) << 13)
        }
        _ => sign * (1.0 + mant / 1024.0) * 2f32.powi(exp - 15),
    }
}

const WEIGHT_TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

// ---------------------------------------------------------------------------------------------
// Gather, positions

#[test]
fn gather_tokens_in_every_weight_type() {
    let mut rng = Rng(1);
    for dtype in WEIGHT_TYPES {
        for cols in [7usize, 13, 32] {
            let (vocab, rows) = (11usize, 9usize);
            let Some(k) = Kernel::new(KernelBody::Gather {
                rows: Rows::Step(StepDim::TotalSeqLen),
                cols: cols as u64,
                index: GatherIndex::Tokens,
                src_dtype: dtype,
                scale: 1.0,
            }) else {
                return;
            };
            let mut src = weights(&mut rng, vocab * cols, dtype);
            let mut tokens: Vec<i64> = (0..rows).map(|_| rng.below(vocab as u64) as i64).collect();
            let mut out = vec![f32::NAN; rows * cols];
            k.run(&ptrs![src.bytes, tokens, out], dims(rows, 1, 1, 1));
            let want: Vec<f64> = tokens
                .iter()
                .flat_map(|&t| &src.values[t as usize * cols..][..cols])
                .map(|&v| f64::from(v))
                .collect();
            assert_close(&out, &want, 0.0, &format!("gather {dtype:?} cols {cols}"));
        }
    }
}

#[test]
fn gather_logit_rows_returns_the_indexed_rows_and_zeros_for_minus_one() {
    let mut rng = Rng(2);
    let cols = 13usize;
    let Some(k) = Kernel::new(KernelBody::Gather {
        rows: Rows::Step(StepDim::LogitRows),
        cols: cols as u64,
        index: GatherIndex::LogitRows,
        src_dtype: DType::F32,
        scale: 1.0,
    }) else {
        return;
    };
    let t = 9;
    let mut x = rng.vec(t * cols);
    for mut index in [vec![2i32], vec![8, -1, 0, 3, 3, 7], (0..9).collect()] {
        let n = index.len();
        let mut out = vec![f32::NAN; n * cols];
        let mut d = dims(t, 4, 1, 1);
        d[StepDim::LogitRows as usize] = n as u64;
        k.run(&ptrs![x, index, out], d);
        let want: Vec<f64> = index
            .iter()
            .flat_map(|&r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| match usize::try_from(r) {
                Ok(r) => f64::from(x[r * cols + c]),
                Err(_) => 0.0,
            })
            .collect();
        assert_close(&out, &want, 0.0, &format!("gather rows {index:?}"));
    }
}

#[test]
fn f16_widening_is_exact_for_every_bit_pattern() {
    let cols = 1usize << 16;
    let Some(k) = Kernel::new(KernelBody::Gather {
        rows: Rows::Fixed(1),
        cols: cols as u64,
        index: GatherIndex::Tokens,
        src_dtype: DType::F16,
        scale: 1.0,
    }) else {
        return;
    };
    let mut src: Vec<u16> = (0..=u16::MAX).collect();
    let mut tokens = vec![0i64];
    let mut out = vec![0f32; cols];
    k.run(&ptrs![src, tokens, out], dims(1, 1, 1, 1));
    for (h, got) in src.iter().zip(&out) {
        assert_eq!(got.to_bits(), f16_to_f32(*h).to_bits(), "f16 bits {h:#06x}");
    }
}

#[test]
fn positions_follow_cache_lengths() {
    let Some(k) = Kernel::new(KernelBody::Positions) else {
        return;
    };
    let mut offsets: Vec<i32> = vec![0, 2, 2, 7, 8];
    let mut cache_lengths: Vec<i32> = vec![5, 9, 0, 30];
    let mut out = vec![-1i64; 8];
    k.run(&ptrs![offsets, cache_lengths, out], dims(8, 4, 1, 1));
    assert_eq!(out, vec![5, 6, 0, 1, 2, 3, 4, 30]);
}

// ---------------------------------------------------------------------------------------------
// Row kernels: RMSNorm, elementwise, softmax, top-k

fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + f64::from(eps)).sqrt();
    x.iter()
        .zip(w)
        .map(|(&v, &w)| f64::from(v) * inv * f64::from(w))
        .collect()
}

#[test]
fn rms_norm_with_and_without_residual() {
    let mut rng = Rng(3);
    let eps = 1e-5f32;
    for dtype in WEIGHT_TYPES {
        // (row width, values normalized together): whole rows, and per-head norms.
        for (cols, width) in [
            (7usize, 7usize),
            (13, 13),
            (37, 37),
            (64, 64),
            (48, 16),
            (96, 32),
        ] {
            for residual in [false, true] {
                let rows = 5usize;
                let Some(k) = Kernel::new(KernelBody::RmsNorm {
                    rows: Rows::Step(StepDim::TotalSeqLen),
                    cols: cols as u64,
                    width: width as u64,
                    weight_offset: 0.0,
                    eps,
                    residual,
                    weight_dtype: dtype,
                }) else {
                    return;
                };
                let mut w = weights(&mut rng, width, dtype);
                let mut a = rng.vec(rows * cols);
                let mut b = rng.vec(rows * cols);
                let mut sum = vec![f32::NAN; rows * cols];
                let mut out = vec![f32::NAN; rows * cols];
                let d = dims(rows, 1, 1, 1);
                let what =
                    format!("rms_norm {dtype:?} cols {cols} width {width} residual {residual}");
                let x: Vec<f32> = if residual {
                    k.run(&ptrs![a, b, w.bytes, sum, out], d);
                    let x: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
                    assert_eq!(sum, x, "{what}: sum");
                    x
                } else {
                    k.run(&ptrs![a, w.bytes, out], d);
                    a.clone()
                };
                let want: Vec<f64> = x
                    .chunks(width)
                    .flat_map(|row| rms_norm_ref(row, &w.values, eps))
                    .collect();
                assert_close(&out, &want, 1e-5, &what);
            }
        }
    }
}

#[test]
fn elementwise_programs_with_broadcast_and_weight_inputs() {
    let mut rng = Rng(4);
    let silu = |v: f64| v / (1.0 + (-v).exp());
    for dtype in WEIGHT_TYPES {
        for cols in [1usize, 7, 13, 40] {
            let rows = 6usize;
            // out = silu(a · 4) · b + bias, with `a` read twice.
            let program = vec![
                EwInstr::Input(0),
                EwInstr::Input(0),
                EwInstr::Add(0, 1),
                EwInstr::Add(2, 2),
                EwInstr::Silu(3),
                EwInstr::Input(1),
                EwInstr::Mul(4, 5),
                EwInstr::Input(2),
                EwInstr::Add(6, 7),
            ];
            let inputs = vec![
                EwInput {
                    dtype: DType::F32,
                    broadcast: false,
                },
                EwInput {
                    dtype: DType::F32,
                    broadcast: false,
                },
                EwInput {
                    dtype,
                    broadcast: true,
                },
            ];
            let Some(k) = Kernel::new(KernelBody::Elementwise {
                rows: Rows::Fixed(rows as u64),
                cols: cols as u64,
                inputs,
                program,
            }) else {
                return;
            };
            let mut a: Vec<f32> = rng.vec(rows * cols).iter().map(|v| v * 30.0).collect();
            let mut b = rng.vec(rows * cols);
            let mut bias = weights(&mut rng, cols, dtype);
            let mut out = vec![f32::NAN; rows * cols];
            k.run(&ptrs![a, b, bias.bytes, out], dims(0, 0, 0, 0));
            let want: Vec<f64> = (0..rows * cols)
                .map(|i| {
                    silu(f64::from(a[i]) * 4.0) * f64::from(b[i]) + f64::from(bias.values[i % cols])
                })
                .collect();
            assert_close(
                &out,
                &want,
                2e-6,
                &format!("elementwise {dtype:?} cols {cols}"),
            );
        }
    }
}

/// GeGLU's activation (Gemma): the tanh GELU against its tanh form in f64, over the range where
/// it bends and far into both tails.
#[test]
fn gelu_tanh_matches_its_tanh_form() {
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    let cols = 403usize;
    let Some(k) = Kernel::new(KernelBody::Elementwise {
        rows: Rows::Fixed(1),
        cols: cols as u64,
        inputs: vec![EwInput {
            dtype: DType::F32,
            broadcast: false,
        }],
        program: vec![EwInstr::Input(0), EwInstr::GeluTanh(0)],
    }) else {
        return;
    };
    let mut x: Vec<f32> = (0..cols).map(|i| (i as f32 - 201.0) * 0.06).collect();
    x[0] = -90.0;
    x[1] = 90.0;
    let mut out = vec![f32::NAN; cols];
    k.run(&ptrs![x, out], dims(0, 0, 0, 0));
    let want: Vec<f64> = x.iter().map(|&v| gelu(f64::from(v))).collect();
    assert_close(&out, &want, 2e-6, "gelu_tanh");
}

#[test]
fn elementwise_in_place_add() {
    let mut rng = Rng(5);
    let (rows, cols) = (3usize, 13usize);
    let Some(k) = Kernel::new(KernelBody::Elementwise {
        rows: Rows::Step(StepDim::TotalSeqLen),
        cols: cols as u64,
        inputs: vec![
            EwInput {
                dtype: DType::F32,
                broadcast: false
            };
            2
        ],
        program: vec![EwInstr::Input(0), EwInstr::Input(1), EwInstr::Add(0, 1)],
    }) else {
        return;
    };
    let mut a = rng.vec(rows * cols);
    let mut b = rng.vec(rows * cols);
    let want: Vec<f64> = a.iter().zip(&b).map(|(a, b)| f64::from(a + b)).collect();
    let a_ptr = a.as_mut_ptr().cast::<u8>();
    k.run(&[a_ptr, b.as_mut_ptr().cast(), a_ptr], dims(rows, 1, 1, 1));
    assert_close(&a, &want, 0.0, "in-place add");
}

fn softmax_ref(x: &[f32]) -> Vec<f64> {
    let max = x
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

#[test]
fn softmax_rows() {
    let mut rng = Rng(6);
    for cols in [1usize, 7, 13, 16, 100] {
        let rows = 5usize;
        let Some(k) = Kernel::new(KernelBody::Softmax {
            rows: Rows::Step(StepDim::TotalSeqLen),
            cols: cols as u64,
        }) else {
            return;
        };
        let mut x: Vec<f32> = rng.vec(rows * cols).iter().map(|v| v * 40.0).collect();
        let mut out = vec![f32::NAN; rows * cols];
        k.run(&ptrs![x, out], dims(rows, 1, 1, 1));
        let want: Vec<f64> = x.chunks(cols).flat_map(softmax_ref).collect();
        assert_close(&out, &want, 1e-6, &format!("softmax cols {cols}"));
    }
}

fn top_k_ref(x: &[f32], k: usize, renormalize: bool) -> Vec<f64> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    // Stable sort: equal values keep the lower index first.
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).expect("no NaN in test data"));
    let kept = &order[..k.min(x.len())];
    let sum: f64 = kept.iter().map(|&i| f64::from(x[i])).sum();
    let mut out = vec![0.0; x.len()];
    for &i in kept {
        out[i] = if renormalize {
            f64::from(x[i]) / sum
        } else {
            f64::from(x[i])
        };
    }
    out
}

#[test]
fn top_k_with_ties_and_renormalisation() {
    let mut rng = Rng(7);
    for cols in [7usize, 13, 64] {
        for k_keep in [1usize, 3, 6, 70] {
            for renormalize in [false, true] {
                let rows = 7usize;
                let Some(k) = Kernel::new(KernelBody::TopK {
                    rows: Rows::Step(StepDim::TotalSeqLen),
                    cols: cols as u64,
                    k: k_keep as u64,
                    renormalize,
                }) else {
                    return;
                };
                // Few distinct values so that ties are common; positive for renormalisation.
                let mut x: Vec<f32> = (0..rows * cols)
                    .map(|_| 0.125 + rng.below(6) as f32 * 0.25)
                    .collect();
                let mut out = vec![f32::NAN; rows * cols];
                k.run(&ptrs![x, out], dims(rows, 1, 1, 1));
                let want: Vec<f64> = x
                    .chunks(cols)
                    .flat_map(|row| top_k_ref(row, k_keep, renormalize))
                    .collect();
                let what = format!("top_k cols {cols} k {k_keep} renormalize {renormalize}");
                assert_close(&out, &want, 1e-6, &what);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Matmul

#[test]
fn matmul_in_every_weight_type_with_and_without_bias() {
    let mut rng = Rng(8);
    for dtype in WEIGHT_TYPES {
        for (n, kk) in [(13usize, 37usize), (8, 64), (5, 3)] {
            for bias in [false, true] {
                let rows = 5usize;
                let Some(k) = Kernel::new(KernelBody::Matmul {
                    rows: Rows::Step(StepDim::TotalSeqLen),
                    n: n as u64,
                    k: kk as u64,
                    weight_dtype: dtype,
                    bias,
                }) else {
                    return;
                };
                let mut x = rng.vec(rows * kk);
                let mut w = weights(&mut rng, n * kk, dtype);
                let mut b = weights(&mut rng, n, dtype);
                let mut out = vec![f32::NAN; rows * n];
                let d = dims(rows, 1, 1, 1);
                if bias {
                    k.run(&ptrs![x, w.bytes, b.bytes, out], d);
                } else {
                    k.run(&ptrs![x, w.bytes, out], d);
                }
                let mut want = vec![0f64; rows * n];
                for r in 0..rows {
                    for j in 0..n {
                        let dot: f64 = (0..kk)
                            .map(|i| f64::from(x[r * kk + i]) * f64::from(w.values[j * kk + i]))
                            .sum();
                        want[r * n + j] = dot + if bias { f64::from(b.values[j]) } else { 0.0 };
                    }
                }
                let what = format!("matmul {dtype:?} n {n} k {kk} bias {bias}");
                assert_close(&out, &want, 1e-5, &what);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rope

#[test]
fn rope_rotates_every_head() {
    let mut rng = Rng(9);
    // (head_dim, rotary_dim): whole heads, and partial rotary (Phi-3) with a copied tail.
    for (head_dim, rot) in [
        (8usize, 8usize),
        (14, 14),
        (32, 32),
        (32, 24),
        (12, 4),
        (10, 2),
    ] {
        let (t, heads, max_pos) = (5usize, 3usize, 40usize);
        let half = rot / 2;
        let Some(k) = Kernel::new(KernelBody::Rope {
            heads: heads as u64,
            head_dim: head_dim as u64,
            rotary_dim: rot as u64,
        }) else {
            return;
        };
        let mut x = rng.vec(t * heads * head_dim);
        let mut positions: Vec<i64> = (0..t).map(|_| rng.below(max_pos as u64) as i64).collect();
        let mut table = rng.vec(max_pos * rot);
        let mut out = vec![f32::NAN; x.len()];
        k.run(&ptrs![x, positions, table, out], dims(t, 1, 1, 1));
        let mut want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        for r in 0..t {
            let row = &table[positions[r] as usize * rot..];
            for h in 0..heads {
                let base = (r * heads + h) * head_dim;
                for i in 0..half {
                    let (cos, sin) = (f64::from(row[i]), f64::from(row[half + i]));
                    let (x1, x2) = (f64::from(x[base + i]), f64::from(x[base + half + i]));
                    want[base + i] = x1 * cos - x2 * sin;
                    want[base + half + i] = x2 * cos + x1 * sin;
                }
            }
        }
        assert_close(
            &out,
            &want,
            1e-6,
            &format!("rope head_dim {head_dim} rotary {rot}"),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Paged KV cache: store and attention

/// A step over several sequences with interleaved, shuffled cache pages. Lookup entries a
/// sequence does not use point at a poison page of NaN, as do all never-written slots.
struct Step {
    offsets: Vec<i32>,
    cache_lengths: Vec<i32>,
    lookup: Vec<i32>,
    max_pages: usize,
    pages: usize,
    page_size: usize,
}

impl Step {
    fn new(page_size: usize) -> Step {
        let new_rows = [3usize, 0, 1, 4, 2];
        let cached = [5usize, 2, 0, 17, 3];
        let mut offsets = vec![0i32];
        for n in new_rows {
            offsets.push(offsets.last().expect("non-empty") + n as i32);
        }
        let needed: Vec<usize> = cached
            .iter()
            .zip(new_rows)
            .map(|(c, n)| (c + n).div_ceil(page_size))
            .collect();
        let max_pages = needed.iter().max().expect("sequences") + 1;
        let used: usize = needed.iter().sum();
        // Pages handed out round-robin over the sequences, then permuted: interleaved.
        let pages = used + 1;
        let poison = used as i32;
        let mut lookup = vec![poison; new_rows.len() * max_pages];
        let mut perm: Vec<usize> = (0..used).collect();
        let mut rng = Rng(page_size as u64);
        for i in (1..used).rev() {
            perm.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut next = 0usize;
        for p in 0..max_pages {
            for (b, &need) in needed.iter().enumerate() {
                if p < need {
                    lookup[b * max_pages + p] = perm[next] as i32;
                    next += 1;
                }
            }
        }
        Step {
            offsets,
            cache_lengths: cached.iter().map(|&c| c as i32).collect(),
            lookup,
            max_pages,
            pages,
            page_size,
        }
    }

    fn batch(&self) -> usize {
        self.cache_lengths.len()
    }

    fn rows(&self) -> usize {
        *self.offsets.last().expect("non-empty") as usize
    }

    fn dims(&self) -> [u64; StepDim::COUNT] {
        dims(self.rows(), self.batch(), self.max_pages, self.pages)
    }

    /// `(sequence, position)` of token row `r`.
    fn locate(&self, r: usize) -> (usize, usize) {
        let b = (0..self.batch())
            .rev()
            .find(|&b| self.offsets[b] as usize <= r && r < self.offsets[b + 1] as usize)
            .expect("row in a sequence");
        (
            b,
            self.cache_lengths[b] as usize + r - self.offsets[b] as usize,
        )
    }

    /// Index of `(layer, which, kv head, position, 0)` of sequence `b` in the cache (pages
    /// head-major).
    fn index(&self, c: &Cache, b: usize, which: usize, pos: usize, kvh: usize) -> usize {
        let page = self.lookup[b * self.max_pages + pos / self.page_size] as usize;
        let slot = pos % self.page_size;
        ((((page * c.num_layers + c.layer) * 2 + which) * c.kv_heads + kvh) * self.page_size + slot)
            * c.head_dim
    }
}

/// A cache shape.
struct Cache {
    layer: usize,
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// An f16 cache stores every f32 as `half` rounds it (the interpreter's and the library
/// kernels' reference): ties to even, subnormals, the largest finite, overflow to infinity,
/// infinities, signed zeros and NaN, bit for bit.
#[test]
fn f16_kv_store_rounds_as_half_does_at_every_edge() {
    let mut vals: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        2049.0,
        2051.0,
        65504.0,
        65519.9,
        65520.0,
        -1e10,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        6.1e-5,
        6.097e-5,
        1e-7,
        -2.98e-8,
        2.99e-8,
        1e-30,
        f32::MIN_POSITIVE,
    ];
    // And a sweep of exponents and mantissas.
    let mut x = 1.3e-9f32;
    while x < 1e6 {
        vals.extend([x, -x * 1.0001]);
        x *= 1.37;
    }
    let hd = vals.len();
    let Some(store) = Kernel::new(KernelBody::KvStore {
        planes: 2,
        layer: 0,
        num_layers: 1,
        kv_heads: 1,
        head_dim: hd as u64,
        page_size: 1,
        kv_dtype: KvDtype::F16,
    }) else {
        return;
    };
    let mut k = vals.clone();
    let mut v: Vec<f32> = vals.iter().map(|x| -x).collect();
    let mut cache = vec![0u8; 2 * hd * 2];
    let (mut lookup, mut lengths, mut offsets) = (vec![0i32], vec![0i32], vec![0i32, 1]);
    store.run(
        &ptrs![k, v, cache, lookup, lengths, offsets],
        dims(1, 1, 1, 1),
    );
    for (plane, src) in [(0, &k), (1, &v)] {
        for (i, x) in src.iter().enumerate() {
            let at = (plane * hd + i) * 2;
            let got = u16::from_le_bytes([cache[at], cache[at + 1]]);
            let want = half::f16::from_f32(*x).to_bits();
            assert_eq!(
                got,
                want,
                "{x:e} ({:#010x}): {got:#06x} against {want:#06x}",
                x.to_bits()
            );
        }
    }
}

#[test]
fn kv_store_then_attention_over_paged_cache() {
    let mut rng = Rng(10);
    for (page_size, kv_heads, heads, head_dim) in [
        (4usize, 2usize, 4usize, 8usize),
        (3, 1, 3, 32),
        (16, 2, 2, 6),
        (5, 2, 6, 13),
        (4, 2, 4, 64),
    ] {
        let step = Step::new(page_size);
        let c = Cache {
            layer: 1,
            num_layers: 2,
            kv_heads,
            head_dim,
        };
        let (t, hd) = (step.rows(), head_dim);
        let slot_floats = kv_heads * hd;
        let mut cache = vec![f32::NAN; step.pages * c.num_layers * 2 * page_size * slot_floats];
        // Positions cached before this step, in this layer and in the other one.
        for b in 0..step.batch() {
            for pos in 0..step.cache_lengths[b] as usize {
                for which in 0..2 {
                    for kvh in 0..kv_heads {
                        let i = step.index(&c, b, which, pos, kvh);
                        let other = i - c.layer * 2 * page_size * slot_floats;
                        for e in 0..hd {
                            cache[i + e] = rng.f32();
                            cache[other + e] = rng.f32();
                        }
                    }
                }
            }
        }
        let mut k_new = rng.vec(t * slot_floats);
        let mut v_new = rng.vec(t * slot_floats);
        let mut want_cache = cache.clone();
        for r in 0..t {
            let (b, pos) = step.locate(r);
            for kvh in 0..kv_heads {
                for (which, src) in [(0, &k_new), (1, &v_new)] {
                    let i = step.index(&c, b, which, pos, kvh);
                    let s = (r * kv_heads + kvh) * hd;
                    want_cache[i..i + hd].copy_from_slice(&src[s..s + hd]);
                }
            }
        }
        // Every KV dtype (q8_0 where head_dim is whole groups of 32): the cache's bytes row by
        // row; the store must write exactly what `KvDtype::encode_row` writes, and attention
        // reads back what the rows hold.
        for dtype in KvDtype::ALL {
            if dtype.check_head_dim(hd as u64).is_err() {
                continue;
            }
            let row_bytes = dtype.row_bytes(hd as u64) as usize;
            let encode = |floats: &[f32]| {
                let mut bytes = vec![0u8; floats.len() / hd * row_bytes];
                for (row, out) in floats.chunks(hd).zip(bytes.chunks_mut(row_bytes)) {
                    dtype.encode_row(row, out);
                }
                bytes
            };
            let mut cache_bytes = encode(&cache);
            let want_bytes = encode(&want_cache);
            let mut held = want_cache.clone();
            for row in held.chunks_mut(hd) {
                dtype.round_row(row);
            }
            let what =
                format!("{dtype} page_size {page_size} kv_heads {kv_heads} heads {heads} hd {hd}");
            let Some(store) = Kernel::new(KernelBody::KvStore {
                planes: 2,
                layer: c.layer as u64,
                num_layers: c.num_layers as u64,
                kv_heads: kv_heads as u64,
                head_dim: hd as u64,
                page_size: page_size as u64,
                kv_dtype: dtype,
            }) else {
                return;
            };
            let mut lookup = step.lookup.clone();
            let mut cache_lengths = step.cache_lengths.clone();
            let mut offsets = step.offsets.clone();
            store.run(
                &ptrs![k_new, v_new, cache_bytes, lookup, cache_lengths, offsets],
                step.dims(),
            );
            // NaN rows (never written) may differ in their payload bits only where unused.
            let same = cache_bytes
                .chunks(row_bytes)
                .zip(want_bytes.chunks(row_bytes))
                .zip(want_cache.chunks(hd))
                .all(|((a, b), f)| a == b || f.iter().any(|v| v.is_nan()));
            assert!(same, "kv_store {what}: cache differs from the reference");

            let scale = 1.0 / (hd as f32).sqrt();
            let mut q: Vec<f32> = rng.vec(t * heads * hd).iter().map(|v| v * 3.0).collect();
            // Full attention, and sliding windows within a page, across pages and past a
            // context.
            for window in [
                None,
                Some(1u64),
                Some(3),
                Some(page_size as u64 + 2),
                Some(1000),
            ] {
                let Some(attn) = Kernel::new(KernelBody::Attention {
                    planes: 2,
                    value_dim: hd as u64,
                    layer: c.layer as u64,
                    num_layers: c.num_layers as u64,
                    heads: heads as u64,
                    kv_heads: kv_heads as u64,
                    head_dim: hd as u64,
                    page_size: page_size as u64,
                    scale,
                    window,
                    kv_dtype: dtype,
                }) else {
                    return;
                };
                let mut out = vec![f32::NAN; t * heads * hd];
                attn.run(
                    &ptrs![q, cache_bytes, lookup, cache_lengths, offsets, out],
                    step.dims(),
                );
                let mut want = vec![0f64; out.len()];
                for r in 0..t {
                    let (b, p) = step.locate(r);
                    let lo = window.map_or(0, |w| (p + 1).saturating_sub(w as usize));
                    for h in 0..heads {
                        let kvh = h / (heads / kv_heads);
                        let qh = &q[(r * heads + h) * hd..][..hd];
                        let scores: Vec<f32> = (lo..=p)
                            .map(|j| {
                                let k = &held[step.index(&c, b, 0, j, kvh)..][..hd];
                                let dot: f64 =
                                    qh.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum();
                                (dot * f64::from(scale)) as f32
                            })
                            .collect();
                        let weights = softmax_ref(&scores);
                        for (j, w) in (lo..).zip(&weights) {
                            let v = &held[step.index(&c, b, 1, j, kvh)..][..hd];
                            for e in 0..hd {
                                want[(r * heads + h) * hd + e] += w * f64::from(v[e]);
                            }
                        }
                    }
                }
                assert_close(
                    &out,
                    &want,
                    1e-5,
                    &format!("attention {what} window {window:?}"),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Compilation properties

/// One kernel of every generated kind.
fn all_kinds() -> Vec<KernelBody> {
    let step = Rows::Step(StepDim::TotalSeqLen);
    vec![
        KernelBody::Gather {
            rows: step,
            cols: 13,
            index: GatherIndex::Tokens,
            src_dtype: DType::BF16,
            scale: 1.0,
        },
        KernelBody::Positions,
        KernelBody::RmsNorm {
            rows: step,
            cols: 37,
            width: 37,
            weight_offset: 0.0,
            eps: 1e-6,
            residual: true,
            weight_dtype: DType::F16,
        },
        KernelBody::Elementwise {
            rows: step,
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
        KernelBody::Attention {
            planes: 1,
            value_dim: 48,
            layer: 0,
            num_layers: 1,
            heads: 4,
            kv_heads: 1,
            head_dim: 64,
            page_size: 16,
            scale: 0.17,
            window: Some(9),
            kv_dtype: KvDtype::Q8_0,
        },
        KernelBody::KvStore {
            planes: 1,
            layer: 0,
            num_layers: 1,
            kv_heads: 1,
            head_dim: 64,
            page_size: 16,
            kv_dtype: KvDtype::Q8_0,
        },
        KernelBody::KvStore {
            planes: 2,
            layer: 1,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 12,
            page_size: 16,
            kv_dtype: KvDtype::Bf16,
        },
        KernelBody::Softmax {
            rows: step,
            cols: 13,
        },
        KernelBody::TopK {
            rows: step,
            cols: 13,
            k: 2,
            renormalize: true,
        },
        KernelBody::Matmul {
            rows: step,
            n: 13,
            k: 37,
            weight_dtype: DType::BF16,
            bias: true,
        },
    ]
}

#[test]
fn compilation_is_deterministic_and_relocation_free() {
    let Some(target) = target() else {
        return;
    };
    for body in all_kinds() {
        // `compile_kernel` fails on any relocation, so success means none.
        let a = compile_kernel(&body, &target).expect("compiles");
        let b = compile_kernel(&body, &target).expect("compiles");
        assert!(!a.is_empty(), "{}: empty code", body.kind());
        assert_eq!(a, b, "{}: two compilations differ", body.kind());
    }
}

#[test]
fn errors_name_the_kernel_and_the_problem() {
    let Some(target) = CpuTarget::host_baseline() else {
        return;
    };
    let moe = KernelBody::MoeExperts {
        rows: Rows::Step(StepDim::TotalSeqLen),
        hidden: 8,
        ffn: 8,
        experts: 2,
        weight_dtype: DType::F32,
    };
    let err = compile_kernel(&moe, &target).expect_err("MoE is a library kernel");
    assert!(err.to_string().starts_with("moe_experts kernel"), "{err}");

    let bad_program = KernelBody::Elementwise {
        rows: Rows::Fixed(1),
        cols: 4,
        inputs: vec![EwInput {
            dtype: DType::F32,
            broadcast: false,
        }],
        program: vec![EwInstr::Input(0), EwInstr::Add(0, 1)],
    };
    let err = compile_kernel(&bad_program, &target).expect_err("forward operand");
    assert!(
        matches!(
            err,
            CpuError::Invalid {
                kind: "elementwise",
                ..
            }
        ),
        "{err}"
    );

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
    let err = compile_kernel(&bad_gqa, &target).expect_err("heads not a multiple");
    assert!(err.to_string().contains("kv_heads"), "{err}");

    let int_weights = KernelBody::Matmul {
        rows: Rows::Fixed(1),
        n: 4,
        k: 4,
        weight_dtype: DType::I32,
        bias: false,
    };
    let err = compile_kernel(&int_weights, &target).expect_err("integer weights");
    assert!(err.to_string().contains("weight_dtype"), "{err}");

    let riscv = CpuTarget {
        arch: "riscv64".to_string(),
        ..target.clone()
    };
    let err = compile_kernel(&KernelBody::Positions, &riscv).expect_err("unsupported arch");
    assert!(matches!(err, CpuError::UnsupportedArch { .. }), "{err}");

    let mut odd = target.clone();
    odd.features.push("warp-drive".to_string());
    let err = compile_kernel(&KernelBody::Positions, &odd).expect_err("unknown feature");
    assert!(err.to_string().contains("warp-drive"), "{err}");
}
