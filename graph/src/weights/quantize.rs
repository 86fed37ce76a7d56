//! Quantization to GGUF block types, one more weight-preparation step. Q8_0, Q4_0, Q4_1, Q5_0
//! and Q5_1 follow ggml's reference quantizers (`quantize_row_*_ref`) operation for operation in
//! f32, so they give the bytes gguf-py's quantizer gives; Q4_K fits each group of 32 its own
//! scale and min (the group's range), then quantizes those to 6 bits against the super-block's
//! largest, and re-fits the values to the quantized scales.

use crate::DType;
use half::f16;
use maxc_schema::blocks::{QK, QK_K};

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// The format a weight of `shape` is quantized to when `wanted` is asked: `wanted` where each
/// row is whole blocks of it; otherwise ggml's fallback (Q4_K -> Q5_0), or `None` (the weight
/// stays in its float dtype) where no block fits.
pub fn format_for(wanted: DType, shape: &[usize]) -> Option<DType> {
    let cols = *shape.last()?;
    [wanted, DType::Q5_0]
        .into_iter()
        .take(if wanted == DType::Q4K { 2 } else { 1 })
        .find(|d| cols.is_multiple_of(d.block().0))
}

/// `values` (row-major, `shape`) as blocks of `dtype`; an error where a row is not whole blocks
/// or `dtype` has no quantizer.
/// The block types [`quantize`] makes.
pub const QUANTIZERS: [DType; 6] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q4K,
];

/// Whether [`quantize`] can make `dtype`.
pub fn has_quantizer(dtype: DType) -> bool {
    QUANTIZERS.contains(&dtype)
}

pub fn quantize(dtype: DType, values: &[f32], shape: &[usize]) -> Result<Vec<u8>, String> {
    let (n, size) = dtype.block();
    let cols = shape.last().copied().unwrap_or(1);
    if !cols.is_multiple_of(n) || !values.len().is_multiple_of(n) {
        return Err(format!(
            "{shape:?} cannot be stored as {dtype}: rows of {cols} are not whole blocks of {n}"
        ));
    }
    let mut out = Vec::with_capacity(values.len() / n * size);
    for block in values.chunks_exact(n) {
        match dtype {
            DType::Q8_0 => q8_0(block, &mut out),
            DType::Q4_0 => q4_0(block, &mut out),
            DType::Q4_1 => q4_1(block, &mut out),
            DType::Q5_0 => q5_0(block, &mut out),
            DType::Q5_1 => q5_1(block, &mut out),
            DType::Q4K => q4_k(block, &mut out),
            other => return Err(format!("maxc has no quantizer for {other}")),
        }
    }
    Ok(out)
}

/// The value of largest magnitude (the first such), signed.
fn absmax_signed(x: &[f32]) -> f32 {
    let mut best = 0.0f32;
    for &v in x {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    out.extend(f16_bytes(d));
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// Packs 32 nibble values: element `j` in the low nibble of byte `j`, element `j + 16` high.
fn pack_nibbles(q: &[u8; QK], out: &mut Vec<u8>) {
    out.extend((0..QK / 2).map(|j| (q[j] & 0xF) | (q[j + QK / 2] << 4)));
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let d = absmax_signed(x) / -8.0;
    let id = inverse(d);
    let q: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8);
    out.extend(f16_bytes(d));
    pack_nibbles(&q, out);
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    let q: [u8; QK] =
        std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8);
    out.extend(f16_bytes(d));
    out.extend(f16_bytes(min));
    pack_nibbles(&q, out);
}

fn high_bits(q: &[u8; QK]) -> [u8; 4] {
    let bits = (0..QK).fold(0u32, |a, j| a | (((q[j] as u32 >> 4) & 1) << j));
    bits.to_le_bytes()
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let d = absmax_signed(x) / -16.0;
    let id = inverse(d);
    let q: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i32).clamp(0, 31) as u8);
    out.extend(f16_bytes(d));
    out.extend(high_bits(&q));
    pack_nibbles(&q, out);
}

fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    let q: [u8; QK] =
        std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i32).clamp(0, 31) as u8);
    out.extend(f16_bytes(d));
    out.extend(f16_bytes(min));
    out.extend(high_bits(&q));
    pack_nibbles(&q, out);
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    const GROUPS: usize = QK_K / 32;
    // Each group's own fit: y ≈ scale·q − min with q in 0..=15 and min ≥ 0.
    let mut scales = [0.0f32; GROUPS];
    let mut mins = [0.0f32; GROUPS];
    for (g, group) in x.chunks_exact(32).enumerate() {
        let (lo, hi) = min_max(group);
        let lo = lo.min(0.0);
        scales[g] = (hi - lo) / 15.0;
        mins[g] = -lo;
    }
    let max_scale = scales.iter().fold(0.0f32, |a, &s| a.max(s));
    let max_min = mins.iter().fold(0.0f32, |a, &m| a.max(m));
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    let (id, idmin) = (inverse(d), inverse(dmin));
    let sc: [u8; GROUPS] =
        std::array::from_fn(|g| ((scales[g] * id).round() as i32).clamp(0, 63) as u8);
    let m: [u8; GROUPS] =
        std::array::from_fn(|g| ((mins[g] * idmin).round() as i32).clamp(0, 63) as u8);
    let mut packed = [0u8; 12];
    for j in 0..GROUPS {
        if j < 4 {
            packed[j] = sc[j];
            packed[j + 4] = m[j];
        } else {
            packed[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            packed[j - 4] |= (sc[j] >> 4) << 6;
            packed[j] |= (m[j] >> 4) << 6;
        }
    }
    let mut q = [0u8; QK_K];
    for (g, group) in x.chunks_exact(32).enumerate() {
        let (ds, dm) = (d * sc[g] as f32, dmin * m[g] as f32);
        let ids = inverse(ds);
        for (l, &v) in group.iter().enumerate() {
            q[g * 32 + l] = (((v + dm) * ids).round() as i32).clamp(0, 15) as u8;
        }
    }
    out.extend(f16_bytes(d));
    out.extend(f16_bytes(dmin));
    out.extend(packed);
    // Each 32 bytes hold group 2c in the low nibbles and group 2c + 1 in the high nibbles.
    for c in 0..GROUPS / 2 {
        out.extend((0..32).map(|l| q[64 * c + l] | (q[64 * c + 32 + l] << 4)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maxc_schema::blocks::dequantize;

    fn wave(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.731).sin() * 1.7 + (i as f32 * 0.07).cos() * 0.3)
            .collect()
    }

    #[test]
    fn quantized_values_come_back_within_the_format_step() {
        let x = wave(2 * QK_K);
        for (dtype, levels) in [
            (DType::Q8_0, 127.0),
            (DType::Q4_0, 7.0),
            (DType::Q4_1, 15.0),
            (DType::Q5_0, 15.0),
            (DType::Q5_1, 31.0),
            (DType::Q4K, 15.0),
        ] {
            let bytes = quantize(dtype, &x, &[2, QK_K]).unwrap();
            assert_eq!(bytes.len() as u64, dtype.bytes_for(x.len() as u64).unwrap());
            let y = dequantize(dtype, &bytes).unwrap();
            let (lo, hi) = min_max(&x);
            // Within one quantization step of the block's range (a generous bound for Q4_K,
            // whose 6-bit scales add their own rounding).
            let step = (hi - lo) / levels;
            let worst = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(worst <= step, "{dtype}: {worst} > {step}");
        }
    }

    #[test]
    fn q4_k_falls_back_where_rows_are_not_super_blocks() {
        assert_eq!(format_for(DType::Q4K, &[8, 512]), Some(DType::Q4K));
        assert_eq!(format_for(DType::Q4K, &[8, 576]), Some(DType::Q5_0));
        assert_eq!(format_for(DType::Q8_0, &[8, 40]), None);
        assert!(quantize(DType::Q8_0, &wave(40), &[40]).is_err());
    }
}
