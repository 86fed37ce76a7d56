//! maxc's artifact contract, the one crate that both the compiler and the runtime depend on:
//! element types and their safetensors mapping, the manifest (JSON), the per-role program
//! (bincode 2) with the kernel IR and [`Program::validate`], the per-step inputs with their one
//! check. Nothing here runs a kernel or holds state: the KV cache's page table, which builds the
//! step inputs, is the `maxc-kv` crate.

pub mod blocks;
pub mod dtype;
pub mod exp;
pub mod kernel;
pub mod manifest;
pub mod step;
pub mod target;
pub mod validate;

pub use dtype::{DType, KvDtype};
pub use step::{StepError, StepInputs, StepLimits};
pub use target::CpuTarget;
pub use validate::{ProgramEnv, ValidationError, WeightInfo};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use kernel::{
    CudaLaunch, EwInput, EwInstr, GatherIndex, GridExtent, GroupScore, KernelBody, KvView,
    RouterScoring, Rows, StepDim, GELU_TANH_CUBIC, GELU_TANH_SLOPE,
};
pub use manifest::{
    FileEntry, Manifest, RoleEntry, RuntimeSettings, Targets, MANIFEST_FILE, TOKENIZER_FILE,
    WEIGHTS_FILE,
};

/// The artifact format this runtime reads and the exporter writes. Bumped on any change to a
/// bincode type (bincode records no field names, so an older file cannot be read as a newer
/// type) and on any change to what the kernels of one artifact agree on with the runtime's
/// library kernels, such as the KV cache's layout (11: head-major pages); readers refuse every
/// other version and ask for a recompile.
pub const FORMAT_VERSION: u32 = 11;

/// Lowercase hex sha256 of `bytes`, as the manifest records files.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
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

impl Buffer {
    /// Its elements at the step dims `dims`.
    pub fn elements_at(&self, dims: &[u64; kernel::StepDim::COUNT]) -> u64 {
        self.shape
            .iter()
            .map(|e| match e {
                Extent::Fixed(n) => *n,
                Extent::Step(d) => dims[*d as usize],
            })
            .product()
    }
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

/// A rotary table's parameters: the one definition of the cos/sin rows that the interpreter
/// and both executors rotate with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeTable {
    /// Inverse frequencies (`rotary_dim / 2`).
    pub inv_freq: Vec<f32>,
    /// What cos and sin are multiplied by (longrope's attention factor; 1 otherwise).
    pub scale: f32,
    /// Other frequencies for positions from some position on (longrope's long factors).
    pub long: Option<LongFreqs>,
}

/// Frequencies a rotary table uses from position `from` on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LongFreqs {
    /// Inverse frequencies, as many as the table's.
    pub inv_freq: Vec<f32>,
    /// The first position that uses them.
    pub from: u64,
}

impl RopeTable {
    /// The table of `inv_freq`, unscaled.
    pub fn new(inv_freq: Vec<f32>) -> Self {
        RopeTable {
            inv_freq,
            scale: 1.0,
            long: None,
        }
    }

    /// Frequencies per row: `rotary_dim / 2`.
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// The frequencies position `pos` rotates with.
    pub fn freqs(&self, pos: u64) -> &[f32] {
        match &self.long {
            Some(l) if pos >= l.from => &l.inv_freq,
            _ => &self.inv_freq,
        }
    }

    /// Position `pos`'s `(cos, sin)` of frequency `i`: of the angle `pos · f` in f32, times
    /// the scale.
    pub fn cos_sin(&self, pos: u64, i: usize) -> (f32, f32) {
        let angle = pos as f32 * self.freqs(pos)[i];
        (angle.cos() * self.scale, angle.sin() * self.scale)
    }

    /// The rows for positions `0..max_seq_len`: `[max_seq_len, 2, half]` (cos, then sin).
    pub fn rows(&self, max_seq_len: usize) -> Vec<f32> {
        let half = self.half();
        let mut out = vec![0.0; max_seq_len * 2 * half];
        for (pos, row) in out.chunks_exact_mut(2 * half).enumerate() {
            for i in 0..half {
                let (c, s) = self.cos_sin(pos as u64, i);
                row[i] = c;
                row[half + i] = s;
            }
        }
        out
    }
}

