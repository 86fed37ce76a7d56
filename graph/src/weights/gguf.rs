//! A GGUF (v2, v3) reader: metadata, tensor infos, and tensors as stored (F32, F16, BF16, and
//! the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K). Every read is bounds-checked; a truncated file, an unknown tensor type or tensor data past the end of
//! the file is an error naming the file and what was being read.

use super::{StateDict, WeightTensor};
use crate::{DType, Error, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Unsigned integer (u8, u16, u32, u64).
    U64(u64),
    /// Signed integer (i8, i16, i32, i64).
    I64(i64),
    /// Float (f32, f64).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// As a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::U64(v) => Some(*v),
            GgufValue::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
    /// As a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::F64(v) => Some(*v),
            GgufValue::U64(v) => Some(*v as f64),
            GgufValue::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The maxc dtype of GGUF tensor type `id`, where maxc reads it.
fn dtype_of_ggml(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        _ => return None,
    })
}

/// One tensor's header.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// The GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dims, fastest first (GGUF order); the row-major shape is the reverse.
    pub dims: Vec<u64>,
    /// Storage type: a float type, or a block type kept as stored.
    pub ggml_type: DType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The row-major shape (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    /// The file.
    pub path: PathBuf,
    /// Format version.
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor headers, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    map: Arc<Mmap>,
    data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                Error::checkpoint(
                    self.path,
                    format!(
                        "truncated: {what} needs {n} bytes at offset {}, the file has {}",
                        self.pos,
                        self.bytes.len()
                    ),
                )
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    /// A count of items each at least `min_size` bytes, checked against what is left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_size as u64) > left {
            return Err(Error::checkpoint(
                self.path,
                format!(
                    "truncated or corrupt: {what} is {n}, more than the {left} bytes left can hold"
                ),
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| Error::checkpoint(self.path, format!("{what}: not UTF-8")))
    }
    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U64(self.take(1, what)?[0] as u64),
            1 => GgufValue::I64(self.take(1, what)?[0] as i8 as i64),
            2 => GgufValue::U64(
                u16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as u64,
            ),
            3 => GgufValue::I64(
                i16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as i64,
            ),
            4 => GgufValue::U64(self.u32(what)? as u64),
            5 => GgufValue::I64(self.u32(what)? as i32 as i64),
            6 => GgufValue::F64(
                f32::from_le_bytes(self.take(4, what)?.try_into().expect("4")) as f64,
            ),
            7 => GgufValue::Bool(self.take(1, what)?[0] != 0),
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth > 4 {
                    return Err(Error::checkpoint(
                        self.path,
                        format!("{what}: arrays nested too deep"),
                    ));
                }
                let inner = self.u32(what)?;
                let n = self.count(1, what)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_le_bytes(
                self.take(8, what)?.try_into().expect("8"),
            )),
            other => {
                return Err(Error::checkpoint(
                    self.path,
                    format!("{what}: unknown value type {other}"),
                ))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path` (memory-mapped; tensors are read on demand).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map; the file is not expected to change while maxc reads it.
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
        Self::parse(path, map)
    }

    fn parse(path: &Path, map: Arc<Mmap>) -> Result<Self> {
        let mut r = Reader {
            bytes: &map,
            pos: 0,
            path,
        };
        if r.take(4, "the magic")? != b"GGUF" {
            return Err(Error::checkpoint(path, "not a GGUF file (no GGUF magic)"));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::checkpoint(
                path,
                format!("GGUF version {version}; maxc reads versions 2 and 3"),
            ));
        }
        let n_tensors = r.count(24, "the tensor count")?;
        let n_kv = r.count(12, "the metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("metadata `{key}`"))?;
            let v = r.value(ty, &format!("metadata `{key}`"), 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor {i}'s name"))?;
            let what = format!("tensor `{name}`");
            let n_dims = r.u32(&what)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::checkpoint(
                    path,
                    format!("{what} has {n_dims} dims; expected 1 to 4"),
                ));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64(&what))
                .collect::<Result<Vec<_>>>()?;
            let type_id = r.u32(&what)?;
            let ggml_type = dtype_of_ggml(type_id).ok_or_else(|| {
                Error::checkpoint(path, format!("{what} has tensor type {type_id}; maxc reads F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), BF16 (30)"))
            })?;
            let offset = r.u64(&what)?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(GgufValue::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = r.pos.div_ceil(align) * align;
        let file = GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            map,
            data_start,
        };
        for t in &file.tensors {
            file.tensor_bytes(t)?;
        }
        Ok(file)
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The stored bytes of `t`, checked to lie inside the file.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        self.tensor_range(t).map(|r| &self.map[r])
    }

    /// Where `t`'s bytes are in the file, checked to lie inside it and to fit its dims.
    fn tensor_range(&self, t: &GgufTensorInfo) -> Result<std::ops::Range<usize>> {
        let elems = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let row_whole = t
            .dims
            .first()
            .is_some_and(|c| c % t.ggml_type.block().0 as u64 == 0);
        let bytes = elems
            .filter(|_| row_whole)
            .and_then(|e| t.ggml_type.bytes_for(e))
            .ok_or_else(|| {
                Error::checkpoint(
                    &self.path,
                    format!(
                        "tensor `{}` dims {:?} do not fit its type {:?}",
                        t.name, t.dims, t.ggml_type
                    ),
                )
            })?;
        let start = (self.data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.map.len() as u64 => Ok(s as usize..e as usize),
            _ => Err(Error::checkpoint(
                &self.path,
                format!(
                    "tensor `{}` data runs past the end of the file: needs {bytes} bytes at \
                     offset {} of the data section (which starts at byte {}), the file has {}",
                    t.name,
                    t.offset,
                    self.data_start,
                    self.map.len()
                ),
            )),
        }
    }

    /// Every tensor under its GGUF name, as stored (memory-mapped, not copied): float types
    /// and block types alike.
    pub fn state_dict(&self) -> Result<StateDict> {
        let mut out = StateDict::new();
        for t in &self.tensors {
            let range = self.tensor_range(t)?;
            out.insert(
                t.name.clone(),
                WeightTensor::mapped(
                    t.ggml_type,
                    t.shape(),
                    self.map.clone(),
                    range.start,
                    range.end,
                ),
            );
        }
        Ok(out)
    }
}
