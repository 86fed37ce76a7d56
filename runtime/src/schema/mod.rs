//! The artifact schema: the manifest (JSON), the per-role program (bincode 2) and the kernel IR.
//! The exporter writes these types; the runtime reads and validates them.

pub mod kernel;
pub mod manifest;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use kernel::{
    CudaLaunch, EwInput, EwInstr, GatherIndex, GridExtent, KernelBody, Rows, StepDim,
};
pub use manifest::{
    FileEntry, Manifest, RoleEntry, RuntimeSettings, Targets, MANIFEST_FILE, TOKENIZER_FILE,
    WEIGHTS_FILE,
};

/// The artifact format this runtime reads and the exporter writes.
pub const FORMAT_VERSION: u32 = 1;

/// Element type of a buffer or weight.
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
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
        }
    }

    /// The short name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

/// A dimension of a buffer's shape: fixed, or a step dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Extent {
    /// Known at compile time.
    Fixed(u64),
    /// A step dim; its bound is in the manifest.
    Step(StepDim),
}

/// Where a buffer's memory is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Storage {
    /// At `offset` in the program's arena (sized at the bounds).
    Arena {
        /// Byte offset, aligned to 64.
        offset: u64,
    },
    /// A weight in `weights.safetensors`, under `key` (the role's prefix included).
    Param {
        /// The weight's key.
        key: String,
    },
    /// A per-step input of the program.
    Input,
    /// The role's paged KV cache.
    KvCache,
    /// The KV cache seen from layer `layer`'s slot: `layer · 2 · page_size · kv_heads ·
    /// head_dim` elements past its start. Kernels given this view address it as layer 0 with the
    /// whole cache's page stride, so one kernel serves every layer.
    KvCacheLayer {
        /// The layer.
        layer: u64,
    },
    /// A rotary cos/sin table `[max_seq_len, 2, head_dim / 2]` that the runtime builds at load
    /// from `inv_freq` (entry `table` of [`Program::rope_tables`]).
    RopeTable {
        /// Index into `rope_tables`.
        table: u32,
    },
}

/// A buffer: a value of the program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    /// The graph node (or input, or weight) it holds.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<Extent>,
    /// Where it lives.
    pub storage: Storage,
}

/// A compiled kernel and where its code is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// Unique name within the program (`k003_rms_norm`).
    pub name: String,
    /// What it computes.
    pub body: KernelBody,
}

/// One kernel call of a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// Index into [`Program::kernels`].
    pub kernel: u32,
    /// Buffer ids, in the kernel's argument order.
    pub buffers: Vec<u32>,
    /// The graph nodes this call implements, for listings and diffs.
    pub nodes: Vec<String>,
}

/// A rotary table's parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeTable {
    /// Inverse frequencies (`head_dim / 2`).
    pub inv_freq: Vec<f32>,
}

/// Layout of a role's paged KV cache, `[pages, num_layers, 2, page_size, kv_heads, head_dim]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Layers.
    pub num_layers: u64,
    /// KV heads per layer.
    pub kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Element type.
    pub dtype: DType,
}

impl KvLayout {
    /// Bytes from one layer's slot to the next within a page (K and V of `page_size` tokens).
    pub fn layer_bytes(&self) -> u64 {
        2 * self.page_size * self.kv_heads * self.head_dim * self.dtype.size() as u64
    }
}

/// One role's compiled program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// The role (`decoder`, `draft`, ...).
    pub role: String,
    /// Every buffer; launches refer to them by index.
    pub buffers: Vec<Buffer>,
    /// Input buffers by input name (`tokens`, `input_row_offsets`, `cache_lengths`,
    /// `kv_lookup_table`, `kv_cache`, ...).
    pub inputs: BTreeMap<String, u32>,
    /// Output buffers by output name (`logits`).
    pub outputs: BTreeMap<String, u32>,
    /// The KV cache layout.
    pub kv: KvLayout,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: u64,
    /// Rotary tables the runtime builds at load.
    pub rope_tables: Vec<RopeTable>,
    /// Distinct kernels.
    pub kernels: Vec<Kernel>,
    /// The step: kernel calls in order.
    pub launches: Vec<Launch>,
    /// Arena size at the bounds, in bytes.
    pub arena_bytes: u64,
}

/// A role's native CPU code: every generated kernel's machine code in one blob.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuModule {
    /// The target the code was generated for.
    pub target: CpuTarget,
    /// Machine code, position independent and relocation free.
    pub code: Vec<u8>,
    /// Per kernel of the program: the offset of its entry in `code`, or `None` for a library
    /// kernel of the runtime.
    pub entries: Vec<Option<u64>>,
    /// Where set, generated matmuls run only for steps of 2 to this many rows, and the `gemm`
    /// library kernel runs the others (it wins on one row and on many). Absent in artifacts
    /// from before this field: generated matmuls then always run.
    #[serde(default)]
    pub generated_matmul_max_rows: Option<u64>,
}

/// A role's CUDA code: the PTX module (in `module.ptx` beside it) and each kernel's entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaModule {
    /// The target the PTX was compiled for.
    pub target: CudaTarget,
    /// Per kernel of the program, in the same order.
    pub kernels: Vec<CudaKernelEntry>,
}

/// A CUDA kernel: its function name in the PTX, launch configuration and ptxas resources.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaKernelEntry {
    /// The `extern "C" __global__` function's name.
    pub name: String,
    /// How it is launched.
    pub launch: CudaLaunch,
    /// Registers per thread (ptxas, for the target's SM).
    pub registers: u32,
    /// Bytes of register spill stores.
    pub spill_stores: u32,
    /// Bytes of register spill loads.
    pub spill_loads: u32,
    /// Static shared memory, in bytes.
    pub shared_bytes: u32,
}

/// A CUDA code-generation target.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CudaTarget {
    /// The SM the PTX was checked against (`sm_90`); the PTX is for its virtual arch.
    pub arch: String,
    /// NVRTC's version, `major.minor`.
    pub nvrtc_version: String,
}

/// A CPU code-generation target: architecture and the instruction-set features the code uses.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CpuTarget {
    /// `x86_64` or `aarch64`.
    pub arch: String,
    /// Features the code needs (`sse4.2`, ...), sorted.
    pub features: Vec<String>,
}

/// bincode 2's configuration for programs: standard, little endian, variable-width integers.
pub fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}
