//! `manifest.json`: what an artifact holds and how it was compiled.

use super::CpuTarget;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The manifest's name in the artifact directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The tokenizer's name in the artifact directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The weights' name in the artifact directory.
pub const WEIGHTS_FILE: &str = "weights.safetensors";

/// A file of the artifact with its size and checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// Lowercase hex sha256 of the content.
    pub sha256: String,
    /// For files of more than one [`CHECKSUM_CHUNK`]: the BLAKE3 ([`piece_digest`]) of each
    /// consecutive piece of that many bytes (the last one shorter), which a reader checks on
    /// every CPU at once instead of the whole file's sha256 on one. BLAKE3, not sha256: it
    /// hashes about three times as fast here (vector code, no SHA extensions needed), and
    /// these sums stand between a large model and its first token on every load.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunk_blake3: Vec<String>,
}

/// The bytes of each piece [`FileEntry::chunk_blake3`] hashes.
pub const CHECKSUM_CHUNK: u64 = 16 << 20;

/// The checksum of one piece of a file ([`FileEntry::chunk_blake3`]): its BLAKE3, lowercase
/// hex.
pub fn piece_digest(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// [`piece_digest`] of bytes that come in parts (a writer's).
#[derive(Clone, Default)]
pub struct PieceHasher(blake3::Hasher);

impl PieceHasher {
    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The digest of every byte added, as [`piece_digest`] gives it.
    pub fn finish(&self) -> String {
        self.0.finalize().to_hex().to_string()
    }
}

impl FileEntry {
    /// The pieces `chunk_blake3` should list for a file of `bytes` bytes (0 where the file
    /// is one piece or less, and is checked whole).
    pub fn chunks_for(bytes: u64) -> usize {
        if bytes > CHECKSUM_CHUNK {
            bytes.div_ceil(CHECKSUM_CHUNK) as usize
        } else {
            0
        }
    }
}

/// Batch limits the artifact was bounded for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSettings {
    /// Sequences per step, per replica.
    pub max_batch_size: u64,
    /// Longest context.
    pub max_seq_len: u64,
    /// Token budget of a step, per replica.
    pub max_batch_input_tokens: u64,
    /// Chunked prefill.
    pub enable_chunked_prefill: bool,
    /// Data-parallel replicas.
    pub data_parallel_degree: u64,
    /// Tokens per KV page.
    pub page_size: u64,
    /// Pages in each role's KV cache.
    pub kv_cache_pages: u64,
    /// Draft tokens a decoder step can verify (speculative decoding): steps return up to this
    /// many plus one logit rows per sequence.
    #[serde(default)]
    pub num_speculative_tokens: u64,
}

/// What a role's program needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleEntry {
    /// The bound of each dim the role's graph uses.
    pub dims: BTreeMap<String, u64>,
    /// Files of this role (program, code), relative to the artifact.
    pub program: String,
    /// The CPU code, where the artifact targets the CPU.
    pub cpu_code: Option<String>,
    /// The CUDA kernel entries (`cuda.bin`), where the artifact targets CUDA; `kernels.cu` and
    /// `module.ptx` sit beside it. Absent in CPU-only manifests.
    #[serde(default)]
    pub cuda_code: Option<String>,
    /// Arena bytes at the bounds.
    pub arena_bytes: u64,
    /// Kernels and launches.
    pub kernels: u64,
    /// Kernel calls per step.
    pub launches: u64,
}

/// Targets the artifact carries code for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Targets {
    /// The CPU target, where compiled for the CPU.
    #[serde(default)]
    pub cpu: Option<CpuTarget>,
    /// The CUDA target, where compiled for CUDA. Absent in CPU-only manifests.
    #[serde(default)]
    pub cuda: Option<super::CudaTarget>,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The artifact format ([`super::FORMAT_VERSION`]).
    pub format_version: u32,
    /// The maxc version that wrote it.
    pub maxc_version: String,
    /// The Hugging Face architecture name.
    pub architecture: String,
    /// config.json as read.
    pub config: serde_json::Value,
    /// The dtype weights were converted to.
    pub param_dtype: String,
    /// Batch limits.
    pub runtime: RuntimeSettings,
    /// Roles by name.
    pub roles: BTreeMap<String, RoleEntry>,
    /// Code targets.
    pub targets: Targets,
    /// What the architecture's deployment config records.
    pub export_records: BTreeMap<String, serde_json::Value>,
    /// Beginning-of-sequence token, where the config names one.
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    /// End-of-sequence tokens, where the config names them.
    #[serde(default)]
    pub eos_token_ids: Vec<i64>,
    /// The chat template (Jinja), where the checkpoint has one. Added after format 1's first
    /// artifacts: absent in older manifests.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Every other file of the artifact, by relative path.
    pub files: BTreeMap<String, FileEntry>,
}

#[cfg(test)]
mod tests {
    /// BLAKE3's published test vectors (the empty input and "abc").
    #[test]
    fn piece_digest_is_blake3() {
        assert_eq!(
            super::piece_digest(b""),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        assert_eq!(
            super::piece_digest(b"abc"),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
        let mut h = super::PieceHasher::default();
        h.update(b"a");
        h.update(b"bc");
        assert_eq!(h.finish(), super::piece_digest(b"abc"));
    }
}
