//! Element types of tensors and weights.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// GGUF blocks of 32: f16 scale `d`, 32 × i8 (`d·q`).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// GGUF blocks of 32: f16 `d`, 16 bytes of nibbles (`d·(q − 8)`).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// GGUF blocks of 32: f16 `d`, f16 `m`, 16 bytes of nibbles (`d·q + m`).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// GGUF blocks of 32: f16 `d`, 32 high bits, 16 bytes of nibbles (`d·(q − 16)`).
    #[serde(rename = "q5_0")]
    Q5_0,
    /// GGUF blocks of 32: f16 `d`, f16 `m`, 32 high bits, 16 bytes of nibbles (`d·q + m`).
    #[serde(rename = "q5_1")]
    Q5_1,
    /// GGUF super-blocks of 256: f16 `d` and `dmin`, eight 6-bit scales and mins, 4-bit values.
    #[serde(rename = "q4_k")]
    Q4K,
    /// GGUF super-blocks of 256: as [`DType::Q4K`] with a fifth bit per value.
    #[serde(rename = "q5_k")]
    Q5K,
    /// GGUF super-blocks of 256: 6-bit values in sixteen groups with i8 scales, f16 `d`.
    #[serde(rename = "q6_k")]
    Q6K,
}

impl DType {
    /// The GGUF block formats, in [`DType::ALL`]'s order.
    pub fn block_formats() -> impl Iterator<Item = DType> {
        DType::ALL.into_iter().filter(|d| d.is_quantized())
    }

    /// Every dtype.
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    /// Bytes per element of a scalar type; for a block type, bytes per block (see
    /// [`DType::block`]). Sizes of tensors go through [`DType::bytes_for`].
    pub fn size(self) -> usize {
        self.block().1
    }

    /// (elements, bytes) of the storage unit: one element for scalar types, one block for
    /// the GGUF block types.
    pub fn block(self) -> (usize, usize) {
        use crate::blocks::{with_block, Block, BlockFn};
        struct Unit;
        impl BlockFn for Unit {
            type Out = (usize, usize);
            fn call<B: Block>(self) -> (usize, usize) {
                (B::ELEMS, std::mem::size_of::<B>())
            }
        }
        match self {
            DType::F32 | DType::I32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::I64 => (1, 8),
            _ => with_block(self, Unit).unwrap_or((1, 1)),
        }
    }

    /// Bytes of `elements` values, or `None` where they are not whole blocks (or overflow).
    pub fn bytes_for(self, elements: u64) -> Option<u64> {
        let (n, b) = self.block();
        elements
            .is_multiple_of(n as u64)
            .then(|| (elements / n as u64).checked_mul(b as u64))?
    }

