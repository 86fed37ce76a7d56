//! Weights in panels of 32 output columns, and the register tiles that read them: bf16, f16,
//! Q8_0, Q4_0 and Q4_1 (and Q5_0, whose values are Q8_0's).
//!
//! A weight `[n, k]` is stored by rows: each output column's `k` values lie together, so the
//! register tiles of [`super::tile`] and the block tiles take dot products along `k` and sum
//! each accumulator's lanes at the end. At eight activation rows those tiles run at about half
//! the FMA peak even on f32 weights in L1 (their loads, shuffles and sums per FMA). Repacked
//! (the executor's `Repack`, behind the first step) into *panels*, the same values lie the other
//! way round: panel `p` holds, for each `i` in `0..k`, the 32 values `w[32p + c][i]` (`c < 32`)
//! in one *line*, the last panel padded with zeros. A tile of `R` activation rows by one panel
//! keeps two accumulators a row (output columns along the lanes): per `i` it loads one line,
//! widens it into two 16-lane f32 vectors, broadcasts each row's `x[r][i]` from memory, and
//! issues two FMAs a row, sixteen at eight rows against two to six other instructions; the
//! accumulators are the outputs, with no sums across lanes. Steps of up to eight rows run one
//! tile; steps of more run tiles of twelve rows over a panel, which stays in L1/L2.
//!
//! Lines by format:
//! - bf16: 64 bytes; lane `l` (a 32-bit word) holds column `l` in its low half and column
//!   `16 + l` in its high half, so `word << 16` and `word & 0xFFFF_0000` are the two vectors.
//! - f16: 64 bytes, columns `0..32` in order, each half converted by `vcvtph2ps`.
//! - Q8_0: 32 bytes, columns in order, sign-extended, converted and multiplied by the columns'
//!   scales. A panel is blocks of 32 values of `i`: the 32 columns' f16 scales (64 bytes), then
//!   the block's 32 lines (8.5 bits a value, as stored).
//! - Q4_0, Q4_1: blocks of 32 values of `i`: the columns' f16 scales (and Q4_1's offsets), then
//!   16 lines of 32 bytes, byte `c` of line `j` column `c`'s values at `2j` (low nibble) and
//!   `2j + 1` (high). Steps of up to four rows scale once per block (`d Σ x q + m Σ x`), more
//!   rows widen each value to `d q + m` first ([`tile_q4`]).
//!
//! The values and their products are the stored ones; sums run along `k` in order, so results
//! match the row kernels' up to f32 reassociation (not bit for bit: the executor reads panels
//! from its second step on, whatever the repack's pace).

use maxc_schema::DType;

/// Output columns per panel.
pub const COLS: usize = 32;
/// Most activation rows per tile in steps of up to this many rows (batched decode) ...
const MAX_ROWS: usize = 8;
/// ... and in steps of more (prefill): 24 accumulators, each line's widening shared by more
/// FMAs.
const TALL_ROWS: usize = 12;
/// How far ahead (in lines of the format, 3-6 KB) a tile prefetches its panel: the hardware's
/// streams alone left a core's eight-row bf16 tile at 128-136 GFLOP/s on the Intel guest against
/// 152-159 with prefetches (a stand-alone measurement of 1536 × 576 bf16 weights from L3).
const AHEAD: usize = 96;

/// How a panel of a format lies: blocks of `block` values of `i`, each a header of `head`
/// bytes, then `block` lines of `line` bytes.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    block: usize,
    head: usize,
    line: usize,
}

impl Geometry {
    /// `dtype`'s, for rows of `k` values (`None`: no panels, or `k` not whole blocks).
    fn of(dtype: DType, k: usize) -> Option<Self> {
        let g = match dtype {
            DType::BF16 | DType::F16 => Geometry {
                block: k.max(1),
                head: 0,
                line: 64,
            },
            DType::Q8_0 => Geometry {
                block: maxc_schema::blocks::QK,
                head: 2 * COLS,
                line: COLS,
            },
            // Lines of two values of `i`: 32 bytes a pair, half a byte a value.
            DType::Q4_0 | DType::Q4_1 => Geometry {
                block: maxc_schema::blocks::QK,
                head: if dtype == DType::Q4_0 { 2 } else { 4 } * COLS,
                line: COLS / 2,
            },
            // Super-blocks of 256: the columns' f16 scales and offset scales, then each
            // 32-value group's 6-bit scales and offsets as bytes ([`Q4K_HEAD`]).
            DType::Q4K => Geometry {
                block: maxc_schema::blocks::QK_K,
                head: Q4K_HEAD,
                line: COLS / 2,
            },
            _ => return None,
        };
        k.is_multiple_of(g.block).then_some(g)
    }

    /// Bytes of a block.
    fn block_bytes(self) -> usize {
        self.head + self.block * self.line
    }
}

/// Q4_K's 32-value groups per super-block, and the header of a panel's super-block: the 32
/// columns' f16 `d` and `dmin` (64 bytes each), then per group the columns' scales (32 bytes)
/// and, after all eight, per group their offsets (32 bytes).
const Q4K_GROUPS: usize = maxc_schema::blocks::QK_K / maxc_schema::blocks::QK;
const Q4K_HEAD: usize = 4 * COLS + 2 * Q4K_GROUPS * COLS;

