//! The weight pipeline's data: [`WeightTensor`] (memory-mapped or owned bytes of one dtype) and
//! [`StateDict`] (weights by key, sorted), plus the safetensors reader and writer.

pub mod gguf;
pub mod quantize;
mod safetensors_io;

pub use safetensors_io::{
    load_checkpoint_weights, read_safetensors_file, safetensors_data_offsets, write_safetensors,
    write_safetensors_to,
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
    /// `from` converted to the tensor's dtype: computed when first read, or streamed row
    /// chunk by row chunk (never whole) while written.
    Converted {
        from: Arc<WeightTensor>,
        done: Arc<std::sync::OnceLock<Vec<u8>>>,
    },
}

/// Rows per chunk when a conversion is streamed: about this many bytes of f32 values.
const CHUNK_BYTES: usize = 1 << 20;

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

    /// Rows `rows` of a tensor of two or more dims (its first dim split; rows of any dtype,
    /// GGUF blocks included, are whole bytes). Rows of a memory-mapped tensor stay mapped.
    pub fn rows(&self, rows: std::ops::Range<usize>, key: &str) -> Result<WeightTensor> {
        let n = *self.shape.first().unwrap_or(&0);
        if self.shape.len() < 2 || rows.end > n || rows.start > rows.end {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!(
                    "cannot take rows {}..{} of a tensor of shape {:?}",
                    rows.start, rows.end, self.shape
                ),
            });
        }
        let row_bytes = self.bytes().len() / n;
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        let (from, to) = (rows.start * row_bytes, rows.end * row_bytes);
        if let Bytes::Mapped { map, start, .. } = &self.bytes {
            return Ok(WeightTensor::mapped(
                self.dtype,
                shape,
                map.clone(),
                start + from,
                start + to,
            ));
        }
        WeightTensor::from_bytes(self.dtype, shape, self.bytes()[from..to].to_vec())
    }

    /// Columns `cols` of every row of a 2-D tensor (its last dim split). Block types split at
    /// whole blocks only: a split inside a block is an error naming the key.
    pub fn cols(&self, cols: std::ops::Range<usize>, key: &str) -> Result<WeightTensor> {
        let bad = |message: String| Error::WeightDtype {
            key: key.into(),
            message,
        };
        let [n, k] = self.shape[..] else {
            return Err(bad(format!(
                "cannot split the columns of a tensor of shape {:?}",
                self.shape
            )));
        };
        let block = self.dtype.block().0;
        if cols.end > k || cols.start > cols.end {
            return Err(bad(format!(
                "cannot take columns {}..{} of a tensor of shape {:?}",
                cols.start, cols.end, self.shape
            )));
        }
        if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
            return Err(bad(format!(
                "is {}, whose blocks of {block} values cannot split at columns {}..{} of {k}",
                self.dtype.name(),
                cols.start,
                cols.end
            )));
        }
        let bytes_for = |c: usize| self.dtype.bytes_for(c as u64).unwrap_or(0) as usize;
        let (row, from, len) = (bytes_for(k), bytes_for(cols.start), bytes_for(cols.len()));
        let src = self.bytes();
        let mut out = Vec::with_capacity(n * len);
        for r in 0..n {
            out.extend_from_slice(&src[r * row + from..][..len]);
        }
        WeightTensor::from_bytes(self.dtype, vec![n, cols.len()], out)
            .map_err(|e| bad(e.to_string()))
    }

    /// Elements `range` of a 1-D tensor (a bias).
    pub fn span(&self, range: std::ops::Range<usize>, key: &str) -> Result<WeightTensor> {
        if self.shape.len() != 1 || range.end > self.shape[0] || range.start > range.end {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!(
                    "cannot take elements {}..{} of a tensor of shape {:?}",
                    range.start, range.end, self.shape
                ),
            });
        }
        let size = self.dtype.size();
        let b = &self.bytes()[range.start * size..range.end * size];
        WeightTensor::from_bytes(self.dtype, vec![range.len()], b.to_vec())
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The raw little-endian bytes (a pending conversion is computed and kept).
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped { map, start, end } => &map[*start..*end],
            Bytes::Owned(v) => v,
            Bytes::Converted { from, done } => done.get_or_init(|| {
                convert_bytes(from.dtype, from.bytes(), self.dtype, &self.shape, "")
                    .expect("checked when the conversion was made")
            }),
        }
    }

    /// Bytes of the stored form, without computing a pending conversion.
    pub fn byte_len(&self) -> usize {
        match &self.bytes {
            Bytes::Converted { done, .. } if done.get().is_none() => self
                .dtype
                .bytes_for(self.numel() as u64)
                .map_or(0, |n| n as usize),
            _ => self.bytes().len(),
        }
    }

    /// Writes the stored bytes to `out`: a pending conversion streamed a chunk of rows at a
    /// time (never whole), and the pages of a memory-mapped source handed back to the system
    /// once written, so that writing every weight of a model keeps little of it resident.
    pub fn write_to(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        match &self.bytes {
            Bytes::Converted { from, done } if done.get().is_none() => {
                let cols = self.shape.last().copied().unwrap_or(1).max(1);
                let rows = self.numel() / cols;
                let src_row = from.dtype.bytes_for(cols as u64).unwrap_or(0) as usize;
                let chunk = (CHUNK_BYTES / (cols * 4)).max(1);
                let src = from.bytes();
                let mut r0 = 0;
                while r0 < rows {
                    let r1 = rows.min(r0 + chunk);
                    let part = &src[r0 * src_row..r1 * src_row];
                    let bytes = convert_bytes(from.dtype, part, self.dtype, &[r1 - r0, cols], "")
                        .map_err(|e| std::io::Error::other(e.to_string()))?;
                    out.write_all(&bytes)?;
                    from.release(r0 * src_row..r1 * src_row);
                    r0 = r1;
                }
                Ok(())
            }
            _ => {
                for (i, part) in self.bytes().chunks(CHUNK_BYTES).enumerate() {
                    out.write_all(part)?;
                    self.release(i * CHUNK_BYTES..i * CHUNK_BYTES + part.len());
                }
                Ok(())
            }
        }
    }

    /// Hands the pages of `range` (of a memory-mapped weight's bytes) back to the system: the
    /// process no longer holds them resident, and a later read maps them again from the file.
    fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Bytes::Mapped { map, start, .. } = &self.bytes {
            if !range.is_empty() {
                // SAFETY: a read-only shared mapping of a file that nothing writes while
                // maxc runs: after MADV_DONTNEED, a read faults the same bytes in again from
                // the file, so every live reference still sees the same values.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start + range.start,
                        range.len(),
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    /// The values as f32 (exact for f16 and bf16); `key` names the weight in errors.
    pub fn to_f32(&self, key: &str) -> Result<Vec<f32>> {
        values_f32(self.dtype, self.bytes(), key)
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
    /// The conversion is checked now and computed when the bytes are first read or written
    /// (see [`WeightTensor::write_to`]).
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
        let cols = self.shape.last().copied().unwrap_or(1);
        let (n, _) = dtype.block();
        if dtype.is_quantized() && !cols.is_multiple_of(n) {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!(
                    "{:?} cannot be stored as {dtype}: rows of {cols} are not whole blocks of {n}",
                    self.shape
                ),
            });
        }
        if dtype.is_quantized() && !quantize::has_quantizer(dtype) {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!("maxc has no quantizer for {dtype}"),
            });
        }
        Ok(WeightTensor {
            dtype,
            shape: self.shape.clone(),
            bytes: Bytes::Converted {
                from: Arc::new(self.clone()),
                done: Arc::new(std::sync::OnceLock::new()),
            },
        })
    }
}