    /// The alignment a weight of this type needs in memory (block types are read bytewise).
    pub fn align(self) -> usize {
        if self.is_quantized() {
            1
        } else {
            self.size()
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for the GGUF block types (real values stored as scaled small integers).
    pub fn is_quantized(self) -> bool {
        self.block().0 > 1
    }

    /// True for the types that hold real numbers: float or quantized.
    pub fn is_real(self) -> bool {
        self.is_float() || self.is_quantized()
    }

    /// The short name (`f32`, `bf16`, ...), as the CLI and manifests spell it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    /// The dtype of a safetensors tensor, if maxc supports it.
    pub fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        Some(match d {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::I32 => DType::I32,
            safetensors::Dtype::I64 => DType::I64,
            _ => return None,
        })
    }

    /// The safetensors dtype this dtype is stored as: block types are `U8` tensors of shape
    /// `[rows, bytes per row]` with the dtype's name in the file's metadata (see
    /// [`DType::metadata_key`]).
    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
            DType::I32 => safetensors::Dtype::I32,
            DType::I64 => safetensors::Dtype::I64,
            _ => safetensors::Dtype::U8,
        }
    }

    /// The safetensors metadata key that names the block type of the `U8` tensor `key`:
    /// `maxc.dtype.<key>`, whose value is the type's name (`q4_1`, `q6_k`, ...).
    pub fn metadata_key(key: &str) -> String {
        format!("maxc.dtype.{key}")
    }

    /// The dtype and logical shape of the safetensors tensor `key` (stored dtype `stored`,
    /// stored shape `shape`), given the file's metadata: a `U8` tensor named in
    /// [`DType::metadata_key`] is blocks of that type; any other tensor is its own dtype. The
    /// error says what does not fit.
    pub fn of_safetensors_tensor(
        key: &str,
        stored: safetensors::Dtype,
        shape: &[usize],
        metadata: &std::collections::HashMap<String, String>,
    ) -> Result<(DType, Vec<usize>), String> {
        let meta_key = DType::metadata_key(key);
        let Some(name) = metadata.get(&meta_key) else {
            let dtype = DType::from_safetensors(stored).ok_or_else(|| {
                format!(
                    "tensor `{key}` has dtype {stored:?}; maxc reads F32, F16, BF16, I32, I64 \
                     (and U8 blocks named in the metadata)"
                )
            })?;
            return Ok((dtype, shape.to_vec()));
        };
        let dtype = name
            .parse::<DType>()
            .ok()
            .filter(|d| d.is_quantized() && stored == safetensors::Dtype::U8)
            .ok_or_else(|| {
                format!(
                    "metadata `{meta_key}` names `{name}` for a {stored:?} tensor; expected a \
                     block type of a U8 tensor"
                )
            })?;
        let logical = dtype.logical_shape(shape).ok_or_else(|| {
            format!(
                "tensor `{key}` ({dtype}): rows of {:?} bytes are not whole blocks",
                shape.last()
            )
        })?;
        Ok((dtype, logical))
    }

    /// The shape a tensor of `shape` (logical, outermost first) is stored with in safetensors:
    /// the last dim counted in bytes for block types. `None` where the last dim is not whole
    /// blocks.
    pub fn stored_shape(self, shape: &[usize]) -> Option<Vec<usize>> {
        let mut s = shape.to_vec();
        if !self.is_quantized() {
            return Some(s);
        }
        if let Some(last) = s.last_mut() {
            *last = self.bytes_for(*last as u64)? as usize;
        }
        Some(s)
    }

    /// The logical shape of a tensor stored with `stored` (the inverse of
    /// [`DType::stored_shape`]); `None` where the bytes are not whole blocks.
    pub fn logical_shape(self, stored: &[usize]) -> Option<Vec<usize>> {
        let (n, b) = self.block();
        let mut s = stored.to_vec();
        if !self.is_quantized() {
            return Some(s);
        }
        if let Some(last) = s.last_mut() {
            if *last % b != 0 {
                return None;
            }
            *last = *last / b * n;
        }
        Some(s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    /// Accepts maxc's short names and the names config.json uses (`bfloat16`, `float32`, ...).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => DType::F32,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            other => match DType::ALL.into_iter().find(|d| d.name() == other) {
                Some(d) => d,
                None => {
                    return Err(format!(
                        "unknown dtype `{other}` (expected one of {})",
                        DType::ALL.map(DType::name).join(", ")
                    ))
                }
            },
        })
    }
}