/// Whether `dtype` weights can be read in panels.
pub fn supported(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::BF16 | DType::F16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4K
    )
}

/// Bytes of an `[n, k]` weight of `dtype` in panels (0 where it has none).
pub fn panels_len(dtype: DType, n: usize, k: usize) -> usize {
    Geometry::of(dtype, k).map_or(0, |g| n.div_ceil(COLS) * (k / g.block) * g.block_bytes())
}

/// Writes the `[n, k]` weight `src` of `dtype` (by rows, as stored) into `dst` in panels.
/// Returns whether it could: a format without panels, or lengths that do not match
/// ([`panels_len`]), write nothing.
pub fn repack(dtype: DType, src: &[u8], dst: &mut [u8], n: usize, k: usize) -> bool {
    let Some(g) = Geometry::of(dtype, k) else {
        return false;
    };
    let row = dtype.bytes_for(k as u64).unwrap_or(0) as usize;
    if src.len() != n * row || dst.len() != panels_len(dtype, n, k) || n == 0 {
        return false;
    }
    let panel_bytes = (k / g.block) * g.block_bytes();
    let panels = n.div_ceil(COLS);
    // The last panel's columns past `n` are zeros (their scales too).
    let last = &mut dst[(panels - 1) * panel_bytes..];
    if !n.is_multiple_of(COLS) {
        last.fill(0);
    }
    // Column by column: each source row is read in order; its values go one line apart,
    // into a panel that stays in L1/L2 while its 32 columns are written (0.6-1.2 ns a value on
    // the Intel guest: SmolLM2's 269 MB of bf16 in 0.13-0.15 s with its page faults).
    for p in 0..panels {
        for c in 0..COLS.min(n - p * COLS) {
            // SAFETY: the lengths were checked above: row `32p + c` of `row` bytes lies in
            // `src`, and panel `p`, of `panel_bytes` bytes, in `dst`; every offset below lies
            // in its row or panel (blocks of `g` within the panel, `slot < 64`).
            unsafe {
                let from = src.as_ptr().add((p * COLS + c) * row);
                let to = dst.as_mut_ptr().add(p * panel_bytes);
                match dtype {
                    DType::Q4_0 | DType::Q4_1 | DType::Q4K => {
                        // Stored blocks: the f16 scale (Q4_1's offset, Q4_K's dmin after it;
                        // Q4_K's 12 bytes of 6-bit group scales and offsets next), then the
                        // values in runs of `2 half` (16 bytes, Q4_K 32): value `e` of a run
                        // the low nibble of its byte `e`, from `half` on the high nibble of
                        // byte `e - half`. In the panel byte `c` of pair `j` holds `2j` low
                        // and `2j + 1` high.
                        let stored = row / (k / g.block);
                        let (heads, half, values) = match dtype {
                            DType::Q4_0 => (1, 16, 2),
                            DType::Q4_1 => (2, 16, 4),
                            _ => (2, 32, 16),
                        };
                        for b in 0..k / g.block {
                            let (from, to) = (from.add(b * stored), to.add(b * g.block_bytes()));
                            for h in 0..heads {
                                std::ptr::copy_nonoverlapping(
                                    from.add(2 * h),
                                    to.add(2 * COLS * h + 2 * c),
                                    2,
                                );
                            }
                            if dtype == DType::Q4K {
                                let scales = &*from.add(4).cast::<[u8; 12]>();
                                for grp in 0..Q4K_GROUPS {
                                    let (sc, m) = maxc_schema::blocks::scale_min_k4(grp, scales);
                                    *to.add(4 * COLS + grp * COLS + c) = sc;
                                    *to.add(4 * COLS + (Q4K_GROUPS + grp) * COLS + c) = m;
                                }
                            }
                            let qs = from.add(values);
                            let q = |e: usize| {
                                let byte = *qs.add(e / (2 * half) * half + e % half);
                                if e % (2 * half) < half {
                                    byte & 0xF
                                } else {
                                    byte >> 4
                                }
                            };
                            for j in 0..g.block / 2 {
                                *to.add(g.head + j * COLS + c) = q(2 * j) | (q(2 * j + 1) << 4);
                            }
                        }
                    }
                    DType::Q8_0 => {
                        // Stored blocks: the f16 scale, then 32 values.
                        let stored = row / (k / g.block);
                        for b in 0..k / g.block {
                            let (from, to) = (from.add(b * stored), to.add(b * g.block_bytes()));
                            std::ptr::copy_nonoverlapping(from, to.add(2 * c), 2);
                            for i in 0..g.block {
                                *to.add(g.head + i * g.line + c) = *from.add(2 + i);
                            }
                        }
                    }
                    _ => {
                        let to = to.add(slot(dtype, c));
                        for i in 0..k {
                            std::ptr::copy_nonoverlapping(from.add(2 * i), to.add(i * g.line), 2);
                        }
                    }
                }
            }
        }
    }
    true
}

/// The byte offset of column `c` (`< 32`) in a line of a 16-bit float `dtype`.
fn slot(dtype: DType, c: usize) -> usize {
    match dtype {
        // Word `c % 16`, low half for columns 0..16, high half for 16..32.
        DType::BF16 => (c % 16) * 4 + (c / 16) * 2,
        _ => c * 2,
    }
}