/// Layout of a role's paged KV cache, `[pages, num_layers, planes, kv_heads, page_size,
/// row]` (head-major within a page, [`KvView`]; a row `head_dim` values in `dtype`, [`KvDtype::row_bytes`]): two planes (keys, then values), or one (multi-head latent attention's latent,
/// whose first elements are also its values).
///
/// The decoder's layers are split into [`KvGroup`]s of `num_layers` layers each, every group's
/// layers sharing one attention window. All groups draw pages from the one pool; a page holds
/// the keys and values of one group's layers (layer slot `i` of a page is the group's `i`-th
/// layer), and each group has its own lookup table (the step input [`kv_lookup_input`]), so a
/// sliding-window group can hand back the pages its window has left while a full-attention group
/// keeps all of a sequence's. A model whose layers all attend alike has one group of every layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Layer slots in a page: the layers of one group.
    pub num_layers: u64,
    /// KV heads per layer.
    pub kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// What each row is stored as.
    pub dtype: KvDtype,
    /// The page groups, in lookup-table order (at least one).
    pub groups: Vec<KvGroup>,
    /// Planes of a layer slot: 2 (keys and values) or 1 (a latent).
    pub planes: u64,
}

/// Layers of the KV cache that share pages and a lookup table: they attend over the same
/// positions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGroup {
    /// The sliding window of every layer in the group (`None`: full attention): a row at
    /// position `p` reads positions `p + 1 - window ..= p`.
    pub window: Option<u64>,
    /// The decoder layers in the group, by page slot.
    pub layers: Vec<u64>,
}

/// The name of group `group`'s lookup-table step input: `kv_lookup_table` for the first group,
/// `kv_lookup_table_{group}` for the others.
pub fn kv_lookup_input(group: usize) -> String {
    match group {
        0 => "kv_lookup_table".to_string(),
        g => format!("kv_lookup_table_{g}"),
    }
}

/// The group a lookup-table step input is for, where `name` is one ([`kv_lookup_input`]).
pub fn kv_lookup_group(name: &str) -> Option<usize> {
    match name.strip_prefix("kv_lookup_table")? {
        "" => Some(0),
        rest => {
            let g: usize = rest.strip_prefix('_')?.parse().ok()?;
            (g > 0 && kv_lookup_input(g) == name).then_some(g)
        }
    }
}

impl KvLayout {
    /// Bytes from one layer's slot to the next within a page (every plane of `page_size`
    /// tokens).
    pub fn layer_bytes(&self) -> u64 {
        self.planes * self.page_size * self.kv_heads * self.dtype.row_bytes(self.head_dim)
    }

    /// Page groups (at least 1).
    pub fn num_groups(&self) -> u64 {
        (self.groups.len() as u64).max(1)
    }

    /// Each group's window, in group order.
    pub fn windows(&self) -> Vec<Option<u64>> {
        if self.groups.is_empty() {
            vec![None]
        } else {
            self.groups.iter().map(|g| g.window).collect()
        }
    }

    /// Bytes one token's keys and values (or latent) take in every layer of every group.
    pub fn bytes_per_token(&self) -> u64 {
        self.num_groups()
            * self.planes
            * self.num_layers
            * self.kv_heads
            * self.dtype.row_bytes(self.head_dim)
    }

    /// Bytes of one page (one group's layers).
    pub fn page_bytes(&self) -> u64 {
        self.num_layers.saturating_mul(self.layer_bytes())
    }

    /// Pages one sequence of `len` tokens holds between steps: every page of its positions in
    /// a full-attention group, and in a sliding group the pages from the one holding position
    /// `len + 1 - window` on, the first its next row reads.
    pub fn pages_per_sequence(&self, len: u64) -> u64 {
        let ps = self.page_size.max(1);
        let all = len.div_ceil(ps);
        self.windows()
            .iter()
            .map(|w| match w {
                None => all,
                Some(w) => all - ((len + 1).saturating_sub(*w) / ps).min(all),
            })
            .sum()
    }

    /// Bytes the pages of one sequence of `len` tokens take ([`KvLayout::pages_per_sequence`]).
    pub fn bytes_per_sequence(&self, len: u64) -> u64 {
        self.pages_per_sequence(len)
            .saturating_mul(self.page_bytes())
    }

    /// Bytes of the whole cache at the bounds `dims` (its `total_num_pages` slot).
    pub fn cache_bytes(&self, dims: [u64; StepDim::COUNT]) -> u64 {
        dims[StepDim::TotalNumPages as usize].saturating_mul(self.page_bytes())
    }
}