/// `bytes` of `from` (values of `shape`) in `to`; `key` names the weight in errors.
fn convert_bytes(
    from: DType,
    bytes: &[u8],
    to: DType,
    shape: &[usize],
    key: &str,
) -> Result<Vec<u8>> {
    let values = values_f32(from, bytes, key)?;
    if to.is_quantized() {
        return quantize::quantize(to, &values, shape).map_err(|message| Error::WeightDtype {
            key: key.into(),
            message,
        });
    }
    Ok(match to {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!("cannot convert {from} to {other}"),
            })
        }
    })
}

/// `bytes` of `dtype` as f32 values (exact for f16 and bf16); `key` names the weight in errors.
fn values_f32(dtype: DType, b: &[u8], key: &str) -> Result<Vec<f32>> {
    Ok(match dtype {
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
                message: format!("holds {}, expected a float dtype", dtype),
            })
        }
        q => maxc_schema::blocks::dequantize(q, b).ok_or_else(|| Error::WeightDtype {
            key: key.into(),
            message: format!("{} bytes are not whole {q} blocks", b.len()),
        })?,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_conversions_write_the_bytes_of_the_whole_conversion() {
        // 2100 rows of 256: three chunks of rows when streamed.
        let (rows, cols) = (2100, 256);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect();
        let src = WeightTensor::from_f32(vec![rows, cols], &values)
            .convert(DType::BF16, "w")
            .unwrap();
        for dtype in [DType::F32, DType::F16]
            .into_iter()
            .chain(quantize::QUANTIZERS)
        {
            let streamed = {
                let mut out = Vec::new();
                src.convert(dtype, "w").unwrap().write_to(&mut out).unwrap();
                out
            };
            let whole = src.convert(dtype, "w").unwrap();
            assert_eq!(whole.byte_len(), streamed.len(), "{dtype}");
            assert!(
                whole.bytes() == &streamed[..],
                "{dtype}: streamed bytes differ"
            );
            let direct =
                convert_bytes(DType::BF16, src.bytes(), dtype, &[rows, cols], "w").unwrap();
            assert!(
                direct == streamed,
                "{dtype}: differs from one whole conversion"
            );
        }
    }

    #[test]
    fn conversions_that_cannot_be_made_are_errors_when_asked_for() {
        let w = WeightTensor::from_f32(vec![2, 48], &[0.5; 96]);
        let e = w.convert(DType::Q4K, "layers.0.w").unwrap_err().to_string();
        assert!(
            e.contains("layers.0.w") && e.contains("not whole blocks"),
            "{e}"
        );
        let e = WeightTensor::from_f32(vec![1, 256], &[0.5; 256])
            .convert(DType::Q6K, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no quantizer for q6_k"), "{e}");
    }
}