/// The value at `i` of column `c` (`< 32`) of a panel of `dtype` (rows of `k` values), as f32.
fn value(dtype: DType, panel: &[u8], k: usize, i: usize, c: usize) -> f32 {
    let Some(g) = Geometry::of(dtype, k) else {
        return 0.0;
    };
    let block = &panel[i / g.block * g.block_bytes()..][..g.block_bytes()];
    let f16 =
        |at: usize| maxc_schema::blocks::f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]));
    if matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q4K) {
        let byte = block[g.head + (i % g.block / 2) * COLS + c];
        let q = if i.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        } as f32;
        return match dtype {
            DType::Q4_0 => f16(2 * c) * (q - 8.0),
            DType::Q4_1 => f16(2 * c) * q + f16(2 * COLS + 2 * c),
            _ => {
                // As the stored blocks dequantize: (d·sc)·q − dmin·m.
                let grp = i % g.block / maxc_schema::blocks::QK;
                let sc = block[4 * COLS + grp * COLS + c] as f32;
                let m = block[4 * COLS + (Q4K_GROUPS + grp) * COLS + c] as f32;
                f16(2 * c) * sc * q - f16(2 * COLS + 2 * c) * m
            }
        };
    }
    let line = &block[g.head + i % g.block * g.line..][..g.line];
    match dtype {
        DType::Q8_0 => f16(2 * c) * line[c] as i8 as f32,
        DType::BF16 => {
            let at = slot(dtype, c);
            f32::from_bits((u16::from_le_bytes([line[at], line[at + 1]]) as u32) << 16)
        }
        _ => {
            let at = slot(dtype, c);
            maxc_schema::blocks::f16_to_f32(u16::from_le_bytes([line[at], line[at + 1]]))
        }
    }
}

/// Row `row` (an output column) of an `[n, k]` weight of `dtype` in panels, as f32, into
/// `out[..k]` (an embedding table that is also the output head's weight).
pub fn gather_row(dtype: DType, w: &[u8], k: usize, row: usize, out: &mut [f32]) {
    let bytes = panels_len(dtype, COLS, k);
    let panel = &w[row / COLS * bytes..][..bytes];
    for (i, o) in out[..k].iter_mut().enumerate() {
        *o = value(dtype, panel, k, i, row % COLS);
    }
}

/// `out[r * n + j] = Σ_i x[r * k + i] · w[j][i]` for panels `panels` of the weight `w` of
/// `dtype` in panels (`j` in their columns below `n`), all `rows` rows: the plain loops, for
/// CPUs without AVX-512.
#[allow(clippy::too_many_arguments)]
fn matmul_generic(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    panels: std::ops::Range<usize>,
) {
    let bytes = panels_len(dtype, COLS, k);
    let mut acc = [0f32; COLS];
    for p in panels {
        let panel = &w[p * bytes..(p + 1) * bytes];
        let cols = COLS.min(n - p * COLS);
        for r in 0..rows {
            acc.fill(0.0);
            for i in 0..k {
                let xv = x[r * k + i];
                for (c, a) in acc[..cols].iter_mut().enumerate() {
                    *a += xv * value(dtype, panel, k, i, c);
                }
            }
            out[r * n + p * COLS..r * n + p * COLS + cols].copy_from_slice(&acc[..cols]);
        }
    }
}

/// `out[rows, n] = x[rows, k] · wᵀ`, `w` an `[n, k]` weight of `dtype` in panels
/// ([`panels_len`] bytes), panels split across `threads` where the weight is large enough.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let bytes = panels_len(dtype, n, k);
    assert!(bytes > 0, "{dtype:?} weights of rows of {k} have no panels");
    assert!(x.len() >= rows * k && out.len() >= rows * n && w.len() >= bytes);
    let (panels, panel) = (n.div_ceil(COLS), panels_len(dtype, COLS, k));
    let chunks = if w.len() < super::SPLIT_BYTES {
        1
    } else {
        threads.clamp(1, panels)
    };
    let avx512 = tiles_available();
    #[cfg(target_arch = "x86_64")]
    if avx512 && matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q4K) {
        // SAFETY: AVX-512F/BW/VL/DQ and F16C (checked); lengths checked above.
        unsafe { q4_panels(dtype, x, w, out, rows, n, k, chunks) };
        return;
    }
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        let range = panels * c / chunks..panels * (c + 1) / chunks;
        // SAFETY: `out` holds rows × n values; each call writes only the columns of its
        // panels, which no other call's range holds.
        let out = unsafe { std::slice::from_raw_parts_mut(optr.get(), rows * n) };
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512F/BW/VL/DQ and F16C (checked); lengths checked above.
            unsafe {
                match dtype {
                    DType::BF16 => panels_avx512::<Bf16>(x, w, out, rows, n, k, panel, range),
                    DType::Q8_0 => panels_avx512::<Q8>(x, w, out, rows, n, k, panel, range),
                    _ => panels_avx512::<F16>(x, w, out, rows, n, k, panel, range),
                }
            }
            return;
        }
        let _ = avx512;
        matmul_generic(dtype, x, w, out, rows, n, k, range);
    });
}

