//! [`Program::validate`]: the structural check of a program before any code is mapped or any
//! pointer computed. After it succeeds, an executor that allocates every buffer as
//! [`ProgramEnv`] describes (the arena at `arena_bytes`, inputs at their shapes at the bounds,
//! the KV cache at `total_num_pages` pages, rotary tables at `max_seq_len` rows) and runs only
//! steps that passed [`crate::StepInputs::checked_dims`] keeps every access of every kernel
//! inside its buffers:
//!
//! - every index (kernel, buffer, rotary table, KV layer) is in range, and every step dim a
//!   buffer or kernel uses has a bound;
//! - every launch passes its kernel's arity, each operand of the dtype and storage the kernel
//!   reads or writes, holding at least the elements the kernel touches at the bounds (kernels
//!   touch no more at smaller dims);
//! - operands that kernels index memory with are the step inputs that carry those indices
//!   (tokens, row offsets, cache lengths, the page table, checked per step) or positions that a
//!   `positions` kernel computed from them;
//! - arena buffers lie inside `arena_bytes`, aligned to [`ARENA_ALIGN`], are written before
//!   they are read, and never share bytes with another buffer while both are live (so computed
//!   positions reach the rotary kernel intact);
//! - weights exist with the dtype and element count the program declares, aligned for their
//!   dtype;
//! - every kernel's parameters agree with the KV layout and with themselves (GQA heads, even
//!   head dims, elementwise programs that refer to earlier instructions and existing inputs).
//!
//! The native code's agreement with the kernel bodies is checked with the code modules (their
//! per-kernel digests, [`crate::CpuModule::validate`], [`crate::CudaModule::validate`]).

use crate::kernel::{EwInstr, GatherIndex, GridExtent, KernelBody, KvView, Rows, StepDim};
use crate::{CpuModule, CudaModule, DType, Extent, Program, Storage};
use std::collections::BTreeMap;

/// Alignment of every arena offset, in bytes.
pub const ARENA_ALIGN: u64 = 64;

/// A weight of the artifact as the validator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightInfo {
    /// Element type.
    pub dtype: DType,
    /// Elements.
    pub elements: u64,
    /// Byte offset of its data in the (page-aligned) weights file.
    pub offset: u64,
}

/// What a program is validated against: the manifest's numbers for its role and the weights.
#[derive(Clone, Debug)]
pub struct ProgramEnv<'a> {
    /// The bound of each dim, by name (the manifest's role entry).
    pub dims: &'a BTreeMap<String, u64>,
    /// Longest context: rows of the rotary tables.
    pub max_seq_len: u64,
    /// Tokens per KV page (the manifest's runtime settings).
    pub page_size: u64,
    /// Arena bytes (the manifest's role entry).
    pub arena_bytes: u64,
    /// Weights by key.
    pub weights: &'a BTreeMap<String, WeightInfo>,
}

/// A program that breaks a rule of the schema; the message names the launch, kernel, buffer or
/// field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValidationError(pub String);

fn err<T>(m: impl Into<String>) -> Result<T, ValidationError> {
    Err(ValidationError(m.into()))
}

/// How a kernel uses one operand.
#[derive(Clone, Copy, Debug)]
enum Use {
    /// Reads (or writes, where `write`) `elements` values of `dtype`.
    Values {
        dtype: DType,
        elements: u64,
        write: bool,
    },
    /// Reads the step input `name` to index memory.
    Input(&'static str),
    /// Reads positions (i64, `elements`) to index a rotary table.
    Positions { elements: u64 },
    /// Reads rotary table rows of `half` frequencies.
    RopeTable { half: u64 },
    /// Reads or writes the KV cache through a view at the kernel's `layer`.
    KvCache { layer: u64 },
}

/// The step inputs an executor binds by name: dtype and shape.
pub const STEP_INPUTS: [(&str, DType, &[StepDim]); 6] = [
    ("tokens", DType::I64, &[StepDim::TotalSeqLen]),
    (
        "input_row_offsets",
        DType::I32,
        &[StepDim::InputRowOffsetsLen],
    ),
    ("cache_lengths", DType::I32, &[StepDim::BatchSize]),
    (
        "kv_lookup_table",
        DType::I32,
        &[StepDim::BatchSize, StepDim::MaxNumPages],
    ),
    ("batch_context_lengths", DType::I32, &[StepDim::BatchSize]),
    ("logit_indices", DType::I32, &[StepDim::LogitRows]),
];

struct Ctx<'a> {
    p: &'a Program,
    bounds: [Option<u64>; StepDim::COUNT],
}

impl Ctx<'_> {
    fn bound(&self, d: StepDim, what: &str) -> Result<u64, ValidationError> {
        self.bounds[d as usize].ok_or_else(|| {
            ValidationError(format!(
                "{what} uses dim `{}`, which the manifest does not bound",
                d.name()
            ))
        })
    }
    fn rows(&self, r: &Rows, what: &str) -> Result<u64, ValidationError> {
        match r {
            Rows::Fixed(n) => Ok(*n),
            Rows::Step(d) => self.bound(*d, what),
        }
    }
    fn elements(&self, shape: &[Extent], what: &str) -> Result<u64, ValidationError> {
        shape.iter().try_fold(1u64, |n, e| {
            let x = match e {
                Extent::Fixed(x) => *x,
                Extent::Step(d) => self.bound(*d, what)?,
            };
            n.checked_mul(x)
                .ok_or_else(|| ValidationError(format!("{what}: element count overflows")))
        })
    }
}

