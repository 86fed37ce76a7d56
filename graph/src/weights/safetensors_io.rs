//! Reading checkpoints' safetensors files (single or sharded, memory-mapped) and writing
//! safetensors files.

use super::{StateDict, WeightTensor};
use crate::{DType, Error, Result};
use memmap2::Mmap;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Memory-maps one safetensors file and returns its tensors. A truncated file, a bad header or an
/// unsupported dtype is an error naming the file (and the key).
pub fn read_safetensors_file(path: &Path) -> Result<StateDict> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only; checkpoint files are not expected to change while maxc runs.
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
    let parsed = safetensors::SafeTensors::deserialize(&map)
        .map_err(|e| Error::checkpoint(path, format!("not a valid safetensors file: {e}")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&map)
        .map_err(|e| Error::checkpoint(path, format!("not a valid safetensors file: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let base = map.as_ptr() as usize;
    let mut out = StateDict::new();
    for (key, view) in parsed.tensors() {
        let (dtype, shape) = DType::of_safetensors_tensor(&key, view.dtype(), view.shape(), &meta)
            .map_err(|m| Error::checkpoint(path, m))?;
        let start = view.data().as_ptr() as usize - base;
        let end = start + view.data().len();
        out.insert(
            key,
            WeightTensor::mapped(dtype, shape, map.clone(), start, end),
        );
    }
    Ok(out)
}

/// The weights of a checkpoint folder: `model.safetensors`, or the shards that
/// `model.safetensors.index.json` names (every shard must exist and hold the keys the index puts
/// in it).
pub fn load_checkpoint_weights(dir: &Path) -> Result<StateDict> {
    let index_path = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let index: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(&index_path, format!("not valid JSON: {e}")))?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::config(
                    &index_path,
                    "weight_map",
                    "missing, expected an object of key -> shard file",
                )
            })?;
        let mut by_shard: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (key, shard) in map {
            let shard = shard.as_str().ok_or_else(|| {
                Error::config(
                    &index_path,
                    format!("weight_map.{key}"),
                    "expected a file name",
                )
            })?;
            if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
                return Err(Error::config(
                    &index_path,
                    format!("weight_map.{key}"),
                    format!("`{shard}` is not a plain file name"),
                ));
            }
            by_shard
                .entry(shard.to_string())
                .or_default()
                .insert(key.clone());
        }
        let mut out = StateDict::new();
        for (shard, keys) in by_shard {
            let path = dir.join(&shard);
            if !path.exists() {
                return Err(Error::checkpoint(
                    &path,
                    format!(
                        "shard named in {INDEX_FILE} (for {} weight(s), e.g. `{}`) is absent",
                        keys.len(),
                        keys.iter().next().map_or("", |k| k)
                    ),
                ));
            }
            let tensors = read_safetensors_file(&path)?;
            for key in &keys {
                if !tensors.contains(key) {
                    return Err(Error::checkpoint(
                        &path,
                        format!("{INDEX_FILE} puts `{key}` in this shard, but it is not there"),
                    ));
                }
            }
            for (key, t) in tensors {
                if keys.contains(&key) {
                    out.insert(key, t);
                }
            }
        }
        Ok(out)
    } else if single.exists() {
        read_safetensors_file(&single)
    } else {
        Err(Error::checkpoint(
            dir,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in the checkpoint folder"),
        ))
    }
}

/// Writes `tensors` to `path` as safetensors, with `metadata`.
pub fn write_safetensors(
    path: &Path,
    tensors: &StateDict,
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    write_safetensors_to(&mut out, tensors, metadata)
        .and_then(|_| std::io::Write::flush(&mut out).map_err(|e| e.to_string()))
        .map_err(|e| Error::checkpoint(path, format!("could not write safetensors: {e}")))
}

/// The layout of a safetensors file of `tensors` (the bytes `safetensors::serialize` gives:
/// tensors ordered by descending dtype, then key; the header built by the crate's `Metadata`
/// and padded to 8 bytes): the tensors in file order and the header's bytes.
struct Layout<'a> {
    order: Vec<(&'a String, &'a WeightTensor)>,
    header: Vec<u8>,
    data_bytes: u64,
}