/// Whether steps of many rows run [`matmul_packed`] on `dtype`'s panels: the Q4 formats, whose
/// own tiles widen each value for every twelve rows. (Weights bench, 2 threads, the Intel
/// guest, panels against the stored rows at 128 rows: Q4_1 and Q4_K 0.92-0.93x in their own
/// tiles, 0.97-1.00x packed, at `[2048, 2048]`; bf16, f16 and Q8_0 1.07-1.22x in their own
/// tiles, 1.01-1.14x packed.)
pub fn packed_pays(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q4K)
}

/// [`matmul`] for steps of many rows (prefill) on Q4 panels ([`packed_pays`]): the activations
/// packed once ([`super::tile::pack_transposed`]), then each panel widened to f32 lines of its
/// 32 columns (`k` of them, in L2) under the packed register tiles
/// ([`super::tile::matmul_packed_lines`]), which run near the FMA peak
/// where the panels' own tiles widen each value for every twelve rows. AVX-512 only (where
/// [`tiles_available`]).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_packed(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let bytes = panels_len(dtype, COLS, k);
    assert!(
        bytes > 0 && packed_pays(dtype),
        "{dtype:?} weights of rows of {k} have no packed path"
    );
    assert!(tiles_available(), "the packed path runs where the tiles do");
    let panels = n.div_ceil(COLS);
    assert!(x.len() >= rows * k && out.len() >= rows * n && w.len() >= panels * bytes);
    let xt = super::tile::pack_transposed(x, rows, k);
    let chunks = crate::pool::long_chunks(threads, panels);
    let optr = crate::pool::OutPtr(out.as_mut_ptr());
    crate::pool::run(chunks, &|c| {
        LINES.with(|lines| {
            let mut lines = lines.borrow_mut();
            if lines.len() < k * COLS {
                lines.resize(k * COLS, 0.0);
            }
            for p in (c..panels).step_by(chunks) {
                let wp = w[p * bytes..(p + 1) * bytes].as_ptr();
                let (to, cols) = (lines.as_mut_ptr(), COLS.min(n - p * COLS));
                // SAFETY: AVX-512 (asserted); panel p lies in w; `lines` holds k lines of 32;
                // `xt` packs x; this call writes columns 32p .. 32p + cols of every row, which
                // no other panel holds.
                unsafe {
                    match dtype {
                        DType::Q4_0 => widen_q4_lines::<Q4_0>(wp, k, to),
                        DType::Q4_1 => widen_q4_lines::<Q4_1>(wp, k, to),
                        _ => widen_q4_lines::<Q4_K>(wp, k, to),
                    }
                    let out = optr.get().add(p * COLS);
                    super::tile::matmul_packed_lines(&xt, rows, k, to, cols, out, n);
                }
            }
        });
    });
}

thread_local! {
    /// The calling thread's panels widened to f32 lines ([`matmul_packed`]).
    #[cfg(target_arch = "x86_64")]
    static LINES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The Q4 panel at `w` (rows of `k` values; `KIND` as [`tile_q4`]'s) as `k` lines of its 32
/// columns' f32 values at `out`.
///
/// # Safety
/// AVX-512F/BW and F16C; `w` a panel, `out` room for `k` lines of 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn widen_q4_lines<const KIND: u8>(w: *const u8, k: usize, out: *mut f32) {
    let ld = COLS;
    // SAFETY: as the function says: `k / 32` groups of the panel, `k` lines of `out`.
    unsafe {
        let low = _mm512_set1_epi32(0xF);
        let q = |v: __m512i| _mm512_cvtepi32_ps(v);
        for b in 0..k / maxc_schema::blocks::QK {
            let (lines, dl, dh, ml, mh) = q4_group::<KIND>(w, b);
            for j in 0..16 {
                let pair = lines.add(j * COLS);
                let v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.cast()));
                let v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.add(16).cast()));
                // Columns 0..16 and 16..32 at `2j` (low nibbles), then at `2j + 1`.
                let (c0, c16) = (_mm512_and_si512(v0, low), _mm512_and_si512(v1, low));
                let o = out.add((b * maxc_schema::blocks::QK + 2 * j) * ld);
                _mm512_storeu_ps(o, _mm512_fmadd_ps(q(c0), dl, ml));
                _mm512_storeu_ps(o.add(16), _mm512_fmadd_ps(q(c16), dh, mh));
                let (c0, c16) = (_mm512_srli_epi32::<4>(v0), _mm512_srli_epi32::<4>(v1));
                _mm512_storeu_ps(o.add(ld), _mm512_fmadd_ps(q(c0), dl, ml));
                _mm512_storeu_ps(o.add(ld + 16), _mm512_fmadd_ps(q(c16), dh, mh));
            }
        }
    }
}

/// Whether this CPU runs the AVX-512 tiles (elsewhere panels run plain loops).
pub fn tiles_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::isa::isa() == crate::isa::Isa::Avx512 && super::tile::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// How a block of a panel's lines widens into f32 vectors (columns `0..16`, `16..32`).
#[cfg(target_arch = "x86_64")]
trait Widen {
    /// Values of `i` per block (0: the whole row), header bytes, bytes per line.
    const BLOCK: usize;
    const HEAD: usize;
    const LINE: usize;
    /// What a block's header gives its lines (the columns' scales).
    type Head: Copy;
    /// # Safety
    /// AVX-512F/BW and F16C; `HEAD` readable bytes at `p`.
    unsafe fn head(p: *const u8) -> Self::Head;
    /// # Safety
    /// AVX-512F/BW and F16C; `LINE` readable bytes at `p`.
    unsafe fn widen(p: *const u8, head: Self::Head) -> (__m512, __m512);
}

