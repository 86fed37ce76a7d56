//! Library kernels on weights in their stored format (f32, f16, bf16 and the GGUF block types),
//! without widening them in memory: matmuls and row gathers. Values are f32, accumulation is
//! f32; a block's values are dequantized into a small buffer that stays in L1 and used at once.
//!
//! - Few rows (decode): each weight row (output column) is read once for all the step's rows,
//!   block by block; output columns are split across threads, so every core streams weights.
//! - Many rows (prefill): panels of weight rows are dequantized to f32 and multiplied with
//!   `gemm`, panels split across threads.
//!
//! The generic inner loops are plain Rust, compiled three times (AVX-512, AVX2 + FMA, and the
//! baseline); the hand-vectorized ones are per instruction set (`tile` for AVX-512 register
//! tiles, `blocks` for the block formats, whose per-ISA tables, [`HandKernels`], are generated
//! from the one list of block formats). The instruction set ([`crate::isa`]) and the caller's
//! [`KernelOptions`] choose among them: [`Path`] names each way through, and a [`MatmulPlan`]
//! holds one weight's path for every row count, chosen once where an executor loads.

use maxc_schema::blocks::{f16_to_f32, with_block, Block, BlockFn};
use maxc_schema::DType;

use crate::isa::{isa, Isa};
use crate::options::{Activations, KernelOptions};
pub use blocks::HandKernels;

pub(crate) mod blocks;
pub mod cols;
#[cfg(target_arch = "x86_64")]
pub(crate) mod tile;

/// f32 lanes of the accumulators (one 512-bit or two 256-bit registers).
const LANES: usize = 16;
/// Steps up to this many rows run the row-streaming kernel; larger ones the panel kernel.
pub const STREAM_MAX_ROWS: usize = 16;
/// Weight rows per panel of the panel kernel.
const PANEL: usize = 48;
/// With register tiles, steps of at least this many rows dequantize panels for them instead of
/// streaming.
const TILE_MIN_ROWS: usize = 4;
/// Steps of at least this many rows pack their activations for the broadcast kernel: float
/// weights (whose register tiles read them as stored) ...
const PACKED_MIN_ROWS: usize = 32;
/// ... and block weights (whose tiles pay for their conversion every four or eight rows: the
/// weights bench's `tiles` and `packed` columns place the crossing).
const BLOCK_PACKED_MIN_ROWS: usize = 22;

/// Steps of at least this many rows (and [`packed_min_rows`]) widen Q4 panels under the packed
/// kernel ([`cols::packed_pays`]): it runs its rows 32 at a time, so below this a step's last
/// partial group of 32 costs more than the panels' own tiles lose.
const COLUMNS_PACKED_MIN_ROWS: usize = 64;

/// The fewest rows that run the packed kernel for `dtype` under `opts`.
fn packed_min_rows(dtype: DType, opts: &KernelOptions) -> usize {
    match opts.packed_min_rows {
        None if dtype.is_quantized() => BLOCK_PACKED_MIN_ROWS,
        None => PACKED_MIN_ROWS,
        Some(n) => n,
    }
}
/// Below this many weight bytes a matmul runs on the calling thread.
const SPLIT_BYTES: usize = 1 << 16;

/// A storage format of weight rows: how to get a block of f32 values.
trait Format: Sync {
    /// Values per block.
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Writes block `b` of `row` to `out[..ELEMS]`.
    fn load(row: &[u8], b: usize, out: &mut [f32]);
    /// Element `i` of `row`, for a row's last `cols % ELEMS` elements (scalar types only:
    /// block types' rows are whole blocks).
    fn one(row: &[u8], i: usize) -> f32;
}

struct F32s;
struct F16s;
struct Bf16s;
struct Blocks<B>(std::marker::PhantomData<B>);

impl Format for F32s {
    const ELEMS: usize = 32;
    const BYTES: usize = 128;
    #[inline(always)]
    fn load(row: &[u8], b: usize, out: &mut [f32]) {
        let src = &row[b * 128..b * 128 + 128];
        for (o, c) in out[..32].iter_mut().zip(src.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    fn one(row: &[u8], i: usize) -> f32 {
        f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
    }
}

impl Format for Bf16s {
    const ELEMS: usize = 32;
    const BYTES: usize = 64;
    #[inline(always)]
    fn load(row: &[u8], b: usize, out: &mut [f32]) {
        let src = &row[b * 64..b * 64 + 64];
        for (o, c) in out[..32].iter_mut().zip(src.chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
        }
    }
    fn one(row: &[u8], i: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16)
    }
}

impl Format for F16s {
    const ELEMS: usize = 32;
    const BYTES: usize = 64;
    #[inline(always)]
    fn load(row: &[u8], b: usize, out: &mut [f32]) {
        let src = &row[b * 64..b * 64 + 64];
        for (o, c) in out[..32].iter_mut().zip(src.chunks_exact(2)) {
            *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
        }
    }
    fn one(row: &[u8], i: usize) -> f32 {
        f16_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]]))
    }
}

impl<B: Block> Format for Blocks<B> {
    const ELEMS: usize = B::ELEMS;
    const BYTES: usize = std::mem::size_of::<B>();
    #[inline(always)]
    fn load(row: &[u8], b: usize, out: &mut [f32]) {
        let bytes = &row[b * Self::BYTES..(b + 1) * Self::BYTES];
        // SAFETY: block types are byte arrays (alignment 1, every bit pattern valid) and
        // `bytes` is exactly one block.
        let block = unsafe { &*bytes.as_ptr().cast::<B>() };
        block.dequantize(out);
    }
    fn one(_: &[u8], _: usize) -> f32 {
        unreachable!("block rows are whole blocks")
    }
}

/// `Σ a[i]·b[i]` into per-lane accumulators (no horizontal sum per block).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32], acc: &mut [f32; LANES]) {
    for (a, b) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l], acc[l]);
        }
    }
}