fn layout(
    tensors: &StateDict,
    metadata: Option<BTreeMap<String, String>>,
) -> std::result::Result<Layout<'_>, String> {
    use safetensors::tensor::{Metadata, TensorInfo};
    let mut order: Vec<(&String, &WeightTensor)> = tensors.iter().collect();
    order.sort_by(|(a, x), (b, y)| {
        let (x, y) = (x.dtype.to_safetensors(), y.dtype.to_safetensors());
        y.cmp(&x).then(a.cmp(b))
    });
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    let mut metadata = metadata;
    for (key, t) in &order {
        let n = t.byte_len();
        let shape = t
            .dtype
            .stored_shape(&t.shape)
            .ok_or_else(|| format!("`{key}`: {}{:?} is not whole blocks", t.dtype, t.shape))?;
        if t.dtype.is_quantized() {
            metadata
                .get_or_insert_with(BTreeMap::new)
                .insert(DType::metadata_key(key), t.dtype.name().to_string());
        }
        infos.push((
            key.to_string(),
            TensorInfo {
                dtype: t.dtype.to_safetensors(),
                shape,
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let header = Metadata::new(metadata.map(|m| m.into_iter().collect()), infos)
        .map_err(|e| e.to_string())?;
    let mut header = serde_json::to_string(&header)
        .map_err(|e| e.to_string())?
        .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(Layout {
        order,
        header,
        data_bytes: offset as u64,
    })
}

/// Where each tensor's data starts in the safetensors file [`write_safetensors_to`] writes of
/// `tensors`, in bytes from the file's start.
pub fn safetensors_data_offsets(
    tensors: &StateDict,
    metadata: Option<BTreeMap<String, String>>,
) -> std::result::Result<BTreeMap<String, u64>, String> {
    let l = layout(tensors, metadata)?;
    let mut at = 8 + l.header.len() as u64;
    let mut out = BTreeMap::new();
    for (key, t) in &l.order {
        out.insert(key.to_string(), at);
        at += t.byte_len() as u64;
    }
    Ok(out)
}

/// Streams `tensors` as a safetensors file into `out` (the bytes `safetensors::serialize`
/// gives), one tensor at a time, so a caller can hash while writing and nothing is held twice.
/// Returns the bytes written.
pub fn write_safetensors_to(
    out: &mut impl std::io::Write,
    tensors: &StateDict,
    metadata: Option<BTreeMap<String, String>>,
) -> std::result::Result<u64, String> {
    let l = layout(tensors, metadata)?;
    let io = |e: std::io::Error| e.to_string();
    out.write_all(&(l.header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&l.header).map_err(io)?;
    for (key, t) in &l.order {
        t.write_to(out).map_err(|e| format!("`{key}`: {e}"))?;
    }
    Ok(8 + l.header.len() as u64 + l.data_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_files_are_the_crates_bytes() {
        let mut sd = StateDict::new();
        sd.insert(
            "b.f32",
            WeightTensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        );
        sd.insert(
            "a.bf16",
            WeightTensor::from_bytes(DType::BF16, vec![3], vec![1, 2, 3, 4, 5, 6]).unwrap(),
        );
        sd.insert(
            "c.i64",
            WeightTensor::from_bytes(DType::I64, vec![1], 7i64.to_le_bytes().to_vec()).unwrap(),
        );
        sd.insert("d.f32", WeightTensor::from_f32(vec![1], &[9.5]));
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        for metadata in [None, Some(meta)] {
            let mut ours = Vec::new();
            let n = write_safetensors_to(&mut ours, &sd, metadata.clone()).unwrap();
            let offsets = safetensors_data_offsets(&sd, metadata.clone()).unwrap();
            let views: Vec<(&String, safetensors::tensor::TensorView)> = sd
                .iter()
                .map(|(k, t)| {
                    let v = safetensors::tensor::TensorView::new(
                        t.dtype.to_safetensors(),
                        t.shape.clone(),
                        t.bytes(),
                    );
                    (k, v.unwrap())
                })
                .collect();
            let theirs =
                safetensors::serialize(views, metadata.map(|m| m.into_iter().collect())).unwrap();
            assert_eq!(ours, theirs);
            assert_eq!(n as usize, ours.len());
            let parsed = safetensors::SafeTensors::deserialize(&ours).unwrap();
            for (key, view) in parsed.tensors() {
                let at = view.data().as_ptr() as usize - ours.as_ptr() as usize;
                assert_eq!(offsets[&key], at as u64, "{key}");
            }
            assert_eq!(offsets.len(), sd.len());
        }
    }

    #[test]
    fn block_weights_round_trip_with_their_dtype_in_the_metadata() {
        let values: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let w = WeightTensor::from_f32(vec![2, 64], &values)
            .convert(DType::Q4_1, "w")
            .unwrap();
        let mut sd = StateDict::new();
        sd.insert("w", w.clone());
        sd.insert("n", WeightTensor::from_f32(vec![2], &[1.0, 2.0]));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write_safetensors(&path, &sd, None).unwrap();
        let back = read_safetensors_file(&path).unwrap();
        let r = back.get("w").unwrap();
        assert_eq!((r.dtype, r.shape.clone()), (DType::Q4_1, vec![2, 64]));
        assert_eq!(r.bytes(), w.bytes());
        assert_eq!(back.get("n").unwrap().dtype, DType::F32);
    }
}
