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