fn mul(xs: &[u64], what: &str) -> Result<u64, ValidationError> {
    xs.iter().try_fold(1u64, |n, &x| {
        n.checked_mul(x)
            .ok_or_else(|| ValidationError(format!("{what}: size overflows")))
    })
}

fn float(d: DType, what: &str) -> Result<(), ValidationError> {
    if d.is_float() {
        Ok(())
    } else {
        err(format!("{what} is {d}, expected a float type"))
    }
}

fn real(d: DType, what: &str) -> Result<(), ValidationError> {
    if d.is_real() {
        Ok(())
    } else {
        err(format!("{what} is {d}, expected a float or block type"))
    }
}

impl Program {
    /// Checks the program against the schema's rules (see the module docs) and `env`; the
    /// error names the launch, kernel, buffer or field at fault.
    pub fn validate(&self, env: &ProgramEnv) -> Result<(), ValidationError> {
        let mut bounds = [None; StepDim::COUNT];
        for d in StepDim::ALL {
            bounds[d as usize] = env.dims.get(d.name()).copied();
        }
        let cx = Ctx { p: self, bounds };
        if self.arena_bytes != env.arena_bytes {
            return err(format!(
                "arena_bytes is {}, the manifest says {}",
                self.arena_bytes, env.arena_bytes
            ));
        }
        self.validate_kv(env)?;
        let allocated = self.validate_buffers(&cx, env)?;
        for (i, k) in self.kernels.iter().enumerate() {
            validate_body(&k.body, self, env)
                .map_err(|e| ValidationError(format!("kernel {i} ({}): {e}", k.name)))?;
        }
        self.validate_launches(&cx, &allocated)?;
        self.validate_outputs()?;
        Ok(())
    }

    fn validate_kv(&self, env: &ProgramEnv) -> Result<(), ValidationError> {
        let Some(kv) = &self.kv else {
            if self.role == crate::ep_init::ROLE {
                return Ok(());
            }
            return err(format!(
                "the {} program has no KV layout (only the {} program runs without a cache)",
                self.role,
                crate::ep_init::ROLE
            ));
        };
        kv.dtype
            .check_head_dim(kv.head_dim)
            .map_err(|e| ValidationError(format!("kv: {e}")))?;
        if kv.page_size != env.page_size {
            return err(format!(
                "kv.page_size is {}, the manifest's page size is {}",
                kv.page_size, env.page_size
            ));
        }
        for (name, v) in [
            ("num_layers", kv.num_layers),
            ("kv_heads", kv.kv_heads),
            ("head_dim", kv.head_dim),
            ("page_size", kv.page_size),
        ] {
            if v == 0 {
                return err(format!("kv.{name} is 0"));
            }
        }
        if kv.groups.is_empty() {
            return err("kv.groups is empty; a cache has at least one page group".to_string());
        }
        let mut seen = std::collections::BTreeSet::new();
        for (g, group) in kv.groups.iter().enumerate() {
            if group.layers.len() as u64 != kv.num_layers {
                return err(format!(
                    "kv.groups[{g}] has {} layers, a page holds {}",
                    group.layers.len(),
                    kv.num_layers
                ));
            }
            if group.window == Some(0) {
                return err(format!("kv.groups[{g}].window is 0"));
            }
            if let Some(l) = group.layers.iter().find(|&&l| !seen.insert(l)) {
                return err(format!("kv.groups[{g}]: layer {l} is in two groups"));
            }
        }
        let pages = env
            .dims
            .get(StepDim::TotalNumPages.name())
            .copied()
            .unwrap_or(0);
        mul(
            &[
                pages,
                kv.num_layers,
                2,
                kv.page_size,
                kv.kv_heads,
                kv.head_dim,
                4,
            ],
            "the KV cache",
        )?;
        Ok(())
    }