/// Output columns `cols` of `out[rows, n] = x[rows, k] · wᵀ` for `rows ≤ STREAM_MAX_ROWS`;
/// `out` holds columns `cols` of every row, row-major with stride `n` starting at column
/// `cols.start`.
#[inline(always)]
fn stream_cols<F: Format>(
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    let row_bytes = row_bytes::<F>(k);
    let whole = k / F::ELEMS * F::ELEMS;
    let mut buf = [0.0f32; 256];
    if rows == 1 {
        // One row (batch-1 decode): the accumulator stays in registers.
        for j in cols.clone() {
            let wrow = &w[j * row_bytes..(j + 1) * row_bytes];
            let mut acc = [0.0f32; LANES];
            for b in 0..k / F::ELEMS {
                F::load(wrow, b, &mut buf);
                dot_lanes(
                    &buf[..F::ELEMS],
                    &x[b * F::ELEMS..(b + 1) * F::ELEMS],
                    &mut acc,
                );
            }
            let mut sum: f32 = acc.iter().sum();
            for (i, &xi) in x.iter().enumerate().take(k).skip(whole) {
                sum = F::one(wrow, i).mul_add(xi, sum);
            }
            out[j - cols.start] = sum;
        }
        return;
    }
    let mut acc = [[0.0f32; LANES]; STREAM_MAX_ROWS];
    for j in cols.clone() {
        let wrow = &w[j * row_bytes..(j + 1) * row_bytes];
        for a in acc[..rows].iter_mut() {
            *a = [0.0; LANES];
        }
        for b in 0..k / F::ELEMS {
            F::load(wrow, b, &mut buf);
            let vals = &buf[..F::ELEMS];
            for (r, a) in acc[..rows].iter_mut().enumerate() {
                let xs = &x[r * k + b * F::ELEMS..r * k + (b + 1) * F::ELEMS];
                dot_lanes(vals, xs, a);
            }
        }
        for i in whole..k {
            let v = F::one(wrow, i);
            for (r, a) in acc[..rows].iter_mut().enumerate() {
                a[0] = v.mul_add(x[r * k + i], a[0]);
            }
        }
        for (r, a) in acc[..rows].iter().enumerate() {
            out[r * n + j - cols.start] = a.iter().sum();
        }
    }
}

/// Weight rows `j0..j0 + panel.len() / k` dequantized into `panel`.
#[inline(always)]
fn dequant_rows<F: Format>(w: &[u8], k: usize, j0: usize, panel: &mut [f32]) {
    let row_bytes = row_bytes::<F>(k);
    let whole = k / F::ELEMS * F::ELEMS;
    for (i, prow) in panel.chunks_exact_mut(k).enumerate() {
        let wrow = &w[(j0 + i) * row_bytes..(j0 + i + 1) * row_bytes];
        for (b, out) in prow[..whole].chunks_exact_mut(F::ELEMS).enumerate() {
            F::load(wrow, b, out);
        }
        for (t, out) in prow[whole..].iter_mut().enumerate() {
            *out = F::one(wrow, whole + t);
        }
    }
}

/// Bytes of a weight row of `k` values.
#[inline(always)]
fn row_bytes<F: Format>(k: usize) -> usize {
    k / F::ELEMS * F::BYTES + (k % F::ELEMS) * (F::BYTES / F::ELEMS)
}

macro_rules! multiversion {
    ($name:ident, $inner:ident, ($($arg:ident: $ty:ty),*)) => {
        fn $name<F: Format>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512<F: Format>($($arg: $ty),*) {
                    $inner::<F>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2<F: Format>($($arg: $ty),*) {
                    $inner::<F>($($arg),*)
                }
                match isa() {
                    // SAFETY: the CPU has the features these versions are compiled for.
                    Isa::Avx512 => return unsafe { avx512::<F>($($arg),*) },
                    Isa::Avx2 => return unsafe { avx2::<F>($($arg),*) },
                    Isa::Baseline => {}
                }
            }
            $inner::<F>($($arg),*)
        }
    };
}

multiversion!(stream_cols_mv, stream_cols, (x: &[f32], w: &[u8], out: &mut [f32], rows: usize, n: usize, k: usize, cols: std::ops::Range<usize>));
multiversion!(dequant_rows_mv, dequant_rows, (w: &[u8], k: usize, j0: usize, panel: &mut [f32]));

/// Streaming or panels ([`Path::Stream`], [`Path::HandStream`], [`Path::Panels`]) on weights of
/// format `F`.
#[allow(clippy::too_many_arguments)]
fn matmul_as<F: Format>(
    path: Path,
    hand: &HandKernels,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let inner = match path {
        Path::HandStream | Path::Stream => {
            let fast = hand.stream.filter(|_| path == Path::HandStream);
            stream_split(w.len(), out, rows, n, threads, &|o, cols| match fast {
                // SAFETY: `HandKernels::of` chose it for this CPU's features and this format.
                Some(f) => unsafe { f(x, w, o, rows, n, k, cols) },
                None => stream_cols_mv::<F>(x, w, o, rows, n, k, cols),
            });
            return;
        }
        Path::Panels { inner, .. } => inner,
        _ => unreachable!("matmul_as runs the streaming and panel paths"),
    };
    let panel_fast = match path {
        Path::Panels { hand: true, .. } => hand.panel,
        _ => None,
    };
    let panels = n.div_ceil(PANEL);
    let chunks = crate::pool::long_chunks(threads, panels);
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let xt = if inner == Inner::Packed {
        tile::pack_transposed(x, rows, k)
    } else {
        Vec::new()
    };
    crate::pool::run(chunks, &|c| {
        PANEL_SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            if scratch.len() < PANEL * k {
                scratch.resize(PANEL * k, 0.0);
            }
            for p in (c..panels).step_by(chunks) {
                let j0 = p * PANEL;
                let m = PANEL.min(n - j0);
                let panel = &mut scratch[..m * k];
                match panel_fast {
                    // SAFETY: `HandKernels::of` chose it for this CPU's features and this format.
                    Some(f) => unsafe { f(w, k, j0, panel) },
                    None => dequant_rows_mv::<F>(w, k, j0, panel),
                }
                match inner {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the packed path is chosen only where tiles run (AVX-512); `xt`
                    // packs x; as below.
                    Inner::Packed => unsafe {
                        tile::matmul_packed(&xt, rows, k, panel.as_ptr(), m, optr.get().add(j0), n)
                    },
                    #[cfg(target_arch = "x86_64")]
                    Inner::Tiles => {
                        let rows_of = tile::F32Rows {
                            ptr: panel.as_ptr(),
                            stride: k,
                        };
                        // SAFETY: the tile path is chosen only where tiles run; as below.
                        unsafe {
                            tile::matmul(x.as_ptr(), rows, k, rows_of, m, optr.get().add(j0), n)
                        };
                    }
                    // SAFETY: out[rows, n] row-major; this call writes columns j0..j0+m of
                    // every row (disjoint across panels); the panel holds weight rows
                    // j0..j0+m, read as rows 0..m of an [m, k] weight.
                    _ => unsafe {
                        crate::gemm::gemm_columns(x, panel, optr.get().add(j0), rows, n, k, 0, m)
                    },
                }
            }
        })
    });
}