#[cfg(target_arch = "x86_64")]
struct Bf16;
#[cfg(target_arch = "x86_64")]
struct F16;
#[cfg(target_arch = "x86_64")]
struct Q8;

#[cfg(target_arch = "x86_64")]
impl Widen for Bf16 {
    const BLOCK: usize = 0;
    const HEAD: usize = 0;
    const LINE: usize = 64;
    type Head = ();
    #[inline(always)]
    unsafe fn head(_: *const u8) {}
    #[inline(always)]
    unsafe fn widen(p: *const u8, _: ()) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe {
            let v = _mm512_loadu_si512(p.cast());
            let lo = _mm512_slli_epi32::<16>(v);
            let hi = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi))
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Widen for F16 {
    const BLOCK: usize = 0;
    const HEAD: usize = 0;
    const LINE: usize = 64;
    type Head = ();
    #[inline(always)]
    unsafe fn head(_: *const u8) {}
    #[inline(always)]
    unsafe fn widen(p: *const u8, _: ()) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe { f16x32(p) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Widen for Q8 {
    const BLOCK: usize = maxc_schema::blocks::QK;
    const HEAD: usize = 2 * COLS;
    const LINE: usize = COLS;
    type Head = (__m512, __m512);
    #[inline(always)]
    unsafe fn head(p: *const u8) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe { f16x32(p) }
    }
    #[inline(always)]
    unsafe fn widen(p: *const u8, (dl, dh): (__m512, __m512)) -> (__m512, __m512) {
        // SAFETY: as the trait says.
        unsafe {
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16).cast())));
            (_mm512_mul_ps(lo, dl), _mm512_mul_ps(hi, dh))
        }
    }
}

/// The 32 f16 values at `p` (a panel's columns) as f32: columns `0..16`, `16..32`.
///
/// # Safety
/// AVX-512F and F16C; 64 readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16x32(p: *const u8) -> (__m512, __m512) {
    // SAFETY: as the function says.
    unsafe {
        (
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32).cast())),
        )
    }
}

/// One tile: `R` rows of `x` (rows `k` apart) by the panel at `w`; writes the `cols` (≤ 32)
/// first columns of each row of `out` (rows `ldo` apart).
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; `x` holds `R` rows of `k` values, `w` a panel of `k` lines,
/// `out` `R` rows with `cols` columns from it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile<W: Widen, const R: usize>(
    x: *const f32,
    k: usize,
    w: *const u8,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let block = if W::BLOCK == 0 { k } else { W::BLOCK };
    // SAFETY (the loads): `k / block` blocks of the panel, `R` rows of `x`; prefetches never
    // fault.
    unsafe {
        let step = |acc: &mut [[__m512; 2]; R], line: *const u8, head: W::Head, i: usize| {
            _mm_prefetch::<_MM_HINT_T0>(line.add(AHEAD * W::LINE).cast());
            let (a, b) = W::widen(line, head);
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(r * k + i));
                acc[0] = _mm512_fmadd_ps(xv, a, acc[0]);
                acc[1] = _mm512_fmadd_ps(xv, b, acc[1]);
            }
        };
        let mut p = w;
        let mut i0 = 0;
        while i0 < k {
            let head = W::head(p);
            let lines = p.add(W::HEAD);
            let mut i = 0;
            // Two values of `i` a pass: the loop's own instructions halved.
            while i + 2 <= block {
                step(&mut acc, lines.add(i * W::LINE), head, i0 + i);
                step(&mut acc, lines.add((i + 1) * W::LINE), head, i0 + i + 1);
                i += 2;
            }
            if i < block {
                step(&mut acc, lines.add(i * W::LINE), head, i0 + i);
            }
            p = lines.add(block * W::LINE);
            i0 += block;
        }
        let (ma, mb) = (
            super::tile::lane_mask(cols),
            super::tile::lane_mask(cols.saturating_sub(16)),
        );
        for (r, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(r * ldo), ma, a[0]);
            _mm512_mask_storeu_ps(out.add(r * ldo + 16), mb, a[1]);
        }
    }
}

/// The tiles of panels `panels` (`bytes` each) for every row, eight rows at a time.
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; lengths as [`matmul`] checks them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn panels_avx512<W: Widen>(
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    bytes: usize,
    panels: std::ops::Range<usize>,
) {
    for p in panels {
        let cols = COLS.min(n - p * COLS);
        // SAFETY: panel p of w lies in it (`matmul` checked its length); rows of x and out
        // as `matmul` checked.
        unsafe { row_groups::<W>(x, out, rows, n, k, p, cols, w.as_ptr().add(p * bytes)) };
    }
}