/// The element type of the paged KV cache: what each cached key and value (or latent) is
/// stored as, and what the KV store kernels round to and the attention kernels read.
///
/// A row is one token's keys (or values) of one KV head, `head_dim` values:
/// - [`KvDtype::F32`]: `head_dim` f32 (4 bytes a value, exact);
/// - [`KvDtype::F16`]: `head_dim` IEEE binary16, rounded to nearest even (2 bytes a value;
///   magnitudes past 65504 round to infinity, below 2^-14 to subnormals);
/// - [`KvDtype::Bf16`]: `head_dim` bfloat16, rounded to nearest even (2 bytes a value);
/// - [`KvDtype::Q8_0`]: `head_dim` i8 `q`, then one f32 scale `d` per 32 values (1.125 bytes a
///   value): `d = max|x| / 127` over each 32 values and `q = x / d` rounded to nearest even
///   (0 where `d` is 0); a value reads back as `d·q`. llama.cpp's `q8_0` stores the same
///   integers with an f16 scale in 34-byte blocks; here the scale is exact and the integers
///   stay contiguous, so a row's values load in whole vectors.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum KvDtype {
    /// IEEE 754 binary32.
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// IEEE 754 binary16 (llama.cpp's default cache type): ten bits of mantissa, values
    /// beyond ±65504 become infinite.
    #[serde(rename = "f16")]
    F16,
    /// bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
    /// 8-bit integers with an f32 scale per 32.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl KvDtype {
    /// Every KV dtype.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0];

    /// Values per scale of [`KvDtype::Q8_0`].
    pub const Q8_BLOCK: u64 = 32;

    /// The name, as the CLI and manifests spell it (llama.cpp's `-ctk`/`-ctv` names).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Q8_0 => "q8_0",
        }
    }

    /// Bytes of one row of `head_dim` values (with [`KvDtype::Q8_0`], `head_dim` must be a
    /// multiple of 32: [`KvDtype::check_head_dim`]).
    pub fn row_bytes(self, head_dim: u64) -> u64 {
        match self {
            KvDtype::F32 => head_dim * 4,
            KvDtype::F16 | KvDtype::Bf16 => head_dim * 2,
            KvDtype::Q8_0 => head_dim + head_dim / Self::Q8_BLOCK * 4,
        }
    }

    /// Checks that rows of `head_dim` values can be stored: [`KvDtype::Q8_0`] scales whole
    /// groups of 32. The message names `head_dim`.
    pub fn check_head_dim(self, head_dim: u64) -> Result<(), String> {
        if self == KvDtype::Q8_0 && !head_dim.is_multiple_of(Self::Q8_BLOCK) {
            return Err(format!(
                "`head_dim` is {head_dim}; a q8_0 KV cache needs a multiple of {}",
                Self::Q8_BLOCK
            ));
        }
        Ok(())
    }

    /// `x` rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), as its bits.
    pub fn bf16_bits(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_nan() {
            return ((b >> 16) | 0x40) as u16;
        }
        (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }

    /// The scale and integers of 32 values as [`KvDtype::Q8_0`] stores them.
    pub fn q8_block(x: &[f32]) -> (f32, [i8; 32]) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let mut q = [0i8; 32];
        if d != 0.0 {
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v / d).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
        }
        (d, q)
    }

    /// `row` as this dtype would read it back: each value rounded as the KV store kernels
    /// round it (the reference for their tests and the interpreter's cache).
    pub fn round_row(self, row: &mut [f32]) {
        match self {
            KvDtype::F32 => {}
            KvDtype::F16 => {
                for v in row {
                    *v = half::f16::from_f32(*v).to_f32();
                }
            }
            KvDtype::Bf16 => {
                for v in row {
                    *v = f32::from_bits(u32::from(Self::bf16_bits(*v)) << 16);
                }
            }
            KvDtype::Q8_0 => {
                for block in row.chunks_mut(Self::Q8_BLOCK as usize) {
                    let (d, q) = Self::q8_block(block);
                    for (v, q) in block.iter_mut().zip(q) {
                        *v = d * f32::from(q);
                    }
                }
            }
        }
    }

    /// Writes `row` (`head_dim` values) in this dtype's bytes into `out` (`row_bytes` long).
    pub fn encode_row(self, row: &[f32], out: &mut [u8]) {
        match self {
            KvDtype::F32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(row) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            KvDtype::F16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
            }
            KvDtype::Bf16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&Self::bf16_bits(*v).to_le_bytes());
                }
            }
            KvDtype::Q8_0 => {
                let (qs, scales) = out.split_at_mut(row.len());
                let blocks = row.chunks(Self::Q8_BLOCK as usize);
                for (i, block) in blocks.enumerate() {
                    let (d, q) = Self::q8_block(block);
                    for (o, q) in qs[i * 32..].iter_mut().zip(&q[..block.len()]) {
                        *o = *q as u8;
                    }
                    scales[i * 4..][..4].copy_from_slice(&d.to_le_bytes());
                }
            }
        }
    }

    /// The `head_dim` values of a row stored in this dtype's bytes.
    pub fn decode_row(self, bytes: &[u8], head_dim: usize) -> Vec<f32> {
        match self {
            KvDtype::F32 => bytes
                .chunks_exact(4)
                .take(head_dim)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            KvDtype::F16 => bytes
                .chunks_exact(2)
                .take(head_dim)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            KvDtype::Bf16 => bytes
                .chunks_exact(2)
                .take(head_dim)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            KvDtype::Q8_0 => {
                let (qs, scales) = bytes.split_at(head_dim);
                qs.iter()
                    .enumerate()
                    .map(|(i, &q)| {
                        let s = &scales[i / 32 * 4..][..4];
                        f32::from_le_bytes([s[0], s[1], s[2], s[3]]) * f32::from(q as i8)
                    })
                    .collect()
            }
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = String;

    /// `f32`, `f16`, `bf16` or `q8_0`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!(
                    "unknown KV cache dtype `{s}` (expected one of {})",
                    KvDtype::ALL.map(KvDtype::name).join(", ")
                )
            })
    }
}