/// Runs `f(o, cols)` over ranges of the `n` output columns, split across threads where the
/// weights (`bytes`) are large enough; `o` is `out` from column `cols.start` of row 0 to the
/// last row's column `cols.end`, rows `n` values apart, and `f` writes only columns `cols`.
fn stream_split(
    bytes: usize,
    out: &mut [f32],
    rows: usize,
    n: usize,
    threads: usize,
    f: &(dyn Fn(&mut [f32], std::ops::Range<usize>) + Sync),
) {
    let chunks = if bytes < SPLIT_BYTES {
        1
    } else {
        threads.max(1).min(n)
    };
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        let cols = n * c / chunks..n * (c + 1) / chunks;
        // SAFETY: `out` holds rows × n values; each call gets columns `cols` of each row,
        // which no other call's range holds. The slice starts at column `cols.start` and ends
        // after the last row's last column of the range.
        let o = unsafe {
            let len = (rows - 1) * n + cols.len();
            std::slice::from_raw_parts_mut(optr.get().add(cols.start), len)
        };
        f(o, cols)
    });
}

/// The most chunks a speculative block-tile matmul splits into (`pool::run_speculative`): a
/// chunk the helper is descheduled in costs the caller that share of the launch.
const SPECULATIVE_CHUNKS: usize = 8;
/// Weight bytes per chunk of a speculative matmul, at least: a smaller chunk costs more in
/// claims, copies and commits than the helper saves (a matmul of less than two runs on the
/// caller alone).
const SPECULATIVE_CHUNK_BYTES: usize = 64 << 10;

/// `out[rows, n] = x[rows, k] · wᵀ` with the tile kernel `f`, as a speculative job of `chunks`
/// chunks (`pool::run_speculative`).
#[allow(clippy::too_many_arguments)]
fn tiles_speculative(
    f: blocks::StreamFn,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    chunks: usize,
) {
    assert!(x.len() >= rows * k && out.len() >= rows * n);
    let spec = crate::pool::Spec {
        compute: tiles_chunk,
        inputs: [(x.as_ptr().cast(), rows * k * 4), (std::ptr::null(), 0)],
        data: [f as usize, w.as_ptr() as usize, w.len(), k],
        out: out.as_mut_ptr(),
        rows,
        n,
    };
    crate::pool::run_speculative(chunks.min(n), &spec);
}

/// A chunk of a speculative block-tile matmul: `data` holds the tile kernel, the weights'
/// address and length, and `k`; `inputs[0]` the activations.
///
/// # Safety
/// `data` as [`run`] writes it for the tile path, the weights still valid; `out` spans
/// `(rows − 1)·n + cols.len()` values.
unsafe fn tiles_chunk(
    spec: &crate::pool::Spec,
    inputs: &[&[u8]; crate::pool::SPEC_INPUTS],
    out: &mut [f32],
    cols: std::ops::Range<usize>,
) {
    // SAFETY: `data[0]` is a `StreamFn` cast to an address by `run`.
    let f = unsafe { std::mem::transmute::<usize, blocks::StreamFn>(spec.data[0]) };
    let x = inputs[0];
    // SAFETY: the activations are f32 (the job's, or the helper's 8-byte aligned copy), and
    // the weights are `data[2]` bytes at `data[1]`, alive while the job runs.
    unsafe {
        let x = std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len() / 4);
        let w = std::slice::from_raw_parts(spec.data[1] as *const u8, spec.data[2]);
        f(x, w, out, spec.rows, spec.n, spec.data[3], cols)
    }
}

thread_local! {
    /// The calling thread's quantized activations (bytes, scales, sums), kept between calls.
    #[cfg(target_arch = "x86_64")]
    static Q8_SCRATCH: std::cell::RefCell<blocks::int8::Q8Buffers> =
        std::cell::RefCell::new(Default::default());
    /// The calling thread's 16-bit activations (words, scales, sums), kept between calls.
    #[cfg(target_arch = "x86_64")]
    static I16_SCRATCH: std::cell::RefCell<blocks::int16::I16Buffers> =
        std::cell::RefCell::new(Default::default());
    /// Each thread's dequantized panel, kept between calls.
    static PANEL_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[rows, n] = x[rows, k] · wᵀ` with register tiles on weight rows as stored, output
/// columns split across threads; `rows_at(j)` gives the weight rows from row `j` on.
///
/// # Safety
/// `tile::available()`; `rows_at(j)` reads `n - j` rows of `k` values.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn tiled<L: tile::Rows>(
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    bytes: usize,
    rows_at: impl Fn(usize) -> L + Sync,
) {
    let chunks = if bytes < SPLIT_BYTES {
        1
    } else {
        threads.max(1)
    };
    let chunks = chunks.min(n.div_ceil(tile::NR));
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        let (j0, j1) = (n * c / chunks, n * (c + 1) / chunks);
        // SAFETY: as the function's contract; x holds rows·k values, out rows·n; this call
        // writes columns j0..j0 only, which no other call writes.
        unsafe {
            tile::matmul(
                x.as_ptr(),
                rows,
                k,
                rows_at(j0),
                j1 - j0,
                optr.get().add(j0),
                n,
            )
        };
    });
}

/// What multiplies the dequantized panels of [`Path::Panels`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inner {
    /// Activations packed for the broadcast register tiles (AVX-512).
    Packed,
    /// Register tiles on the activations as they are (AVX-512).
    Tiles,
    /// The f32 GEMM.
    Gemm,
}

/// How a matmul runs at one row count: the path through the kernels, chosen from the weight
/// format, the instruction set and the [`KernelOptions`] (see [`MatmulPlan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// 8-bit activations in integer dot products, row streaming (AVX2).
    Q8Stream,
    /// 16-bit activations in integer dot products, row streaming (AVX2 or AVX-512).
    I16Stream,
    /// Register tiles straight on 32-value blocks (AVX-512).
    BlockTiles,
    /// Register tiles on float weight rows as stored (AVX-512).
    FloatTiles,
    /// f32 weights as stored under the broadcast register tiles, activations packed (AVX-512).
    PackedF32,
    /// Weights repacked in panels of 32 columns, register tiles of up to twelve rows with the
    /// columns along the lanes ([`cols`]; AVX-512, plain loops elsewhere).
    Columns,
    /// Weights repacked in panels of 32 columns, each widened to f32 lines under the packed
    /// register tiles, activations packed (steps of many rows; AVX-512).
    ColumnsPacked,
    /// The f32 GEMM on f32 weights as stored.
    Gemm,
    /// Row streaming, hand-vectorized.
    HandStream,
    /// Row streaming, generic (compiled for each instruction set).
    Stream,
    /// Panels of weight rows dequantized (by a hand kernel or the generic one), then `inner`.
    Panels {
        /// Whether a hand kernel dequantizes.
        hand: bool,
        /// What multiplies them.
        inner: Inner,
    },
}