/// The tiles of every row on panel `p`, whose lines of `W` are at `wp`: steps of up to eight
/// rows in one tile, more in tiles of [`TALL_ROWS`] (each line widened once for more rows).
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; `x` holds `rows × k` values, `out` `rows × n`, `wp` a panel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_groups<W: Widen>(
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    p: usize,
    cols: usize,
    wp: *const u8,
) {
    let most = if rows > MAX_ROWS { TALL_ROWS } else { MAX_ROWS };
    let mut r = 0;
    while r < rows {
        let m = most.min(rows - r);
        // SAFETY: rows r..r + m of x and out, columns below n.
        unsafe {
            let (xp, op) = (
                x.as_ptr().add(r * k),
                out.as_mut_ptr().add(r * n + p * COLS),
            );
            match m {
                1 => tile::<W, 1>(xp, k, wp, op, n, cols),
                2 => tile::<W, 2>(xp, k, wp, op, n, cols),
                3 => tile::<W, 3>(xp, k, wp, op, n, cols),
                4 => tile::<W, 4>(xp, k, wp, op, n, cols),
                5 => tile::<W, 5>(xp, k, wp, op, n, cols),
                6 => tile::<W, 6>(xp, k, wp, op, n, cols),
                7 => tile::<W, 7>(xp, k, wp, op, n, cols),
                8 => tile::<W, 8>(xp, k, wp, op, n, cols),
                9 => tile::<W, 9>(xp, k, wp, op, n, cols),
                10 => tile::<W, 10>(xp, k, wp, op, n, cols),
                11 => tile::<W, 11>(xp, k, wp, op, n, cols),
                _ => tile::<W, 12>(xp, k, wp, op, n, cols),
            }
        }
        r += m;
    }
}

/// Steps of up to this many rows scale a Q4 tile's sums once per block (the rest widen each
/// value with its scale and offset, shared by more rows).
#[cfg(target_arch = "x86_64")]
const Q4_SCALED_ROWS: usize = 4;

thread_local! {
    /// The calling thread's sums of each row's 32-value groups of activations, for the Q4
    /// tiles' offsets.
    #[cfg(target_arch = "x86_64")]
    static GROUP_SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`matmul`] on Q4_0 or Q4_1 panels.
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; lengths as [`matmul`] checks them.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_panels(
    dtype: DType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    rows: usize,
    n: usize,
    k: usize,
    chunks: usize,
) {
    let groups = k / maxc_schema::blocks::QK;
    GROUP_SUMS.with(|sums| {
        let sums = &mut *sums.borrow_mut();
        // Steps that scale per block take `Σ x` of each row's groups (for the offsets).
        sums.clear();
        if rows <= Q4_SCALED_ROWS {
            sums.extend(
                x[..rows * k]
                    .chunks_exact(maxc_schema::blocks::QK)
                    .map(|g| g.iter().sum::<f32>()),
            );
        }
        let panels = n.div_ceil(COLS);
        let bytes = panels_len(dtype, COLS, k);
        let (optr, sp) = (
            crate::pool::OutPtr(out.as_mut_ptr()),
            SendPtr(sums.as_ptr()),
        );
        crate::pool::run(chunks, &|c| {
            for p in panels * c / chunks..panels * (c + 1) / chunks {
                let cols = COLS.min(n - p * COLS);
                let mut r = 0;
                let most = if rows > MAX_ROWS { TALL_ROWS } else { MAX_ROWS };
                while r < rows {
                    let m = most.min(rows - r);
                    // SAFETY: AVX-512 as the function says; rows r..r + m of x, out and the
                    // sums, panel p of w, columns below n; each call writes only its panels'
                    // columns.
                    unsafe {
                        let a = Q4Args {
                            x: x.as_ptr().add(r * k),
                            k,
                            w: w.as_ptr().add(p * bytes),
                            out: optr.get().add(r * n + p * COLS),
                            ldo: n,
                            cols,
                            sums: sp.get().add(r * groups),
                            groups,
                        };
                        let scaled = rows <= Q4_SCALED_ROWS;
                        match dtype {
                            DType::Q4_0 => tile_q4_rows::<Q4_0>(m, scaled, a),
                            DType::Q4_1 => tile_q4_rows::<Q4_1>(m, scaled, a),
                            _ => tile_q4_rows::<Q4_K>(m, scaled, a),
                        }
                    }
                    r += m;
                }
            }
        });
    });
}

/// A pointer that may cross to the pool's threads (read-only there).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct SendPtr(*const f32);
#[cfg(target_arch = "x86_64")]
impl SendPtr {
    /// (A method, so that a closure captures the whole `SendPtr`, not its field.)
    fn get(self) -> *const f32 {
        self.0
    }
}
// SAFETY: only read, while the call that owns the values waits for every chunk.
#[cfg(target_arch = "x86_64")]
unsafe impl Send for SendPtr {}
// SAFETY: as above.
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for SendPtr {}

/// The Q4 panel formats ([`tile_q4`]'s `KIND`).
#[cfg(target_arch = "x86_64")]
const Q4_0: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q4_1: u8 = 1;
#[cfg(target_arch = "x86_64")]
const Q4_K: u8 = 2;

