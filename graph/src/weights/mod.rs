//! The weight pipeline's data: [`WeightTensor`] (memory-mapped or owned bytes of one dtype) and
//! [`StateDict`] (weights by key, sorted), plus the safetensors reader and writer.

pub mod gguf;
pub mod quantize;
mod safetensors_io;

pub use safetensors_io::{
    load_checkpoint_weights, read_safetensors_file, write_safetensors, write_safetensors_to,
};

use crate::{DType, Error, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Clone, Debug)]
enum Bytes {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        end: usize,
    },
    Owned(Arc<Vec<u8>>),
}

/// One weight: dtype, shape and little-endian bytes, either borrowed from a memory-mapped file
/// or owned (after a transform). Cloning is cheap.
#[derive(Clone, Debug)]
pub struct WeightTensor {
    /// Element type of the bytes.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    bytes: Bytes,
}

impl WeightTensor {
    pub(crate) fn mapped(
        dtype: DType,
        shape: Vec<usize>,
        map: Arc<Mmap>,
        start: usize,
        end: usize,
    ) -> Self {
        WeightTensor {
            dtype,
            shape,
            bytes: Bytes::Mapped { map, start, end },
        }
    }

    /// A weight owning `bytes`; `bytes.len()` must be `dtype.bytes_for(numel)` (whole blocks
    /// of each row for block types).
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Self> {
        let want = dtype.bytes_for(shape.iter().product::<usize>() as u64);
        let rows_whole = shape
            .last()
            .is_none_or(|&c| c.is_multiple_of(dtype.block().0));
        if want != Some(bytes.len() as u64) || !rows_whole {
            return Err(Error::WeightDtype {
                key: "<new tensor>".into(),
                message: format!(
                    "{} bytes for {dtype}{shape:?}, expected {}",
                    bytes.len(),
                    want.map_or("whole blocks per row".into(), |w| w.to_string())
                ),
            });
        }
        Ok(WeightTensor {
            dtype,
            shape,
            bytes: Bytes::Owned(Arc::new(bytes)),
        })
    }

    /// An f32 weight holding `values`.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        WeightTensor {
            dtype: DType::F32,
            shape,
            bytes: Bytes::Owned(Arc::new(bytes)),
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped { map, start, end } => &map[*start..*end],
            Bytes::Owned(v) => v,
        }
    }

    /// The values as f32 (exact for f16 and bf16); `key` names the weight in errors.
    pub fn to_f32(&self, key: &str) -> Result<Vec<f32>> {
        let b = self.bytes();
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::I32 | DType::I64 => {
                return Err(Error::WeightDtype {
                    key: key.into(),
                    message: format!("holds {}, expected a float dtype", self.dtype),
                })
            }
            q => maxc_schema::blocks::dequantize(q, b).ok_or_else(|| Error::WeightDtype {
                key: key.into(),
                message: format!("{} bytes are not whole {q} blocks", b.len()),
            })?,
        })
    }

    /// The values as i64 (i32 and i64 weights); `key` names the weight in errors.
    pub fn to_i64(&self, key: &str) -> Result<Vec<i64>> {
        let b = self.bytes();
        Ok(match self.dtype {
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect(),
            other => {
                return Err(Error::WeightDtype {
                    key: key.into(),
                    message: format!("holds {other}, expected i32 or i64"),
                })
            }
        })
    }

    /// The weight in `dtype`: floats rounded to nearest even, block types dequantized, and
    /// quantized to a block type row by row (see [`quantize`]). Same dtype: a cheap clone.
    pub fn convert(&self, dtype: DType, key: &str) -> Result<WeightTensor> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        if !dtype.is_real() || !self.dtype.is_real() {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!("cannot convert {} to {dtype}", self.dtype),
            });
        }
        let values = self.to_f32(key)?;
        if dtype.is_quantized() {
            let bytes = quantize::quantize(dtype, &values, &self.shape).map_err(|message| {
                Error::WeightDtype {
                    key: key.into(),
                    message,
                }
            })?;
            return Ok(WeightTensor {
                dtype,
                shape: self.shape.clone(),
                bytes: Bytes::Owned(Arc::new(bytes)),
            });
        }
        let bytes: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => unreachable!("checked above"),
        };
        Ok(WeightTensor {
            dtype,
            shape: self.shape.clone(),
            bytes: Bytes::Owned(Arc::new(bytes)),
        })
    }
}

/// Weights by key, in sorted order.
#[derive(Clone, Debug, Default)]
pub struct StateDict {
    tensors: BTreeMap<String, WeightTensor>,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces `key`.
    pub fn insert(&mut self, key: impl Into<String>, tensor: WeightTensor) -> Option<WeightTensor> {
        self.tensors.insert(key.into(), tensor)
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: &str) -> Option<WeightTensor> {
        self.tensors.remove(key)
    }

    /// The weight under `key`.
    pub fn get(&self, key: &str) -> Option<&WeightTensor> {
        self.tensors.get(key)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// Number of weights.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Keys and weights, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &WeightTensor)> {
        self.tensors.iter()
    }

    /// Keys, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The weights whose key starts with `prefix`, with the prefix stripped.
    pub fn select_prefix(&self, prefix: &str) -> StateDict {
        let tensors = self
            .tensors
            .iter()
            .filter_map(|(k, t)| {
                k.strip_prefix(prefix)
                    .map(|rest| (rest.to_string(), t.clone()))
            })
            .collect();
        StateDict { tensors }
    }
}

impl FromIterator<(String, WeightTensor)> for StateDict {
    fn from_iter<I: IntoIterator<Item = (String, WeightTensor)>>(iter: I) -> Self {
        StateDict {
            tensors: iter.into_iter().collect(),
        }
    }
}

impl IntoIterator for StateDict {
    type Item = (String, WeightTensor);
    type IntoIter = std::collections::btree_map::IntoIter<String, WeightTensor>;
    fn into_iter(self) -> Self::IntoIter {
        self.tensors.into_iter()
    }
}