impl Path {
    /// In words, as `maxc inspect` and `maxc profile` print it.
    pub fn describe(&self) -> String {
        match self {
            Path::Q8Stream => "row streaming on 8-bit activations".into(),
            Path::I16Stream => "row streaming on 16-bit activations".into(),
            Path::BlockTiles => "register tiles on blocks".into(),
            Path::FloatTiles => "register tiles on stored rows".into(),
            Path::PackedF32 => "packed register tiles on stored rows".into(),
            Path::Columns => "register tiles on 32-column panels".into(),
            Path::ColumnsPacked => "32-column panels widened × packed register tiles".into(),
            Path::Gemm => "f32 gemm".into(),
            Path::HandStream => "hand row streaming".into(),
            Path::Stream => "generic row streaming".into(),
            Path::Panels { hand, inner } => format!(
                "{} panels × {}",
                if *hand {
                    "hand-dequantized"
                } else {
                    "dequantized"
                },
                match inner {
                    Inner::Packed => "packed register tiles",
                    Inner::Tiles => "register tiles",
                    Inner::Gemm => "f32 gemm",
                }
            ),
        }
    }
}

/// The path of a `rows`-row matmul on `dtype` weights with `hand` kernels on `isa` under
/// `opts`: the one decision both [`matmul`] and [`MatmulPlan`] read.
fn path(dtype: DType, hand: &HandKernels, opts: &KernelOptions, isa: Isa, rows: usize) -> Path {
    let on = opts.hand_kernels;
    let activations = opts.activations;
    #[cfg(target_arch = "x86_64")]
    if rows <= STREAM_MAX_ROWS && activations == Activations::Q8 && on && hand.q8.is_some() {
        return Path::Q8Stream;
    }
    #[cfg(target_arch = "x86_64")]
    if rows <= STREAM_MAX_ROWS && activations == Activations::I16 && on && hand.i16.is_some() {
        return Path::I16Stream;
    }
    #[cfg(target_arch = "x86_64")]
    let tiles = on && isa == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    let tiles = {
        let _ = isa;
        false
    };
    let packed = rows >= packed_min_rows(dtype, opts);
    if tiles {
        match dtype {
            DType::F32 if packed => return Path::PackedF32,
            // Other formats go through f32 panels (below).
            _ if packed => {}
            // Steps of a few rows on blocks: each 32 values dequantized once into registers
            // for up to eight rows.
            _ if dtype.is_quantized() && opts.block_tiles && hand.tiles.is_some() => {
                return Path::BlockTiles
            }
            DType::F32 | DType::BF16 | DType::F16 => return Path::FloatTiles,
            _ => {}
        }
    }
    if dtype == DType::F32 && rows > STREAM_MAX_ROWS {
        return Path::Gemm;
    }
    let stream_max = if tiles {
        TILE_MIN_ROWS - 1
    } else {
        STREAM_MAX_ROWS
    };
    if rows <= stream_max {
        return if on && hand.stream.is_some() {
            Path::HandStream
        } else {
            Path::Stream
        };
    }
    let inner = match (tiles, packed) {
        (true, true) => Inner::Packed,
        (true, false) => Inner::Tiles,
        (false, _) => Inner::Gemm,
    };
    Path::Panels {
        hand: on && hand.panel.is_some(),
        inner,
    }
}

/// How one matmul's weight runs at every row count on this CPU, chosen once (where an
/// executor loads its program): the hand kernels of the weight's format and the path of each
/// range of row counts.
#[derive(Clone, Debug)]
pub struct MatmulPlan {
    dtype: DType,
    k: usize,
    hand: HandKernels,
    /// `(first row count, path)`, ascending; each path runs up to the next one's first.
    paths: Vec<(usize, Path)>,
    layout: Layout,
}

impl MatmulPlan {
    /// The plan for `dtype` weights in `layout` ([`Layout::Columns`]: as [`repack`] writes
    /// them), rows of `k` values, under `opts` on this CPU.
    pub fn with_layout(dtype: DType, k: usize, layout: Layout, opts: &KernelOptions) -> Self {
        match layout {
            Layout::Rows => Self::new(dtype, k, opts),
            Layout::Columns => {
                let mut paths = vec![(1, Path::Columns)];
                if cols::tiles_available() && cols::packed_pays(dtype) {
                    let from = packed_min_rows(dtype, opts).max(COLUMNS_PACKED_MIN_ROWS);
                    if from < usize::MAX {
                        paths.push((from, Path::ColumnsPacked));
                    }
                }
                MatmulPlan {
                    dtype,
                    k,
                    hand: HandKernels::of(dtype, k, isa()),
                    paths,
                    layout,
                }
            }
        }
    }

    /// How the weights lie.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The plan for `dtype` weights of rows of `k` values under `opts` on this CPU.
    pub fn new(dtype: DType, k: usize, opts: &KernelOptions) -> Self {
        Self::for_isa(dtype, k, opts, isa())
    }

    /// The plan on `isa` (which must be this CPU's, or one it has, to run).
    pub fn for_isa(dtype: DType, k: usize, opts: &KernelOptions, isa: Isa) -> Self {
        let hand = HandKernels::of(dtype, k, isa);
        // Every test in `path` is a comparison of `rows` with one of these: between them the
        // path is the same.
        let mut starts = vec![
            1,
            TILE_MIN_ROWS,
            STREAM_MAX_ROWS + 1,
            packed_min_rows(dtype, opts),
        ];
        starts.sort_unstable();
        starts.dedup();
        let mut paths: Vec<(usize, Path)> = Vec::new();
        for r in starts.into_iter().filter(|r| (1..usize::MAX).contains(r)) {
            let p = path(dtype, &hand, opts, isa, r);
            if paths.last().map(|l| l.1) != Some(p) {
                paths.push((r, p));
            }
        }
        MatmulPlan {
            dtype,
            k,
            hand,
            paths,
            layout: Layout::Rows,
        }
    }

    /// The weights' format.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Values per weight row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The path a step of `rows` rows takes.
    pub fn path(&self, rows: usize) -> Path {
        self.paths
            .iter()
            .rev()
            .find(|(first, _)| *first <= rows)
            .map_or(self.paths[0].1, |p| p.1)
    }

    /// `(row counts, path)` for each range, as printed.
    pub fn ranges(&self) -> Vec<(String, Path)> {
        self.paths
            .iter()
            .enumerate()
            .map(|(i, &(first, p))| {
                let rows = match self.paths.get(i + 1) {
                    Some(&(next, _)) if next - 1 == first => format!("{first}"),
                    Some(&(next, _)) => format!("{first}-{}", next - 1),
                    None => format!("{first}+"),
                };
                (rows, p)
            })
            .collect()
    }