/// Group `b` (32 values of `i`) of the Q4 panel at `w`: its 16 lines, and each column's `d`
/// and `m` (columns `0..16`, `16..32`), its values being `d q + m`: Q4_0's scale and `-8 d`,
/// Q4_1's scale and offset, Q4_K's `d · sc` and `-dmin · m`.
///
/// # Safety
/// AVX-512F/BW and F16C; `w` a panel of more than `b` groups.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q4_group<const KIND: u8>(
    w: *const u8,
    b: usize,
) -> (*const u8, __m512, __m512, __m512, __m512) {
    // SAFETY: as the function says: group b's header and lines lie in the panel.
    unsafe {
        let bytes =
            |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())));
        if KIND == Q4_K {
            let sb = w.add(b / Q4K_GROUPS * (Q4K_HEAD + 128 * COLS));
            let g = b % Q4K_GROUPS;
            let (sc, m) = (
                sb.add(4 * COLS + g * COLS),
                sb.add(4 * COLS + (Q4K_GROUPS + g) * COLS),
            );
            let ((dl, dh), (ml, mh)) = (f16x32(sb), f16x32(sb.add(2 * COLS)));
            let zero = _mm512_setzero_ps();
            return (
                sb.add(Q4K_HEAD + g * 16 * COLS),
                _mm512_mul_ps(dl, bytes(sc)),
                _mm512_mul_ps(dh, bytes(sc.add(16))),
                _mm512_sub_ps(zero, _mm512_mul_ps(ml, bytes(m))),
                _mm512_sub_ps(zero, _mm512_mul_ps(mh, bytes(m.add(16)))),
            );
        }
        let head = if KIND == Q4_1 { 4 * COLS } else { 2 * COLS };
        let blk = w.add(b * (head + 16 * COLS));
        let (dl, dh) = f16x32(blk);
        let (ml, mh) = if KIND == Q4_1 {
            f16x32(blk.add(2 * COLS))
        } else {
            let m8 = _mm512_set1_ps(-8.0);
            (_mm512_mul_ps(dl, m8), _mm512_mul_ps(dh, m8))
        };
        (blk.add(head), dl, dh, ml, mh)
    }
}

/// A Q4 tile's operands ([`tile_q4`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Q4Args {
    x: *const f32,
    k: usize,
    w: *const u8,
    out: *mut f32,
    ldo: usize,
    cols: usize,
    sums: *const f32,
    groups: usize,
}

/// [`tile_q4`] for a tile of `m` (1 to 12) rows.
///
/// # Safety
/// As [`tile_q4`]'s, for `m` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile_q4_rows<const KIND: u8>(m: usize, scaled: bool, a: Q4Args) {
    // SAFETY: as the function says.
    unsafe {
        macro_rules! go {
            ($($r:literal)*) => {
                match (m, scaled) {
                    $(
                        ($r, false) => tile_q4::<$r, KIND, false>(a),
                        ($r, true) => tile_q4::<$r, KIND, true>(a),
                    )*
                    (9, _) => tile_q4::<9, KIND, false>(a),
                    (10, _) => tile_q4::<10, KIND, false>(a),
                    (11, _) => tile_q4::<11, KIND, false>(a),
                    (12, _) => tile_q4::<12, KIND, false>(a),
                    _ => unreachable!("tiles of 1 to 12 rows"),
                }
            };
        }
        go!(1 2 3 4 5 6 7 8)
    }
}