#[cfg(test)]
mod kv_tests {
    use super::KvDtype;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even (1).
        assert_eq!(KvDtype::bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to 1 + 2^-6 (even).
        assert_eq!(KvDtype::bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(KvDtype::bf16_bits(1.0 + 1.5 / 256.0), 0x3f81);
        assert_eq!(KvDtype::bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits(u32::from(KvDtype::bf16_bits(f32::NAN)) << 16).is_nan());
    }

    #[test]
    fn rows_round_trip_through_their_bytes_as_round_row_says() {
        let row: Vec<f32> = (0..64)
            .map(|i| ((i * 37) % 61) as f32 / 7.0 - 4.0)
            .collect();
        for dt in KvDtype::ALL {
            let mut bytes = vec![0u8; dt.row_bytes(64) as usize];
            dt.encode_row(&row, &mut bytes);
            let mut want = row.clone();
            dt.round_row(&mut want);
            assert_eq!(dt.decode_row(&bytes, 64), want, "{dt}");
            // Half a step of the type: 2^-11 of a value in f16 (these are normal), 2^-8 in
            // bf16, 1/254 of the largest in q8_0.
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in row.iter().zip(&want) {
                let bound = match dt {
                    KvDtype::F32 => 0.0,
                    KvDtype::F16 => a.abs() / 2048.0,
                    KvDtype::Bf16 => a.abs() / 256.0,
                    KvDtype::Q8_0 => amax / 254.0 * 1.0001,
                };
                assert!((a - b).abs() <= bound, "{dt}: {a} read back as {b}");
            }
        }
        // A block of zeros has scale 0 and reads back as zeros.
        let (d, q) = KvDtype::q8_block(&[0.0; 32]);
        assert_eq!((d, q), (0.0, [0; 32]));
        assert!(KvDtype::Q8_0.check_head_dim(80).is_err());
        assert!(KvDtype::Q8_0.check_head_dim(576).is_ok());
        assert_eq!("Q8_0".parse::<KvDtype>(), Ok(KvDtype::Q8_0));
        assert_eq!("f16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert!("fp8"
            .parse::<KvDtype>()
            .unwrap_err()
            .contains("f32, f16, bf16, q8_0"));
    }
}