    /// The plan in words: `rows 1-3: …; 4-21: …; 22+: …`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .ranges()
            .into_iter()
            .map(|(rows, p)| format!("{rows}: {}", p.describe()))
            .collect();
        format!("rows {}", parts.join("; "))
    }

    /// `out[rows, n] = x[rows, k] · wᵀ`, `w` the bytes of an `[n, k]` weight of the plan's
    /// dtype; `threads` is how many ways to split the work.
    #[allow(clippy::too_many_arguments)]
    pub fn run(&self, x: &[f32], w: &[u8], out: &mut [f32], rows: usize, n: usize, threads: usize) {
        run(
            self.path(rows),
            &self.hand,
            x,
            w,
            self.dtype,
            out,
            rows,
            n,
            self.k,
            threads,
        )
    }
}

/// How a weight's values lie in the bytes a matmul reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// By rows, as stored: each output column's `k` values together.
    #[default]
    Rows,
    /// In panels of 32 output columns ([`cols`]): how an executor repacks 16-bit float
    /// weights for AVX-512.
    Columns,
}

/// The format and layout a weight is repacked into ([`repacking`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repacking {
    pub to: DType,
    pub layout: Layout,
}

/// The form this CPU's matmuls read a weight of `dtype` in faster, where it holds the same
/// values and an executor may repack the weight into it at load ([`repack`]):
///
/// - Q5_0 as Q8_0 by rows. Q5_0's `d·(q − 16)` is Q8_0's `d·q` with `q − 16` in a byte, so the
///   products and sums are the same. Its fifth bits cost the tile kernels more than Q8_0's
///   extra bytes where decode is compute-bound (a 1536 × 576 weight on 2 threads of this
///   AVX-512 guest: Q8_0 83.6 µs against Q5_0 111.4 at 8 rows, 33.6 against 38.7 at 1 row; on
///   its AVX2 kernels 293 against 319 and 142 against 202), at 34 bytes a block instead of 22.
/// - bf16 and f16 in panels of 32 columns ([`cols`]), with AVX-512 and hand kernels on: the
///   same bytes (up to the last panel's padding), read by tiles that reach the FMA units
///   where the row tiles cannot (batched decode and prefill).
pub fn repacking(dtype: DType, opts: &KernelOptions) -> Option<Repacking> {
    let to = if dtype == DType::Q5_0 {
        DType::Q8_0
    } else {
        dtype
    };
    let panels = cols::supported(to)
        && opts.hand_kernels
        && cols::tiles_available()
        // The integer-activation paths read blocks by rows.
        && !(to.is_quantized() && opts.activations != Activations::F32);
    match dtype {
        _ if panels => Some(Repacking {
            to,
            layout: Layout::Columns,
        }),
        DType::Q5_0 => Some(Repacking {
            to,
            layout: Layout::Rows,
        }),
        _ => None,
    }
}

/// Bytes of an `[n, k]` weight repacked by `r`.
pub fn repacked_len(r: Repacking, n: usize, k: usize) -> usize {
    match r.layout {
        Layout::Columns => cols::panels_len(r.to, n, k),
        Layout::Rows => r.to.bytes_for((n * k) as u64).unwrap_or(0) as usize,
    }
}