/// One Q4 tile: `R` rows of `x` (rows `k` apart) by the panel at `w`. Per pair of values of
/// `i`: one 32-byte load, two zero-extensions, a mask and a shift each, four conversions.
/// `SCALED` (steps of up to [`Q4_SCALED_ROWS`] rows) sums `x · q` per 32-value group and
/// scales once (`d · Σ x q + m · Σ x`, the group sums at `sums`, `groups` a row); otherwise
/// each value is widened to `d q + m` first, for all the tile's rows. A group's `d` and `m`:
/// Q4_0's scale and `-8 d`, Q4_1's scale and offset, Q4_K's `d · sc` and `-dmin · m`.
///
/// # Safety
/// AVX-512F/BW/VL/DQ and F16C; `x` holds `R` rows of `k` values, `w` a panel of `k / 32`
/// groups, `out` `R` rows with `cols` columns from it, `sums` `R` rows of `groups` (where
/// `SCALED`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile_q4<const R: usize, const KIND: u8, const SCALED: bool>(a: Q4Args) {
    let Q4Args {
        x,
        k,
        w,
        out,
        ldo,
        cols,
        sums,
        groups,
    } = a;
    let scaled = SCALED;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY (the loads): `groups` groups of the panel, `R` rows of `x` and of `sums`;
    // prefetches never fault.
    unsafe {
        let low = _mm512_set1_epi32(0xF);
        for b in 0..groups {
            let (lines, dl, dh, ml, mh) = q4_group::<KIND>(w, b);
            let xb = x.add(b * maxc_schema::blocks::QK);
            if R > MAX_ROWS {
                // Prefill's tall tiles: one value of `i` at a time, each pair's bytes loaded
                // again for the second (registers: 24 accumulators and the scales).
                for i in 0..maxc_schema::blocks::QK {
                    let pair = lines.add(i / 2 * COLS);
                    let (v0, v1) = (
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.cast())),
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.add(16).cast())),
                    );
                    let (v0, v1) = if i.is_multiple_of(2) {
                        (_mm512_and_si512(v0, low), _mm512_and_si512(v1, low))
                    } else {
                        (_mm512_srli_epi32::<4>(v0), _mm512_srli_epi32::<4>(v1))
                    };
                    let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), dl, ml);
                    let b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), dh, mh);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*xb.add(r * k + i));
                        acc[0] = _mm512_fmadd_ps(xv, a, acc[0]);
                        acc[1] = _mm512_fmadd_ps(xv, b, acc[1]);
                    }
                }
                continue;
            }
            let mut q = [[_mm512_setzero_ps(); 2]; R];
            for j in 0..16 {
                let pair = lines.add(j * COLS);
                if j.is_multiple_of(2) {
                    _mm_prefetch::<_MM_HINT_T0>(pair.add(AHEAD * 64).cast());
                }
                let v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.cast()));
                let v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pair.add(16).cast()));
                let mut a0 = _mm512_cvtepi32_ps(_mm512_and_si512(v0, low));
                let mut b0 = _mm512_cvtepi32_ps(_mm512_and_si512(v1, low));
                let mut a1 = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v0));
                let mut b1 = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v1));
                if !scaled {
                    a0 = _mm512_fmadd_ps(a0, dl, ml);
                    b0 = _mm512_fmadd_ps(b0, dh, mh);
                    a1 = _mm512_fmadd_ps(a1, dl, ml);
                    b1 = _mm512_fmadd_ps(b1, dh, mh);
                }
                let into = if scaled { &mut q } else { &mut acc };
                for (r, acc) in into.iter_mut().enumerate() {
                    let x0 = _mm512_set1_ps(*xb.add(r * k + 2 * j));
                    let x1 = _mm512_set1_ps(*xb.add(r * k + 2 * j + 1));
                    acc[0] = _mm512_fmadd_ps(x0, a0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(x0, b0, acc[1]);
                    acc[0] = _mm512_fmadd_ps(x1, a1, acc[0]);
                    acc[1] = _mm512_fmadd_ps(x1, b1, acc[1]);
                }
            }
            if scaled {
                for (r, (acc, q)) in acc.iter_mut().zip(&q).enumerate() {
                    let s = _mm512_set1_ps(*sums.add(r * groups + b));
                    acc[0] = _mm512_fmadd_ps(dl, q[0], _mm512_fmadd_ps(ml, s, acc[0]));
                    acc[1] = _mm512_fmadd_ps(dh, q[1], _mm512_fmadd_ps(mh, s, acc[1]));
                }
            }
        }
        let (ma, mb) = (
            super::tile::lane_mask(cols),
            super::tile::lane_mask(cols.saturating_sub(16)),
        );
        for (r, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(r * ldo), ma, a[0]);
            _mm512_mask_storeu_ps(out.add(r * ldo + 16), mb, a[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A weight of `n × k` values of `dtype` with varied signs and magnitudes.
    fn weight(dtype: DType, n: usize, k: usize) -> Vec<u8> {
        if dtype.is_quantized() {
            // Blocks: a scale (and offset) of its own each, then values (Q4_K: its 6-bit
            // scales and offsets among them).
            let elems = if dtype == DType::Q4K { 256 } else { 32 };
            let size = dtype.bytes_for(elems as u64).unwrap() as usize;
            return (0..n * k / elems)
                .flat_map(|b| {
                    let d = half::f16::from_f32(0.01 + (b % 7) as f32 * 0.003).to_le_bytes();
                    let m = half::f16::from_f32((b % 5) as f32 * 0.02 - 0.05).to_le_bytes();
                    let heads = if matches!(dtype, DType::Q4_1 | DType::Q4K) {
                        4
                    } else {
                        2
                    };
                    let q = (heads..size).map(move |i| ((b * 31 + i * 17) % 255) as u8);
                    d.into_iter().chain(m).take(heads).chain(q)
                })
                .collect();
        }
        (0..n * k)
            .flat_map(|e| {
                let v = ((e * 7919 % 2003) as f32 - 1001.0) / 997.0;
                let bits = match dtype {
                    DType::BF16 => (v.to_bits() >> 16) as u16,
                    _ => half::f16::from_f32(v).to_bits(),
                };
                bits.to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn panels_hold_each_stored_value_and_zeros_past_the_last_column() {
        for dtype in [
            DType::BF16,
            DType::F16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4K,
        ] {
            let (n, k) = (37, if dtype == DType::Q4K { 512 } else { 64 });
            let src = weight(dtype, n, k);
            let mut dst = vec![0xAAu8; panels_len(dtype, n, k)];
            assert!(repack(dtype, &src, &mut dst, n, k));
            let bytes = panels_len(dtype, COLS, k);
            let mut row = vec![0f32; k];
            for j in 0..64 {
                if j < n {
                    super::super::gather_row(&src, dtype, k, j, &mut row);
                }
                for (i, &v) in row.iter().enumerate() {
                    let want = if j < n { v } else { 0.0 };
                    let got = value(dtype, &dst[j / COLS * bytes..][..bytes], k, i, j % COLS);
                    assert_eq!(got, want, "{dtype:?} column {j}, i {i}");
                }
            }
            let mut got = vec![0f32; k];
            for j in 0..n {
                super::super::gather_row(&src, dtype, k, j, &mut row);
                gather_row(dtype, &dst, k, j, &mut got);
                assert_eq!(got, row, "{dtype:?} row {j}");
            }
            assert!(
                !repack(dtype, &src, &mut dst[1..], n, k),
                "a short destination"
            );
        }
        assert!(!repack(DType::F32, &[0; 16], &mut [0; 256], 1, 4));
        // Q8_0 rows are whole blocks.
        assert_eq!(panels_len(DType::Q8_0, 1, 48), 0);
    }
}
