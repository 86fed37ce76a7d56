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
    let base = map.as_ptr() as usize;
    let mut out = StateDict::new();
    for (key, view) in parsed.tensors() {
        let dtype = DType::from_safetensors(view.dtype()).ok_or_else(|| {
            Error::checkpoint(
                path,
                format!(
                    "tensor `{key}` has dtype {:?}; maxc reads F32, F16, BF16, I32, I64",
                    view.dtype()
                ),
            )
        })?;
        let start = view.data().as_ptr() as usize - base;
        let end = start + view.data().len();
        out.insert(
            key,
            WeightTensor::mapped(dtype, view.shape().to_vec(), map.clone(), start, end),
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

/// Writes `tensors` (sorted by key) to `path` as safetensors, with `metadata`.
pub fn write_safetensors(
    path: &Path,
    tensors: &StateDict,
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    let views: Vec<(&String, &WeightTensor)> = tensors.iter().collect();
    let metadata = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize_to_file(views, metadata, path)
        .map_err(|e| Error::checkpoint(path, format!("could not write safetensors: {e}")))
}