/// Writes the `[n, k]` weight `src` of `dtype` into `dst` as `r` says ([`repacking`]);
/// `dst` must hold [`repacked_len`] bytes. Returns whether it could (a repacking that is not
/// `dtype`'s, or lengths that do not match, write nothing).
pub fn repack(dtype: DType, r: Repacking, src: &[u8], dst: &mut [u8], n: usize, k: usize) -> bool {
    use maxc_schema::blocks::{as_blocks, BlockQ5_0, BlockQ8_0};
    match (r.layout, r.to) {
        (Layout::Columns, to) if to == dtype => return cols::repack(dtype, src, dst, n, k),
        (Layout::Columns, DType::Q8_0) if dtype == DType::Q5_0 => {
            // As Q8_0 by rows, then in panels.
            let rows = Repacking {
                to: DType::Q8_0,
                layout: Layout::Rows,
            };
            let mut q8 = vec![0u8; repacked_len(rows, n, k)];
            return repack(dtype, rows, src, &mut q8, n, k)
                && cols::repack(DType::Q8_0, &q8, dst, n, k);
        }
        (Layout::Rows, DType::Q8_0) if dtype == DType::Q5_0 => {}
        _ => return false,
    }
    let Some(from) = as_blocks::<BlockQ5_0>(src) else {
        return false;
    };
    const OUT: usize = std::mem::size_of::<BlockQ8_0>();
    if dst.len() != from.len() * OUT || from.len() * maxc_schema::blocks::QK != n * k {
        return false;
    }
    let half = maxc_schema::blocks::QK / 2;
    for (b, out) in from.iter().zip(dst.chunks_exact_mut(OUT)) {
        let qh = u32::from_le_bytes(b.qh);
        out[..2].copy_from_slice(&b.d);
        for j in 0..half {
            let lo = (b.qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
            let hi = (b.qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            out[2 + j] = (lo as i8 - 16) as u8;
            out[2 + j + half] = (hi as i8 - 16) as u8;
        }
    }
    true
}

/// `out[rows, n] = x[rows, k] · wᵀ`, `w` the bytes of an `[n, k]` weight of `dtype` (f32,
/// f16, bf16 or a block type; `k` whole blocks). `threads` is how many ways to split the work;
/// `opts` chooses among the kernels where more than one would do. (An executor makes a
/// [`MatmulPlan`] per weight at load instead.)
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    x: &[f32],
    w: &[u8],
    dtype: DType,
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    opts: &KernelOptions,
) {
    let isa = isa();
    let hand = HandKernels::of(dtype, k, isa);
    let p = path(dtype, &hand, opts, isa, rows);
    run(p, &hand, x, w, dtype, out, rows, n, k, threads)
}

/// Runs a matmul on `path`.
#[allow(clippy::too_many_arguments)]
fn run(
    path: Path,
    hand: &HandKernels,
    x: &[f32],
    w: &[u8],
    dtype: DType,
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    if rows == 0 || n == 0 {
        return;
    }
    debug_assert!(x.len() >= rows * k && out.len() >= rows * n);
    debug_assert!(
        matches!(path, Path::Columns | Path::ColumnsPacked)
            || dtype.bytes_for((n * k) as u64) == Some(w.len() as u64)
    );
    match path {
        Path::Columns => cols::matmul(dtype, x, w, out, rows, n, k, threads),
        #[cfg(target_arch = "x86_64")]
        Path::ColumnsPacked => cols::matmul_packed(dtype, x, w, out, rows, n, k, threads),
        #[cfg(target_arch = "x86_64")]
        Path::Q8Stream => {
            let f = hand
                .q8
                .expect("the q8 path is chosen only where there is a q8 kernel");
            Q8_SCRATCH.with(|scratch| {
                let buf = &mut *scratch.borrow_mut();
                // SAFETY: `HandKernels::of` gives a q8 kernel only where the CPU has AVX2,
                // FMA and F16C; block rows are whole 32-value groups.
                unsafe { blocks::int8::quantize(x, rows, k, buf) };
                let xq = buf.rows();
                // SAFETY: as above; `xq` holds the step's rows.
                stream_split(w.len(), out, rows, n, threads, &|o, cols| unsafe {
                    f(&xq, w, o, rows, n, k, cols)
                });
            });
        }
        #[cfg(target_arch = "x86_64")]
        Path::I16Stream => {
            let f = hand
                .i16
                .expect("the i16 path is chosen only where there is an i16 kernel");
            I16_SCRATCH.with(|scratch| {
                let buf = &mut *scratch.borrow_mut();
                // SAFETY: `HandKernels::of` gives an i16 kernel only where the CPU has AVX2,
                // FMA and F16C (and AVX-512 for its AVX-512 kernel); block rows are whole
                // 32-value groups.
                unsafe { blocks::int16::quantize(x, rows, k, buf) };
                let xq = buf.rows();
                // SAFETY: as above; `xq` holds the step's rows.
                stream_split(w.len(), out, rows, n, threads, &|o, cols| unsafe {
                    f(&xq, w, o, rows, n, k, cols)
                });
            });
        }
        Path::BlockTiles => {
            let f = hand
                .tiles
                .expect("the tile path is chosen only where there are tiles");
            let spec_chunks = (w.len() / SPECULATIVE_CHUNK_BYTES).min(SPECULATIVE_CHUNKS);
            if spec_chunks >= 2 && crate::pool::speculating() {
                // A caller with a helper that shares its CPU with other processes
                // (`pool::speculating`): chunks the helper takes but is descheduled in are
                // taken back, not waited for.
                tiles_speculative(f, x, w, out, rows, n, k, spec_chunks);
                return;
            }
            // SAFETY: `HandKernels::of` chose it for this CPU's features and this format.
            stream_split(w.len(), out, rows, n, threads, &|o, cols| unsafe {
                f(x, w, o, rows, n, k, cols)
            });
        }
        #[cfg(target_arch = "x86_64")]
        Path::FloatTiles => {
            use tile::{Bf16Rows, F16Rows, F32Rows};
            let b = w.len();
            // SAFETY: the path is chosen only with AVX-512 (`tile::available`); f32 weights
            // are 4-aligned and f16/bf16 weights 2-aligned (validated at load), each n·k
            // values.
            unsafe {
                match dtype {
                    DType::F32 => tiled(x, out, rows, n, k, threads, b, |j| F32Rows {
                        ptr: w.as_ptr().cast::<f32>().add(j * k),
                        stride: k,
                    }),
                    DType::BF16 => tiled(x, out, rows, n, k, threads, b, |j| Bf16Rows {
                        ptr: w.as_ptr().cast::<tile::Bf16>().add(j * k),
                        stride: k,
                    }),
                    _ => tiled(x, out, rows, n, k, threads, b, |j| F16Rows {
                        ptr: w.as_ptr().cast::<tile::F16>().add(j * k),
                        stride: k,
                    }),
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Path::PackedF32 => {
            // SAFETY: f32 weights are 4-aligned (validated) and hold n·k values.
            let wf = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<f32>(), n * k) };
            tile::packed_f32(x, wf, out, rows, n, k, threads);
        }
        Path::Gemm => {
            // SAFETY: f32 weights are 4-aligned (validated) and hold n·k values.
            let wf = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<f32>(), n * k) };
            crate::gemm::matmul(x, wf, None, out, rows, n, k);
        }
        _ => match dtype {
            DType::F32 => matmul_as::<F32s>(path, hand, x, w, out, rows, n, k, threads),
            DType::F16 => matmul_as::<F16s>(path, hand, x, w, out, rows, n, k, threads),
            DType::BF16 => matmul_as::<Bf16s>(path, hand, x, w, out, rows, n, k, threads),
            _ => {
                let call = BlockMatmul {
                    path,
                    hand,
                    x,
                    w,
                    out,
                    rows,
                    n,
                    k,
                    threads,
                };
                if with_block(dtype, call).is_none() {
                    unreachable!("validated: matmul weights are real")
                }
            }
        },
    }
}

fn gather_as<F: Format>(w: &[u8], k: usize, row: usize, out: &mut [f32]) {
    dequant_rows::<F>(w, k, row, &mut out[..k]);
}

/// Row `row` of an `[_, k]` weight of `dtype` (bytes `w`), as f32, into `out[..k]`.
pub fn gather_row(w: &[u8], dtype: DType, k: usize, row: usize, out: &mut [f32]) {
    match dtype {
        DType::F32 => gather_as::<F32s>(w, k, row, out),
        DType::F16 => gather_as::<F16s>(w, k, row, out),
        DType::BF16 => gather_as::<Bf16s>(w, k, row, out),
        _ => {
            struct Gather<'a>(&'a [u8], usize, usize, &'a mut [f32]);
            impl BlockFn for Gather<'_> {
                type Out = ();
                fn call<B: Block>(self) {
                    gather_as::<Blocks<B>>(self.0, self.1, self.2, self.3)
                }
            }
            if with_block(dtype, Gather(w, k, row, out)).is_none() {
                unreachable!("validated: gathered tables are real")
            }
        }
    }
}

/// [`matmul_as`] on a block format's rows, through [`with_block`].
struct BlockMatmul<'a> {
    path: Path,
    hand: &'a HandKernels,
    x: &'a [f32],
    w: &'a [u8],
    out: &'a mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
}