    /// Checks each buffer on its own; returns the elements allocated for each (0 for the KV
    /// cache and rotary tables, which only their own operand kinds may use).
    fn validate_buffers(&self, cx: &Ctx, env: &ProgramEnv) -> Result<Vec<u64>, ValidationError> {
        let mut allocated = Vec::with_capacity(self.buffers.len());
        for (id, b) in self.buffers.iter().enumerate() {
            let what = format!("buffer {id} ({})", b.name);
            let elements = cx.elements(&b.shape, &what)?;
            let bytes = b.dtype.bytes_for(elements).ok_or_else(|| {
                ValidationError(format!(
                    "{what}: {elements} {} elements overflow or are not whole blocks",
                    b.dtype
                ))
            })?;
            let rows_whole = match b.shape.last() {
                Some(Extent::Fixed(c)) => c.is_multiple_of(b.dtype.block().0 as u64),
                _ => !b.dtype.is_quantized(),
            };
            if !rows_whole {
                return err(format!(
                    "{what}: {} rows must be a fixed whole number of blocks",
                    b.dtype
                ));
            }
            let n = match &b.storage {
                Storage::Arena { offset } => {
                    if offset % ARENA_ALIGN != 0 {
                        return err(format!(
                            "{what}: arena offset {offset} is not a multiple of {ARENA_ALIGN}"
                        ));
                    }
                    if offset
                        .checked_add(bytes)
                        .is_none_or(|e| e > self.arena_bytes)
                    {
                        return err(format!(
                            "{what}: {bytes} bytes at arena offset {offset} end past arena_bytes {}",
                            self.arena_bytes
                        ));
                    }
                    elements
                }
                Storage::Param { key } => {
                    let Some(w) = env.weights.get(key) else {
                        return err(format!("{what}: no weight `{key}` in the weights file"));
                    };
                    if w.dtype != b.dtype || w.elements != elements {
                        return err(format!(
                            "{what}: weight `{key}` is {} × {}, the program declares {} × {elements}",
                            w.dtype, w.elements, b.dtype
                        ));
                    }
                    if w.offset % b.dtype.align() as u64 != 0 {
                        return err(format!(
                            "{what}: weight `{key}` starts at byte {}, not aligned to its {}-byte elements",
                            w.offset,
                            b.dtype.align()
                        ));
                    }
                    elements
                }
                Storage::Input if b.name == crate::ep_init::RANK_INPUT => {
                    let want = [Extent::Fixed(1)];
                    if self.role != crate::ep_init::ROLE
                        || b.dtype != DType::I32
                        || b.shape != want
                        || self.inputs.get(&b.name) != Some(&(id as u32))
                    {
                        return err(format!(
                            "{what}: `{}` is the {} program's input, i32 [1]; here it is {} {:?} in the {} program",
                            b.name,
                            crate::ep_init::ROLE,
                            b.dtype,
                            b.shape,
                            self.role
                        ));
                    }
                    1
                }
                Storage::Input => {
                    // A page group's lookup table is bound like the first group's.
                    let groups = self.kv.as_ref().map_or(1, |kv| kv.num_groups());
                    let lookup_group = crate::kv_lookup_group(&b.name);
                    if lookup_group.is_some_and(|g| g as u64 >= groups) {
                        return err(format!(
                            "{what}: `{}` is the lookup table of a page group past the cache's {groups}",
                            b.name
                        ));
                    }
                    let spec_name = if lookup_group.is_some() {
                        "kv_lookup_table"
                    } else {
                        b.name.as_str()
                    };
                    let Some((_, dtype, dims)) =
                        STEP_INPUTS.iter().find(|(n, _, _)| *n == spec_name)
                    else {
                        return err(format!(
                            "{what}: `{}` is not a step input (expected one of {})",
                            b.name,
                            STEP_INPUTS.map(|s| s.0).join(", ")
                        ));
                    };
                    let want: Vec<Extent> = dims.iter().map(|d| Extent::Step(*d)).collect();
                    if b.dtype != *dtype || b.shape != want {
                        return err(format!(
                            "{what}: step input `{}` must be {dtype} {want:?}, is {} {:?}",
                            b.name, b.dtype, b.shape
                        ));
                    }
                    if self.inputs.get(&b.name) != Some(&(id as u32)) {
                        return err(format!("{what}: not the program's input `{}`", b.name));
                    }
                    elements
                }
                Storage::KvCache if self.kv.is_none() => {
                    return err(format!("{what}: the KV cache of a program without one"))
                }
                Storage::KvCache => 0,
                Storage::KvCacheLayer { layer } => {
                    let layers = self.kv.as_ref().map_or(0, |kv| kv.num_layers);
                    if *layer >= layers {
                        return err(format!(
                            "{what}: KV layer {layer}, the cache has {layers} layers"
                        ));
                    }
                    0
                }
                Storage::RopeTable { table } => {
                    if *table as usize >= self.rope_tables.len() {
                        return err(format!(
                            "{what}: rotary table {table}, the program has {}",
                            self.rope_tables.len()
                        ));
                    }
                    mul(
                        &[
                            env.max_seq_len,
                            2,
                            self.rope_tables[*table as usize].inv_freq.len() as u64,
                        ],
                        &what,
                    )?;
                    0
                }
            };
            allocated.push(n);
        }
        for (name, &id) in &self.inputs {
            let ok = self.buffers.get(id as usize).is_some_and(|b| {
                (b.storage == Storage::Input && &b.name == name)
                    || (b.storage == Storage::KvCache && name == "kv_cache")
            });
            if !ok {
                return err(format!(
                    "input `{name}` is buffer {id}, which is neither the KV cache nor a step input of that name"
                ));
            }
        }
        Ok(allocated)
    }