/// The expert-parallel init program's contract: the role, its one input and its outputs.
///
/// The `ep_init` program runs once at load on each rank, with the rank's index in its input,
/// and its outputs are that rank's exchange state, kept for the life of the process: the
/// dispatch group (`dispatch_send`, `dispatch_recv`, `dispatch_counts`) and the combine group
/// (`combine_send`, `combine_recv`, `combine_counts`), so that dispatch and combine never share
/// a buffer in flight, and `local_experts`, the experts the rank holds.
pub mod ep_init {
    /// The role's name.
    pub const ROLE: &str = "ep_init";
    /// The input: the rank's index, i32 `[1]`.
    pub const RANK_INPUT: &str = "ep_rank";
    /// Slots a rank sends in one layer (`max_batch_active_tokens × top_k` of them), f32
    /// `[slots, hidden + 3]`: each slot is the token's hidden state, then its token row and its
    /// expert (u32 bit patterns), then its routing weight.
    pub const DISPATCH_SEND: &str = "dispatch_send";
    /// Slots a rank receives in one layer (`max_tokens_per_rank`), laid out as
    /// [`DISPATCH_SEND`].
    pub const DISPATCH_RECV: &str = "dispatch_recv";
    /// i32 `[2, degree]`: slots sent to each peer (row 0) and received from each (row 1).
    pub const DISPATCH_COUNTS: &str = "dispatch_counts";
    /// Expert outputs of the received slots, f32 `[max_tokens_per_rank, hidden]`.
    pub const COMBINE_SEND: &str = "combine_send";
    /// Expert outputs of the rank's own slots, in its send order, f32 `[slots, hidden]`.
    pub const COMBINE_RECV: &str = "combine_recv";
    /// i32 `[2, degree]`: as [`DISPATCH_COUNTS`], for the combine group.
    pub const COMBINE_COUNTS: &str = "combine_counts";
    /// i32 `[experts_per_rank]`: the experts the rank holds.
    pub const LOCAL_EXPERTS: &str = "local_experts";
    /// i32 `[num_shared_experts]`, only where the model has shared experts (DeepSeek's): the
    /// shared experts the rank holds, every one of them (`0..n`): they are replicated on every
    /// rank, which runs them on its own tokens, outside the exchange.
    pub const SHARED_EXPERTS: &str = "shared_experts";
    /// Every output, sorted.
    pub const OUTPUTS: [&str; 7] = [
        COMBINE_COUNTS,
        COMBINE_RECV,
        COMBINE_SEND,
        DISPATCH_COUNTS,
        DISPATCH_RECV,
        DISPATCH_SEND,
        LOCAL_EXPERTS,
    ];
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
    /// The KV cache layout; `None` for a program without a cache (the `ep_init` program).
    pub kv: Option<KvLayout>,
    /// Vocabulary size (rows of the token embedding; 0 without one).
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

impl Program {
    /// The f32 `[rows, width]` output `name` (as the decoder's `hidden_states`) at `bounds`:
    /// its buffer and its width, where the program has such an output and `rows` lie within
    /// its bound.
    pub fn row_output(
        &self,
        name: &str,
        bounds: &[u64; kernel::StepDim::COUNT],
        rows: &std::ops::Range<usize>,
    ) -> Option<(&Buffer, usize)> {
        let buf = &self.buffers[*self.outputs.get(name)? as usize];
        let extent = |e: &Extent| match e {
            Extent::Fixed(n) => *n as usize,
            Extent::Step(d) => bounds[*d as usize] as usize,
        };
        let [first, last] = buf.shape.as_slice() else {
            return None;
        };
        let (bound, width) = (extent(first), extent(last));
        (buf.dtype == DType::F32 && rows.end <= bound).then_some((buf, width))
    }

    /// Tokens per KV page (0 without a cache).
    pub fn page_size(&self) -> u64 {
        self.kv.as_ref().map_or(0, |kv| kv.page_size)
    }

    /// Bytes of the KV cache at the bounds `dims` (0 without a cache).
    pub fn kv_cache_bytes(&self, dims: [u64; StepDim::COUNT]) -> u64 {
        self.kv.as_ref().map_or(0, |kv| kv.cache_bytes(dims))
    }

    /// Bytes from one layer's slot of the cache to the next (0 without a cache).
    pub fn kv_layer_bytes(&self) -> u64 {
        self.kv.as_ref().map_or(0, KvLayout::layer_bytes)
    }
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
    /// Per kernel of the program: [`KernelBody::digest`] of the body the code was compiled
    /// from, so that code and program cannot disagree unnoticed.
    pub kernel_digests: Vec<[u8; 32]>,
    /// Where set, the runtime chooses: generated matmuls run at most for steps of 2 to this
    /// many rows, and only on CPUs where the library kernels have no register tiles (there the
    /// library wins at every row count); the library runs the others, and on those CPUs
    /// attention and fused elementwise kernels too. Where `None`, generated code always runs.
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
    /// [`KernelBody::digest`] of the body the PTX function was compiled from.
    pub kernel_digest: [u8; 32],
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

/// The most bytes a bincode file of the artifact may claim while decoding: a corrupt length
/// prefix is then an error, not an allocation of any size.
pub const BINCODE_LIMIT: usize = 1 << 28;

/// bincode 2's configuration for programs: standard, little endian, variable-width integers,
/// decoding limited to [`BINCODE_LIMIT`] bytes.
pub fn bincode_config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<BINCODE_LIMIT>,
> {
    bincode::config::standard().with_limit::<BINCODE_LIMIT>()
}