impl BlockFn for BlockMatmul<'_> {
    type Out = ();
    fn call<B: Block>(self) {
        let BlockMatmul {
            path,
            hand,
            x,
            w,
            out,
            rows,
            n,
            k,
            threads,
        } = self;
        matmul_as::<Blocks<B>>(path, hand, x, w, out, rows, n, k, threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                out[r * n + j] = (0..k).map(|i| x[r * k + i] * w[j * k + i]).sum();
            }
        }
        out
    }

    #[test]
    fn a_repacked_q5_0_weight_holds_the_same_values_as_q8_0() {
        let blocks = 37;
        let mut src: Vec<u8> = (0..blocks * 22)
            .map(|i| ((i * 131 + 7) % 251) as u8)
            .collect();
        for b in src.chunks_exact_mut(22) {
            b[..2].copy_from_slice(&half::f16::from_f32(0.03).to_le_bytes());
        }
        let mut dst = vec![0u8; blocks * 34];
        let q8 = Repacking {
            to: DType::Q8_0,
            layout: Layout::Rows,
        };
        // (Where hand kernels are off; with AVX-512's they are Q8_0 in panels.)
        let rows_only = KernelOptions {
            hand_kernels: false,
            ..Default::default()
        };
        assert_eq!(repacking(DType::Q5_0, &rows_only), Some(q8));
        assert_eq!(repacked_len(q8, 1, blocks * 32), dst.len());
        assert!(repack(DType::Q5_0, q8, &src, &mut dst, 1, blocks * 32));
        let want = maxc_schema::blocks::dequantize(DType::Q5_0, &src).unwrap();
        let got = maxc_schema::blocks::dequantize(DType::Q8_0, &dst).unwrap();
        assert_eq!(want.len(), blocks * 32);
        assert!(want
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        // Formats without a faster one, and lengths that do not match, write nothing.
        assert!(!repack(DType::Q4_0, q8, &src, &mut dst, 1, blocks * 32));
        assert!(!repack(
            DType::Q5_0,
            q8,
            &src,
            &mut dst[..34 * 36],
            1,
            blocks * 32
        ));
        assert!(!repack(DType::Q5_0, q8, &src[..21], &mut dst[..34], 1, 32));
    }

    #[test]
    fn weights_in_column_panels_match_the_reference_at_every_row_count() {
        let x: Vec<f32> = (0..70 * 512)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for dtype in [
            DType::BF16,
            DType::F16,
            DType::Q8_0,
            DType::Q5_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4K,
        ] {
            // Float k odd (the tiles' pairs of k and the last one), block k five blocks
            // (Q4_K two super-blocks).
            let k = match dtype {
                DType::Q4K => 512,
                _ if dtype.is_quantized() => 160,
                _ => 131,
            };
            // (Four panels, the last of 13 columns.)
            let n = 109;
            let src: Vec<u8> = match dtype {
                DType::BF16 | DType::F16 => (0..n * k)
                    .flat_map(|e| {
                        let v = ((e * 104_729) % 2001) as f32 / 1000.0 - 1.0;
                        match dtype {
                            DType::BF16 => ((v.to_bits() >> 16) as u16).to_le_bytes(),
                            _ => half::f16::from_f32(v).to_le_bytes(),
                        }
                    })
                    .collect(),
                _ => {
                    let elems = if dtype == DType::Q4K { 256 } else { 32 };
                    let size = dtype.bytes_for(elems as u64).unwrap() as usize;
                    let mut b: Vec<u8> = (0..n * k / elems * size)
                        .map(|i| ((i * 131 + 7) % 251) as u8)
                        .collect();
                    for (i, block) in b.chunks_exact_mut(size).enumerate() {
                        let d = half::f16::from_f32(0.002 + (i % 5) as f32 * 0.001);
                        block[..2].copy_from_slice(&d.to_le_bytes());
                        if matches!(dtype, DType::Q4_1 | DType::Q4K) {
                            let m = half::f16::from_f32((i % 3) as f32 * 0.01 - 0.012);
                            block[2..4].copy_from_slice(&m.to_le_bytes());
                        }
                    }
                    b
                }
            };
            let mut wf = vec![0f32; n * k];
            for (j, row) in wf.chunks_exact_mut(k).enumerate() {
                gather_row(&src, dtype, k, j, row);
            }
            let opts = KernelOptions::default();
            let Some(r) = repacking(dtype, &opts).filter(|r| r.layout == Layout::Columns) else {
                // (No AVX-512 here: panels are chosen nowhere; Q5_0 still repacks, by rows.)
                assert!(!cols::tiles_available());
                continue;
            };
            assert_eq!(r.layout, Layout::Columns, "{dtype:?}");
            assert_eq!(
                repacking(
                    dtype,
                    &KernelOptions {
                        hand_kernels: false,
                        ..opts
                    }
                )
                .map(|r| r.layout),
                (dtype == DType::Q5_0).then_some(Layout::Rows)
            );
            let mut panels = vec![0u8; repacked_len(r, n, k)];
            assert!(repack(dtype, r, &src, &mut panels, n, k));
            let plan = MatmulPlan::with_layout(r.to, k, Layout::Columns, &opts);
            // Steps of many rows widen Q4 panels under the packed tiles (the 64- and 70-row
            // steps below).
            assert_eq!(
                plan.describe(),
                if cols::packed_pays(dtype) {
                    "rows 1-63: register tiles on 32-column panels; 64+: 32-column panels \
                     widened × packed register tiles"
                } else {
                    "rows 1+: register tiles on 32-column panels"
                }
            );
            for rows in (1..=17).chain([24, 40, 64, 70]) {
                let want = reference(&x, &wf, rows, n, k);
                for threads in [1, 3] {
                    let mut got = vec![f32::NAN; rows * n];
                    plan.run(&x, &panels, &mut got, rows, n, threads);
                    for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                        let (r, j) = (e / n, e % n);
                        let bound = 1e-5
                            * (0..k)
                                .map(|i| (x[r * k + i] * wf[j * k + i]).abs())
                                .sum::<f32>()
                            + 1e-6;
                        assert!(
                            (g - w).abs() <= bound,
                            "{dtype:?} rows {rows}, threads {threads}, output {e}: {g} against {w}"
                        );
                    }
                }
            }
            // Panels are of the format the weight is read in.
            let wrong = Repacking {
                to: DType::F32,
                ..r
            };
            assert!(!repack(dtype, wrong, &src, &mut panels, n, k));
        }
    }

    #[test]
    fn a_speculative_tile_matmul_gives_the_same_bits_as_the_split_one() {
        let (n, k) = (70, 256);
        let x: Vec<f32> = (0..8 * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut tried = 0;
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let Some(f) = HandKernels::of(dtype, k, isa()).tiles else {
                continue;
            };
            tried += 1;
            let (be, bb) = dtype.block();
            let mut w: Vec<u8> = (0..n * k / be * bb)
                .map(|i| ((i * 131) % 251) as u8)
                .collect();
            // Small finite f16 scales wherever a block may keep one.
            let small = half::f16::from_f32(0.01).to_le_bytes();
            for blk in w.chunks_exact_mut(bb) {
                match dtype {
                    DType::Q6K => blk[bb - 2..].copy_from_slice(&small),
                    _ => {
                        blk[..2].copy_from_slice(&small);
                        blk[2..4].copy_from_slice(&small);
                    }
                }
            }
            for rows in [1, 3, 8] {
                let mut want = vec![0.0f32; rows * n];
                // SAFETY: the tiles this CPU has, on whole blocks.
                stream_split(w.len(), &mut want, rows, n, 1, &|o, cols| unsafe {
                    f(&x, &w, o, rows, n, k, cols)
                });
                for chunks in [2, 5, 8] {
                    let mut got = vec![f32::NAN; rows * n];
                    tiles_speculative(f, &x, &w, &mut got, rows, n, k, chunks);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype:?}, {rows} rows, {chunks} chunks");
                }
            }
        }
        if tried == 0 {
            eprintln!("skipped: this CPU has no block tiles");
        }
    }

    #[test]
    fn every_format_and_row_count_matches_the_dequantized_reference() {
        // k: 24 groups of 32 (the block tiles convert heads in runs of 16: a whole run and
        // part of one), three K super-blocks.
        let (n, k) = (70, 768);
        let x: Vec<f32> = (0..40 * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for dtype in DType::ALL.into_iter().filter(|d| d.is_real()) {
            // Bytes of any pattern are valid blocks; keep scales small and finite.
            let (be, bb) = dtype.block();
            let nbytes = n * k / be * bb;
            let mut w: Vec<u8> = (0..nbytes).map(|i| ((i * 131) % 251) as u8).collect();
            if dtype.is_float() {
                let vals: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 37) % 97) as f32 / 97.0 - 0.5)
                    .collect();
                w = match dtype {
                    DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    DType::F16 => vals
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => vals
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                };
            } else {
                // f16 scales at the block types' offsets would be arbitrary: overwrite every
                // f16-sized field that may be a scale with a small value by dequantizing and
                // checking finiteness instead.
                for blk in w.chunks_exact_mut(bb) {
                    let small = half::f16::from_f32(0.01).to_le_bytes();
                    match dtype {
                        DType::Q6K => blk[bb - 2..].copy_from_slice(&small),
                        DType::Q4K | DType::Q5K | DType::Q4_1 | DType::Q5_1 => {
                            blk[..2].copy_from_slice(&small);
                            blk[2..4].copy_from_slice(&small);
                        }
                        _ => blk[..2].copy_from_slice(&small),
                    }
                }
            }
            let wf: Vec<f32> = if dtype.is_quantized() {
                maxc_schema::blocks::dequantize(dtype, &w).unwrap()
            } else {
                let mut v = vec![0.0; n * k];
                for j in 0..n {
                    gather_row(&w, dtype, k, j, &mut v[j * k..]);
                }
                v
            };
            let ax: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            let aw: Vec<f32> = wf.iter().map(|v| v.abs()).collect();
            for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 21, 22, 27, 40] {
                let want = reference(&x, &wf, rows, n, k);
                // 16-bit activations move each by at most 1/65534 of its group's largest:
                // within 1e-4 of Σ|w·x| (as `blocks::int16`'s tests bound them); the other
                // paths compute in f32 throughout, in another order than the reference:
                // within 1e-5 of Σ|w·x| (a block's scale or value wrong is off by a few
                // hundredths of it).
                let size = reference(&ax, &aw, rows, n, k);
                let check = |out: &[f32], path: Path, what: &str| {
                    let bound = if path == Path::I16Stream { 1e-4 } else { 1e-5 };
                    for (i, ((a, b), s)) in out.iter().zip(&want).zip(&size).enumerate() {
                        assert!(
                            (a - b).abs() <= bound * s + 1e-6,
                            "{what} at {i}: {a} vs {b} (Σ|w·x| {s})"
                        );
                    }
                };
                let default = MatmulPlan::new(dtype, k, &KernelOptions::default()).path(rows);
                for threads in [1, 2] {
                    let mut out = vec![f32::NAN; rows * n];
                    matmul(
                        &x,
                        &w,
                        dtype,
                        &mut out,
                        rows,
                        n,
                        k,
                        threads,
                        &KernelOptions::default(),
                    );
                    check(
                        &out,
                        default,
                        &format!("{dtype} rows {rows} threads {threads}"),
                    );
                }
                // Every path the options and the host's instruction sets choose (but 8-bit
                // activations, which round: `blocks::int8`'s tests bound them).
                for isa in host_isas() {
                    for opts in option_variants()
                        .into_iter()
                        .filter(|o| o.activations != Activations::Q8)
                    {
                        let plan = MatmulPlan::for_isa(dtype, k, &opts, isa);
                        let mut out = vec![f32::NAN; rows * n];
                        plan.run(&x, &w, &mut out, rows, n, 2);
                        let what = format!("{dtype} {isa:?} {opts:?} rows {rows} ({plan:?})");
                        check(&out, plan.path(rows), &what);
                    }
                }
            }
        }
    }

    fn host_isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if isa() == Isa::Avx512 {
                isas.push(Isa::Avx512);
            }
            if matches!(isa(), Isa::Avx512 | Isa::Avx2) {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    fn option_variants() -> Vec<KernelOptions> {
        let d = KernelOptions::default();
        vec![
            d,
            KernelOptions {
                activations: Activations::Q8,
                ..d
            },
            KernelOptions {
                activations: Activations::F32,
                ..d
            },
            KernelOptions {
                activations: Activations::I16,
                ..d
            },
            KernelOptions {
                hand_kernels: false,
                ..d
            },
            KernelOptions {
                block_tiles: false,
                ..d
            },
            KernelOptions {
                packed_min_rows: Some(usize::MAX),
                ..d
            },
            KernelOptions {
                packed_min_rows: Some(6),
                ..d
            },
        ]
    }

    #[test]
    fn a_plan_takes_the_path_the_decision_gives_at_every_row_count() {
        for dtype in DType::ALL.into_iter().filter(|d| d.is_real()) {
            #[cfg(target_arch = "x86_64")]
            let isas = [Isa::Baseline, Isa::Avx2, Isa::Avx512];
            #[cfg(not(target_arch = "x86_64"))]
            let isas = [Isa::Baseline];
            for isa in isas {
                for opts in option_variants() {
                    let plan = MatmulPlan::for_isa(dtype, 512, &opts, isa);
                    let hand = HandKernels::of(dtype, 512, isa);
                    for rows in 1..=80 {
                        assert_eq!(
                            plan.path(rows),
                            path(dtype, &hand, &opts, isa, rows),
                            "{dtype} {isa:?} {opts:?} rows {rows}: {}",
                            plan.describe()
                        );
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        let q4k = MatmulPlan::for_isa(DType::Q4K, 512, &KernelOptions::default(), Isa::Avx2);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            q4k.describe(),
            "rows 1-16: hand row streaming; 17+: hand-dequantized panels × f32 gemm"
        );
    }

    #[test]
    fn float_rows_that_are_not_whole_blocks_have_their_tail_counted() {
        let (n, k) = (5, 100);
        let x: Vec<f32> = (0..20 * k).map(|i| (i % 13) as f32 - 6.0).collect();
        let wf: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.25).collect();
        let w: Vec<u8> = wf
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        for rows in [1, 20] {
            let mut out = vec![0.0; rows * n];
            matmul(
                &x,
                &w,
                DType::BF16,
                &mut out,
                rows,
                n,
                k,
                2,
                &KernelOptions::default(),
            );
            assert_eq!(out, reference(&x, &wf, rows, n, k));
        }
    }
}