    fn validate_launches(&self, cx: &Ctx, allocated: &[u64]) -> Result<(), ValidationError> {
        // Lifetimes of arena buffers: (first write, last use).
        let mut live: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
        let mut positions_writers: BTreeMap<u32, bool> = BTreeMap::new();
        for (li, l) in self.launches.iter().enumerate() {
            let Some(kernel) = self.kernels.get(l.kernel as usize) else {
                return err(format!(
                    "launch {li}: kernel {} of {}",
                    l.kernel,
                    self.kernels.len()
                ));
            };
            let what = format!("launch {li} ({})", kernel.name);
            let uses = operand_uses(&kernel.body, cx, &what)?;
            if l.buffers.len() != uses.len() {
                return err(format!(
                    "{what}: {} buffers, the {} kernel takes {}",
                    l.buffers.len(),
                    kernel.body.kind(),
                    uses.len()
                ));
            }
            for (slot, (&id, u)) in l.buffers.iter().zip(&uses).enumerate() {
                let Some(b) = self.buffers.get(id as usize) else {
                    return err(format!(
                        "{what}: operand {slot} is buffer {id} of {}",
                        self.buffers.len()
                    ));
                };
                let at = format!("{what}: operand {slot} (buffer {id}, {})", b.name);
                check_use(self, b, allocated[id as usize], u, &at)?;
                let write = matches!(u, Use::Values { write: true, .. });
                if let Storage::Arena { .. } = b.storage {
                    match live.get_mut(&id) {
                        Some(l) => l.1 = li,
                        None if write => {
                            live.insert(id, (li, li));
                        }
                        None => return err(format!("{at}: read before any launch writes it")),
                    }
                }
                if write {
                    let by_positions = matches!(kernel.body, KernelBody::Positions);
                    let all = positions_writers.entry(id).or_insert(by_positions);
                    *all &= by_positions;
                    if l.buffers
                        .iter()
                        .enumerate()
                        .any(|(s, &o)| s != slot && o == id)
                    {
                        return err(format!("{at}: written while the launch also reads it"));
                    }
                }
                if let Use::Positions { .. } = u {
                    if positions_writers.get(&id) != Some(&true) {
                        return err(format!(
                            "{at}: positions must come from a positions kernel alone"
                        ));
                    }
                }
            }
        }
        let end = self.launches.len();
        for &id in self.outputs.values() {
            if let Some(l) = live.get_mut(&id) {
                l.1 = end;
            }
        }
        // No two buffers share arena bytes while both are live.
        let mut spans: Vec<(u64, u64, usize, usize, u32)> = Vec::new();
        for (&id, &(s, e)) in &live {
            if let Storage::Arena { offset } = self.buffers[id as usize].storage {
                let b = &self.buffers[id as usize];
                let bytes = allocated[id as usize] * b.dtype.size() as u64;
                spans.push((offset, offset + bytes, s, e, id));
            }
        }
        spans.sort_unstable();
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                if b.0 >= a.1 {
                    break;
                }
                if a.2 <= b.3 && b.2 <= a.3 && a.0 < a.1 && b.0 < b.1 {
                    return err(format!(
                        "buffers {} ({}) and {} ({}) share arena bytes while both are live (launches {}..={} and {}..={})",
                        a.4,
                        self.buffers[a.4 as usize].name,
                        b.4,
                        self.buffers[b.4 as usize].name,
                        a.2,
                        a.3,
                        b.2,
                        b.3
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_outputs(&self) -> Result<(), ValidationError> {
        if self.role == crate::ep_init::ROLE {
            return self.validate_ep_init_outputs();
        }
        let Some(&id) = self.outputs.get("logits") else {
            return err("the program has no `logits` output");
        };
        for (name, &o) in &self.outputs {
            if self.buffers.get(o as usize).is_none() {
                return err(format!(
                    "output `{name}` is buffer {o} of {}",
                    self.buffers.len()
                ));
            }
        }
        let b = &self.buffers[id as usize];
        let shape_ok = b.shape.len() == 2 && b.shape[1] == Extent::Fixed(self.vocab_size);
        if !matches!(b.storage, Storage::Arena { .. }) || b.dtype != DType::F32 || !shape_ok {
            return err(format!(
                "output `logits` (buffer {id}) must be an f32 arena buffer [rows, {}], is {} {:?} in {:?}",
                self.vocab_size, b.dtype, b.shape, b.storage
            ));
        }
        let written = self.launches.iter().any(|l| l.buffers.last() == Some(&id));
        if !written {
            return err(format!("output `logits` (buffer {id}) is never written"));
        }
        Ok(())
    }
}

impl Program {
    /// The `ep_init` program's outputs are exactly [`crate::ep_init::OUTPUTS`] (and
    /// [`crate::ep_init::SHARED_EXPERTS`] where the model has shared experts), each an arena
    /// buffer that a launch writes (the exchange state handed to the runtime).
    fn validate_ep_init_outputs(&self) -> Result<(), ValidationError> {
        let names: Vec<&str> = self
            .outputs
            .keys()
            .map(String::as_str)
            .filter(|n| *n != crate::ep_init::SHARED_EXPERTS)
            .collect();
        if names != crate::ep_init::OUTPUTS {
            return err(format!(
                "the {} program's outputs are {names:?}, expected {:?}",
                crate::ep_init::ROLE,
                crate::ep_init::OUTPUTS
            ));
        }
        for (name, &o) in &self.outputs {
            let Some(b) = self.buffers.get(o as usize) else {
                return err(format!(
                    "output `{name}` is buffer {o} of {}",
                    self.buffers.len()
                ));
            };
            if !matches!(b.storage, Storage::Arena { .. }) {
                return err(format!(
                    "output `{name}` (buffer {o}) must be an arena buffer, is in {:?}",
                    b.storage
                ));
            }
            if !self.launches.iter().any(|l| l.buffers.last() == Some(&o)) {
                return err(format!("output `{name}` (buffer {o}) is never written"));
            }
        }
        Ok(())
    }
}

/// Checks that buffer `b` (with `allocated` elements) can serve as an operand used as `u`.
fn check_use(
    p: &Program,
    b: &crate::Buffer,
    allocated: u64,
    u: &Use,
    at: &str,
) -> Result<(), ValidationError> {
    match *u {
        Use::Values {
            dtype,
            elements,
            write,
        } => {
            let storage_ok = match b.storage {
                Storage::Arena { .. } => true,
                Storage::Param { .. } | Storage::Input => !write,
                _ => false,
            };
            if !storage_ok {
                return err(format!(
                    "{at}: the kernel {} values here, not in {:?}",
                    if write { "writes" } else { "reads" },
                    b.storage
                ));
            }
            if b.dtype != dtype {
                return err(format!("{at}: is {}, the kernel reads {dtype}", b.dtype));
            }
            if dtype.is_quantized() && !matches!(b.storage, Storage::Param { .. }) {
                return err(format!("{at}: {dtype} blocks are read only from weights"));
            }
            if allocated < elements {
                return err(format!(
                    "{at}: holds {allocated} elements at the bounds, the kernel touches {elements}"
                ));
            }
        }
        Use::Input(name) => {
            // Any page group's lookup table stands where the first group's is named.
            let same = b.name == name
                || (name == "kv_lookup_table" && crate::kv_lookup_group(&b.name).is_some());
            if b.storage != Storage::Input || !same {
                return err(format!("{at}: must be the step input `{name}`"));
            }
        }
        Use::Positions { elements } => {
            if !matches!(b.storage, Storage::Arena { .. }) || b.dtype != DType::I64 {
                return err(format!("{at}: positions must be an i64 arena buffer"));
            }
            if allocated < elements {
                return err(format!(
                    "{at}: holds {allocated} positions at the bounds, the kernel reads {elements}"
                ));
            }
        }
        Use::RopeTable { half } => {
            let Storage::RopeTable { table } = b.storage else {
                return err(format!("{at}: must be a rotary table"));
            };
            let have = p.rope_tables[table as usize].inv_freq.len() as u64;
            if have != half {
                return err(format!(
                    "{at}: rotary table {table} has {have} frequencies, the kernel reads {half}"
                ));
            }
        }
        Use::KvCache { layer } => {
            let view = match b.storage {
                Storage::KvCache => 0,
                Storage::KvCacheLayer { layer } => layer,
                _ => return err(format!("{at}: must be the KV cache")),
            };
            let layers = p.kv.as_ref().map_or(0, |kv| kv.num_layers);
            if view + layer >= layers {
                return err(format!(
                    "{at}: layer {layer} of a view at layer {view} is past the cache's {layers} layers"
                ));
            }
        }
    }
    Ok(())
}

/// Each operand of `body`, in buffer order, with what the kernel touches at the bounds.
fn operand_uses(body: &KernelBody, cx: &Ctx, what: &str) -> Result<Vec<Use>, ValidationError> {
    let t = || cx.bound(StepDim::TotalSeqLen, what);
    let f32s = |elements: u64, write: bool| Use::Values {
        dtype: DType::F32,
        elements,
        write,
    };
    let vals = |dtype: DType, elements: u64| Use::Values {
        dtype,
        elements,
        write: false,
    };
    Ok(match body {
        KernelBody::Gather {
            rows,
            cols,
            index,
            src_dtype,
            ..
        } => {
            if matches!(index, GatherIndex::LogitRows) && *rows != Rows::Step(StepDim::LogitRows) {
                return err(format!(
                    "{what}: a logit-rows gather runs over logit_rows rows, not {rows:?}"
                ));
            }
            let rows = cx.rows(rows, what)?;
            let (src, idx) = match index {
                GatherIndex::Tokens => (
                    vals(*src_dtype, mul(&[cx.p.vocab_size, *cols], what)?),
                    Use::Input("tokens"),
                ),
                GatherIndex::LogitRows => (
                    // The step check holds every index below total_seq_len.
                    vals(*src_dtype, mul(&[t()?, *cols], what)?),
                    Use::Input("logit_indices"),
                ),
            };
            if matches!(index, GatherIndex::Tokens) && rows > t()? {
                return err(format!(
                    "{what}: gathers {rows} tokens, above total_seq_len's bound"
                ));
            }
            vec![src, idx, f32s(mul(&[rows, *cols], what)?, true)]
        }
        KernelBody::Positions => vec![
            Use::Input("input_row_offsets"),
            Use::Input("cache_lengths"),
            Use::Values {
                dtype: DType::I64,
                elements: t()?,
                write: true,
            },
        ],
        KernelBody::RmsNorm {
            rows,
            cols,
            width,
            residual,
            weight_dtype,
            ..
        } => {
            let n = mul(&[cx.rows(rows, what)?, *cols], what)?;
            let w = vals(*weight_dtype, *width);
            if *residual {
                vec![
                    f32s(n, false),
                    f32s(n, false),
                    w,
                    f32s(n, true),
                    f32s(n, true),
                ]
            } else {
                vec![f32s(n, false), w, f32s(n, true)]
            }
        }
        KernelBody::Elementwise {
            rows, cols, inputs, ..
        } => {
            let n = mul(&[cx.rows(rows, what)?, *cols], what)?;
            let mut v: Vec<Use> = inputs
                .iter()
                .map(|i| vals(i.dtype, if i.broadcast { *cols } else { n }))
                .collect();
            v.push(f32s(n, true));
            v
        }
        KernelBody::Rope {
            heads,
            head_dim,
            rotary_dim,
        } => {
            let n = mul(&[t()?, *heads, *head_dim], what)?;
            vec![
                f32s(n, false),
                Use::Positions { elements: t()? },
                Use::RopeTable {
                    half: rotary_dim / 2,
                },
                f32s(n, true),
            ]
        }
        KernelBody::KvStore {
            layer,
            kv_heads,
            head_dim,
            planes,
            ..
        } => {
            let n = mul(&[t()?, *kv_heads, *head_dim], what)?;
            let mut v = vec![f32s(n, false)];
            if *planes == 2 {
                v.push(f32s(n, false));
            }
            v.extend([
                Use::KvCache { layer: *layer },
                Use::Input("kv_lookup_table"),
                Use::Input("cache_lengths"),
                Use::Input("input_row_offsets"),
            ]);
            v
        }
        KernelBody::Attention {
            layer,
            heads,
            head_dim,
            value_dim,
            ..
        } => {
            let n = mul(&[t()?, *heads, *head_dim], what)?;
            let out = mul(&[t()?, *heads, *value_dim], what)?;
            vec![
                f32s(n, false),
                Use::KvCache { layer: *layer },
                Use::Input("kv_lookup_table"),
                Use::Input("cache_lengths"),
                Use::Input("input_row_offsets"),
                f32s(out, true),
            ]
        }
        KernelBody::DecompressedAttention {
            layer,
            heads,
            head_dim,
            rope,
            nope,
            value,
            weight_dtype,
            ..
        } => {
            let lat = head_dim.saturating_sub(*rope);
            vec![
                f32s(mul(&[t()?, *heads, *nope], what)?, false),
                f32s(mul(&[t()?, *heads, *rope], what)?, false),
                vals(*weight_dtype, mul(&[*heads, lat, *nope], what)?),
                vals(*weight_dtype, mul(&[*heads, *value, lat], what)?),
                Use::KvCache { layer: *layer },
                Use::Input("kv_lookup_table"),
                Use::Input("cache_lengths"),
                Use::Input("input_row_offsets"),
                Use::Input("batch_context_lengths"),
                f32s(mul(&[t()?, *heads, *value], what)?, true),
            ]
        }
        KernelBody::Concat { rows, groups, a, b } => {
            let r = cx.rows(rows, what)?;
            let wide = a
                .checked_add(*b)
                .ok_or_else(|| ValidationError(format!("{what}: widths overflow")))?;
            vec![
                f32s(mul(&[r, *groups, *a], what)?, false),
                f32s(mul(&[r, *groups, *b], what)?, false),
                f32s(mul(&[r, *groups, wide], what)?, true),
            ]
        }
        KernelBody::HeadMatmul {
            rows,
            heads,
            n,
            k,
            weight_dtype,
        } => {
            let r = cx.rows(rows, what)?;
            vec![
                f32s(mul(&[r, *heads, *k], what)?, false),
                vals(*weight_dtype, mul(&[*heads, *n, *k], what)?),
                f32s(mul(&[r, *heads, *n], what)?, true),
            ]
        }
        KernelBody::MoeRouter {
            rows,
            experts,
            bias_dtype,
            ..
        } => {
            let n = mul(&[cx.rows(rows, what)?, *experts], what)?;
            vec![f32s(n, false), vals(*bias_dtype, *experts), f32s(n, true)]
        }
        KernelBody::Softmax { rows, cols } | KernelBody::TopK { rows, cols, .. } => {
            let n = mul(&[cx.rows(rows, what)?, *cols], what)?;
            vec![f32s(n, false), f32s(n, true)]
        }
        KernelBody::Matmul {
            rows,
            n,
            k,
            weight_dtype,
            bias,
        } => {
            let rows = cx.rows(rows, what)?;
            let mut v = vec![
                f32s(mul(&[rows, *k], what)?, false),
                vals(*weight_dtype, mul(&[*n, *k], what)?),
            ];
            if *bias {
                v.push(vals(*weight_dtype, *n));
            }
            v.push(f32s(mul(&[rows, *n], what)?, true));
            v
        }
        KernelBody::MoeExperts {
            rows,
            hidden,
            ffn,
            experts,
            weight_dtype,
        } => {
            let rows = cx.rows(rows, what)?;
            let mut v = vec![
                f32s(mul(&[rows, *hidden], what)?, false),
                f32s(mul(&[rows, *experts], what)?, false),
            ];
            let w = mul(&[*hidden, *ffn], what)?;
            if *experts > 4096 {
                return err(format!("{what}: {experts} experts"));
            }
            for _ in 0..*experts {
                v.extend([
                    vals(*weight_dtype, w),
                    vals(*weight_dtype, w),
                    vals(*weight_dtype, w),
                ]);
            }
            v.push(f32s(mul(&[rows, *hidden], what)?, true));
            v
        }
        KernelBody::Zeros { elements, dtype } => vec![Use::Values {
            dtype: *dtype,
            elements: *elements,
            write: true,
        }],
        KernelBody::AllReduce { rows, cols } => {
            let n = mul(&[cx.rows(rows, what)?, *cols], what)?;
            vec![f32s(n, false), f32s(n, true)]
        }
        KernelBody::AllGather { rows, cols, ranks } => {
            let n = mul(&[cx.rows(rows, what)?, *cols], what)?;
            vec![f32s(n, false), f32s(mul(&[n, *ranks], what)?, true)]
        }
        KernelBody::RankExperts { experts_per_rank } => vec![
            vals(DType::I32, 1),
            Use::Values {
                dtype: DType::I32,
                elements: *experts_per_rank,
                write: true,
            },
        ],
    })
}

/// The parameters of one kernel body, on their own and against the program's KV layout.
fn validate_body(body: &KernelBody, p: &Program, env: &ProgramEnv) -> Result<(), ValidationError> {
    if let Some(view) = body.kv_view() {
        let Some(kv) = &p.kv else {
            return err("a KV cache kernel in a program without a KV cache");
        };
        let KvView {
            num_layers,
            kv_heads,
            head_dim,
            page_size,
            planes,
            dtype,
            ..
        } = view;
        if dtype != kv.dtype {
            return err(format!(
                "kv_dtype {dtype} differs from the KV layout's {}",
                kv.dtype
            ));
        }
        if (num_layers, kv_heads, head_dim, page_size, planes)
            != (
                kv.num_layers,
                kv.kv_heads,
                kv.head_dim,
                kv.page_size,
                kv.planes,
            )
        {
            return err(format!(
                "layers/kv_heads/head_dim/page_size/planes {num_layers}/{kv_heads}/{head_dim}/{page_size}/{planes} differ from the KV layout's {}/{}/{}/{}/{}",
                kv.num_layers, kv.kv_heads, kv.head_dim, kv.page_size, kv.planes
            ));
        }
        view.check().map_err(ValidationError)?;
    }
    match body {
        KernelBody::Gather {
            src_dtype, scale, ..
        } => {
            if !scale.is_finite() {
                return err(format!("scale is {scale}"));
            }
            real(*src_dtype, "src_dtype")
        }
        KernelBody::Positions => Ok(()),
        KernelBody::RmsNorm {
            cols,
            width,
            weight_offset,
            eps,
            weight_dtype,
            ..
        } => {
            if !eps.is_finite() || *eps < 0.0 {
                return err(format!("eps is {eps}"));
            }
            if !weight_offset.is_finite() {
                return err(format!("weight_offset is {weight_offset}"));
            }
            if *width == 0 || cols % width != 0 {
                return err(format!("width {width} does not divide cols {cols}"));
            }
            float(*weight_dtype, "weight_dtype")
        }
        KernelBody::Elementwise {
            inputs, program, ..
        } => {
            if program.is_empty() {
                return err("empty elementwise program");
            }
            for (i, input) in inputs.iter().enumerate() {
                float(input.dtype, &format!("input {i}"))?;
            }
            for (i, instr) in program.iter().enumerate() {
                let ok = match *instr {
                    EwInstr::Input(x) => (x as usize) < inputs.len(),
                    EwInstr::Add(a, b) | EwInstr::Mul(a, b) => (a as usize) < i && (b as usize) < i,
                    EwInstr::Silu(a) | EwInstr::GeluTanh(a) => (a as usize) < i,
                };
                if !ok {
                    return err(format!(
                        "instruction {i} ({instr:?}) refers to a later instruction or a missing input"
                    ));
                }
            }
            Ok(())
        }
        KernelBody::Rope {
            heads,
            head_dim,
            rotary_dim,
        } => {
            if *rotary_dim == 0 || rotary_dim % 2 != 0 || *heads == 0 || rotary_dim > head_dim {
                return err(format!(
                    "heads {heads}, head_dim {head_dim}, rotary_dim {rotary_dim} (even, non-zero, at most head_dim)"
                ));
            }
            Ok(())
        }
        KernelBody::KvStore { .. } => Ok(()),
        KernelBody::Attention {
            heads,
            kv_heads,
            scale,
            window,
            planes,
            value_dim,
            head_dim,
            ..
        } => {
            let value_ok = match planes {
                2 => value_dim == head_dim,
                _ => *value_dim > 0 && value_dim <= head_dim,
            };
            if !value_ok {
                return err(format!(
                    "value_dim {value_dim} with {planes} plane(s) of head_dim {head_dim} (2 planes: equal; 1: 1 to head_dim)"
                ));
            }
            if *heads == 0 || heads % kv_heads != 0 {
                return err(format!(
                    "heads {heads} is not a multiple of kv_heads {kv_heads}"
                ));
            }
            if *window == Some(0) {
                return err("a sliding window of 0 positions".to_string());
            }
            if !scale.is_finite() {
                return err(format!("scale is {scale}"));
            }
            let _ = env;
            Ok(())
        }
        KernelBody::Softmax { .. } => Ok(()),
        KernelBody::TopK { cols, k, .. } => {
            if k > cols {
                return err(format!("keeps {k} of {cols} columns"));
            }
            Ok(())
        }
        KernelBody::Matmul {
            weight_dtype, bias, ..
        } => {
            if *bias && weight_dtype.is_quantized() {
                return err(format!("a bias of {weight_dtype} blocks"));
            }
            real(*weight_dtype, "weight_dtype")
        }
        KernelBody::MoeExperts {
            weight_dtype,
            experts,
            ..
        } => {
            if *experts == 0 {
                return err("no experts");
            }
            float(*weight_dtype, "weight_dtype")
        }
        KernelBody::Zeros { dtype, .. } => {
            if dtype.is_quantized() || ![1, 2, 4, 8].contains(&dtype.size()) {
                return err(format!(
                    "zeros of {dtype}, expected a 1-, 2-, 4- or 8-byte type"
                ));
            }
            Ok(())
        }
        KernelBody::AllReduce { cols, .. } => {
            if *cols == 0 {
                return err("an all-reduce of rows of 0 values".to_string());
            }
            Ok(())
        }
        KernelBody::AllGather { cols, ranks, .. } => {
            if *cols == 0 || *ranks == 0 || *ranks > 1 << 16 {
                return err(format!(
                    "an all-gather of rows of {cols} values over {ranks} ranks"
                ));
            }
            Ok(())
        }
        KernelBody::RankExperts { experts_per_rank } => {
            if *experts_per_rank == 0 || *experts_per_rank > 1 << 20 {
                return err(format!("{experts_per_rank} experts per rank"));
            }
            Ok(())
        }
        KernelBody::DecompressedAttention {
            heads,
            head_dim,
            rope,
            nope,
            value,
            scale,
            weight_dtype,
            ..
        } => {
            if *heads == 0 || *nope == 0 || *value == 0 || *rope == 0 || rope >= head_dim {
                return err(format!(
                    "heads {heads}, nope {nope}, value {value}, rope {rope} of head_dim {head_dim}: expected non-zero, rope below head_dim"
                ));
            }
            if !scale.is_finite() {
                return err(format!("scale is {scale}"));
            }
            float(*weight_dtype, "weight_dtype")
        }
        KernelBody::Concat { groups, a, b, .. } => {
            if *groups == 0 || *a == 0 || *b == 0 {
                return err(format!(
                    "groups {groups}, widths {a} and {b}: expected non-zero"
                ));
            }
            Ok(())
        }
        KernelBody::HeadMatmul {
            heads,
            n,
            k,
            weight_dtype,
            ..
        } => {
            if *heads == 0 || *n == 0 || *k == 0 {
                return err(format!("heads {heads}, n {n}, k {k}: expected non-zero"));
            }
            float(*weight_dtype, "weight_dtype")
        }
        KernelBody::MoeRouter {
            experts,
            top_k,
            n_group,
            topk_group,
            group_score,
            scale,
            bias_dtype,
            ..
        } => {
            if *experts == 0 || *experts > 4096 {
                return err(format!("{experts} experts"));
            }
            if *n_group == 0 || experts % n_group != 0 {
                return err(format!("{n_group} groups do not divide {experts} experts"));
            }
            let per = experts / n_group;
            if *topk_group == 0 || topk_group > n_group {
                return err(format!("keeps {topk_group} of {n_group} groups"));
            }
            if *top_k == 0 || *top_k > topk_group * per {
                return err(format!(
                    "chooses {top_k} of the {} experts kept",
                    topk_group * per
                ));
            }
            if *group_score == crate::kernel::GroupScore::TopTwoSum && per < 2 && *n_group > 1 {
                return err(format!("groups of {per} expert(s) scored by their top two"));
            }
            if !scale.is_finite() {
                return err(format!("scale is {scale}"));
            }
            float(*bias_dtype, "bias_dtype")
        }
    }
}

impl CpuModule {
    /// Checks the native code's table against `program`: one entry per kernel, each inside
    /// the code and aligned, every kernel without a library implementation generated, and
    /// every generated kernel compiled from the body the program holds (its digest).
    pub fn validate(&self, program: &Program) -> Result<(), ValidationError> {
        let n = program.kernels.len();
        if self.entries.len() != n || self.kernel_digests.len() != n {
            return err(format!(
                "{} code entries and {} digests for {n} kernels",
                self.entries.len(),
                self.kernel_digests.len()
            ));
        }
        for (i, (k, entry)) in program.kernels.iter().zip(&self.entries).enumerate() {
            match entry {
                Some(_) if k.body.reads_blocks() => {
                    return err(format!(
                        "kernel {i} ({}) reads block weights, which only the runtime's library kernels read, yet has native code",
                        k.name
                    ));
                }
                Some(off) => {
                    if *off >= self.code.len() as u64 || off % CODE_ALIGN != 0 {
                        return err(format!(
                            "kernel {i} ({}): entry {off} is outside the {} bytes of code or not {CODE_ALIGN}-aligned",
                            k.name,
                            self.code.len()
                        ));
                    }
                    if self.kernel_digests[i] != k.body.digest() {
                        return err(format!(
                            "kernel {i} ({}): the native code was compiled from another kernel body or kernel contract (recompile the model)",
                            k.name
                        ));
                    }
                }
                None if k.body.is_generated_on_cpu() => {
                    return err(format!("kernel {i} ({}) has no native code", k.name));
                }
                None => {}
            }
        }
        Ok(())
    }
}

/// Alignment of every kernel's entry in [`CpuModule::code`].
pub const CODE_ALIGN: u64 = 16;

/// CUDA's limits on a launch: blocks per grid in x, y, z and threads per block.
const CUDA_GRID_MAX: [u64; 3] = [(1 << 31) - 1, 65535, 65535];
const CUDA_BLOCK_THREADS_MAX: u64 = 1024;
const CUDA_BLOCK_MAX: [u32; 3] = [1024, 1024, 64];

impl CudaModule {
    /// Checks the CUDA kernel table against `program` and the bounds `dims`: one entry per
    /// kernel, compiled from the body the program holds, with block sizes and (at the bounds)
    /// grid sizes within CUDA's limits, so no launch size is truncated.
    pub fn validate(
        &self,
        program: &Program,
        dims: &BTreeMap<String, u64>,
    ) -> Result<(), ValidationError> {
        let n = program.kernels.len();
        if self.kernels.len() != n {
            return err(format!(
                "{} CUDA kernels for {n} program kernels",
                self.kernels.len()
            ));
        }
        for (i, (k, e)) in program.kernels.iter().zip(&self.kernels).enumerate() {
            let what = format!("CUDA kernel {i} ({})", e.name);
            if e.kernel_digest != k.body.digest() {
                return err(format!("{what}: compiled from another kernel body"));
            }
            let block = e.launch.block;
            let threads: u64 = block.iter().map(|&b| u64::from(b)).product();
            if block.contains(&0)
                || threads > CUDA_BLOCK_THREADS_MAX
                || block.iter().zip(CUDA_BLOCK_MAX).any(|(b, m)| *b > m)
            {
                return err(format!("{what}: block {block:?} is outside CUDA's limits"));
            }
            for (axis, g) in e.launch.grid.iter().enumerate() {
                let blocks = match g {
                    GridExtent::Fixed(n) => *n,
                    GridExtent::CeilDiv { rows, by } => {
                        if *by == 0 {
                            return err(format!("{what}: grid axis {axis} divides by 0"));
                        }
                        let r = match rows {
                            Rows::Fixed(n) => *n,
                            Rows::Step(d) => dims.get(d.name()).copied().ok_or_else(|| {
                                ValidationError(format!(
                                    "{what}: grid uses dim `{}`, which the manifest does not bound",
                                    d.name()
                                ))
                            })?,
                        };
                        r.div_ceil(*by)
                    }
                };
                if blocks > CUDA_GRID_MAX[axis] {
                    return err(format!(
                        "{what}: {blocks} blocks on grid axis {axis} at the bounds, CUDA allows {}",
                        CUDA_GRID_MAX[axis]
                    ));
                }
            }
        }
        Ok(())
    }
}
