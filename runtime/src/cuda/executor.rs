//! Loads the PTX, allocates the arena, KV cache, rotary tables, weights and step inputs on the
//! device once at the bounds, and runs steps with the same interface as the CPU executor.

use crate::artifact::Artifact;
use crate::error::{Result, RuntimeError};
use crate::logits::Logits;
use crate::profile::GpuProfiling;
use crate::schema::{
    CudaModule, Extent, GridExtent, Program, Rows, StepDim, StepInputs, StepLimits, Storage,
};
use cudarc::driver::result;
use cudarc::driver::sys::{CUdeviceptr, CUfunction, CUmodule};
use cudarc::driver::{CudaContext, CudaStream};
use std::ffi::{c_void, CString};
use std::sync::Arc;

/// `Ok` where this machine has a CUDA driver library and a device; otherwise what is missing.
/// Checked before any cudarc call, since cudarc panics when the driver library is absent.
pub fn cuda_available() -> Result<()> {
    let names = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"];
    // SAFETY: opening the driver library runs its initializers only, as cudarc would.
    let found = names
        .iter()
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok());
    if !found {
        return Err(RuntimeError::Target(
            "no CUDA driver on this machine (libcuda.so.1 does not load): run on a machine with an NVIDIA GPU and driver, or use --device cpu".into(),
        ));
    }
    result::init()
        .map_err(|e| RuntimeError::Target(format!("the CUDA driver does not initialize: {e}")))?;
    let count = result::device::get_count()
        .map_err(|e| RuntimeError::Target(format!("cannot count CUDA devices: {e}")))?;
    if count == 0 {
        return Err(RuntimeError::Target(
            "the CUDA driver sees no device; use --device cpu".into(),
        ));
    }
    Ok(())
}

fn driver(what: &str) -> impl FnOnce(result::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Target(format!("CUDA {what}: {e}"))
}

/// Device memory freed on drop.
struct DeviceBuf {
    ptr: CUdeviceptr,
}

impl DeviceBuf {
    fn zeroed(bytes: usize, stream: &CudaStream) -> Result<Self> {
        // SAFETY: a fresh allocation of at least one byte, zeroed before use.
        unsafe {
            let ptr = result::malloc_sync(bytes.max(1)).map_err(driver("allocation"))?;
            result::memset_d8_async(ptr, 0, bytes.max(1), stream.cu_stream())
                .map_err(driver("memset"))?;
            Ok(DeviceBuf { ptr })
        }
    }

    fn upload(bytes: &[u8], stream: &CudaStream) -> Result<Self> {
        let b = DeviceBuf::zeroed(bytes.len(), stream)?;
        // SAFETY: the allocation holds `bytes.len()` bytes; the host slice outlives the
        // stream synchronization that follows every upload batch.
        unsafe { result::memcpy_htod_async(b.ptr, bytes, stream.cu_stream()) }
            .map_err(driver("upload"))?;
        Ok(b)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync, freed once; the executor synchronizes after steps.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A role's program on the GPU. Dropping it frees its device memory and unloads its module
/// while its context is still alive and current.
pub struct CudaExecutor {
    artifact: Arc<Artifact>,
    program: Program,
    module: CudaModule,
    memory: Vec<DeviceBuf>,
    cu_module: CUmodule,
    funcs: Vec<CUfunction>,
    bufs: Vec<u64>,
    inputs: std::collections::BTreeMap<String, (u64, usize)>,
    bounds: [u64; StepDim::COUNT],
    limits: StepLimits,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    profiling: GpuProfiling,
    nvtx: Option<super::nvtx::Nvtx>,
}

// SAFETY: the module, function and device pointers belong to `ctx`, which every method makes
// current on the calling thread before any driver call; `&mut self` serializes those calls.
unsafe impl Send for CudaExecutor {}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        let _ = self.stream.synchronize();
        self.memory.clear();
        // SAFETY: loaded by `new` in this context; no launch is pending after the synchronize.
        let _ = unsafe { result::module::unload(self.cu_module) };
    }
}

impl CudaExecutor {
    /// NVTX ranges around each forward pass (`on`) and each launch too (`detailed`); a
    /// missing NVTX library is a warning and no ranges.
    pub fn set_gpu_profiling(&mut self, level: GpuProfiling) {
        self.profiling = level;
        self.nvtx = None;
        if level == GpuProfiling::Off {
            return;
        }
        match super::nvtx::Nvtx::load() {
            Ok(n) => self.nvtx = Some(n),
            Err(e) => tracing::warn!("gpu_profiling {level:?}: NVTX not loaded ({e}); no ranges"),
        }
    }

    /// Prepares `role` of `artifact` on GPU 0.
    pub fn new(artifact: Arc<Artifact>, role: &str) -> Result<Self> {
        cuda_available()?;
        let program = artifact
            .programs
            .get(role)
            .cloned()
            .ok_or_else(|| RuntimeError::Input(format!("the artifact has no role `{role}`")))?;
        let module = artifact.cuda.get(role).cloned().ok_or_else(|| {
            RuntimeError::Target(format!("the artifact has no CUDA code for role `{role}`; compile it with --target cuda or all"))
        })?;
        let ctx = CudaContext::new(0).map_err(driver("context"))?;
        let stream = ctx.default_stream();
        let ptx_path = artifact.dir.join(format!("{role}/module.ptx"));
        let ptx = std::fs::read_to_string(&ptx_path).map_err(|source| RuntimeError::Io {
            path: ptx_path.clone(),
            source,
        })?;
        let ptx =
            CString::new(ptx).map_err(|_| RuntimeError::artifact(&ptx_path, "holds a NUL byte"))?;
        // SAFETY: a NUL-terminated PTX image, checked by the artifact's checksum.
        let cu_module = unsafe { result::module::load_data(ptx.as_ptr().cast::<c_void>()) }
            .map_err(driver("PTX load (is the GPU older than the PTX's arch?)"))?;
        let mut funcs = Vec::new();
        for k in &module.kernels {
            let name = CString::new(k.name.clone())
                .map_err(|_| RuntimeError::artifact(&ptx_path, "kernel name with NUL"))?;
            // SAFETY: the module is loaded; the name is the kernel's PTX entry.
            funcs.push(
                unsafe { result::module::get_function(cu_module, name) }
                    .map_err(driver(&k.name))?,
            );
        }
        let (bounds, limits) = artifact.step_limits(role)?;
        let extent = |e: &Extent| match e {
            Extent::Fixed(n) => *n,
            Extent::Step(d) => bounds[*d as usize],
        };
        let max_seq_len = artifact.manifest.runtime.max_seq_len as usize;
        let mut memory = Vec::new();
        let arena = DeviceBuf::zeroed(program.arena_bytes as usize, &stream)?;
        let kv = DeviceBuf::zeroed(program.kv_cache_bytes(bounds) as usize, &stream)?;
        let mut rope = Vec::new();
        for t in &program.rope_tables {
            let bytes: Vec<u8> = t
                .rows(max_seq_len)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            rope.push(DeviceBuf::upload(&bytes, &stream)?);
        }
        let mut bufs = Vec::with_capacity(program.buffers.len());
        let mut inputs = std::collections::BTreeMap::new();
        let mut params: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
        for b in &program.buffers {
            bufs.push(match &b.storage {
                Storage::Arena { offset } => arena.ptr + offset,
                Storage::KvCache => kv.ptr,
                Storage::KvCacheLayer { layer } => kv.ptr + layer * program.kv_layer_bytes(),
                Storage::RopeTable { table } => rope[*table as usize].ptr,
                Storage::Param { key } => match params.get(key) {
                    Some(&p) => p,
                    None => {
                        let (_, bytes) = artifact.weight(key)?;
                        let d = DeviceBuf::upload(bytes, &stream)?;
                        let p = d.ptr;
                        memory.push(d);
                        params.insert(key.clone(), p);
                        p
                    }
                },
                Storage::Input => {
                    let bytes =
                        b.shape.iter().map(extent).product::<u64>() as usize * b.dtype.size();
                    let d = DeviceBuf::zeroed(bytes, &stream)?;
                    let p = d.ptr;
                    memory.push(d);
                    inputs.insert(b.name.clone(), (p, bytes));
                    p
                }
            });
        }
        memory.push(arena);
        memory.push(kv);
        memory.extend(rope);
        stream.synchronize().map_err(driver("upload"))?;
        Ok(CudaExecutor {
            artifact,
            program,
            module,
            memory,
            cu_module,
            funcs,
            bufs,
            inputs,
            bounds,
            limits,
            stream,
            ctx,
            profiling: GpuProfiling::Off,
            nvtx: None,
        })
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The artifact.
    pub fn artifact(&self) -> &Arc<Artifact> {
        &self.artifact
    }

    /// The bound of each step dim.
    pub fn bounds(&self) -> &[u64; StepDim::COUNT] {
        &self.bounds
    }

    /// Uploads `values` into input `name`'s buffer, zero-padded to its size at the bounds;
    /// `staging` keeps the padded copy alive until the step's synchronize.
    fn upload_input<T: Copy + Default>(
        &self,
        name: &str,
        values: &[T],
        staging: &mut Vec<Vec<T>>,
    ) -> Result<()> {
        let Some(&(ptr, cap)) = self.inputs.get(name) else {
            return Ok(());
        };
        let elems = cap / std::mem::size_of::<T>();
        if values.len() > elems {
            return Err(RuntimeError::Input(format!(
                "input `{name}` has {} values, above its bound of {elems}",
                values.len()
            )));
        }
        let mut padded = vec![T::default(); elems];
        padded[..values.len()].copy_from_slice(values);
        // SAFETY: `ptr` holds `cap` bytes, at least `elems` values; `padded` moves into
        // `staging`, which outlives the synchronize at the end of the step.
        unsafe { result::memcpy_htod_async(ptr, &padded, self.stream.cu_stream()) }
            .map_err(driver(name))?;
        staging.push(padded);
        Ok(())
    }

    /// Runs one step and returns the `logits` output.
    pub fn execute(&mut self, s: &StepInputs) -> Result<Logits> {
        let dims = s.checked_dims(&self.limits)?;
        self.ctx.bind_to_thread().map_err(driver("context"))?;
        let batch_context = s.context_lengths();
        let (mut tokens, mut ints) = (Vec::new(), Vec::new());
        self.upload_input("tokens", &s.tokens, &mut tokens)?;
        self.upload_input("input_row_offsets", &s.input_row_offsets, &mut ints)?;
        self.upload_input("cache_lengths", &s.cache_lengths, &mut ints)?;
        for g in 0..s.kv_groups {
            let name = crate::schema::kv_lookup_input(g);
            self.upload_input(&name, s.lookup_table(g), &mut ints)?;
        }
        self.upload_input("batch_context_lengths", &batch_context, &mut ints)?;
        self.upload_input("logit_indices", &s.logit_indices, &mut ints)?;
        let rows = |r: &Rows| match r {
            Rows::Step(d) => dims[*d as usize],
            Rows::Fixed(n) => *n,
        };
        let detailed = self.profiling == GpuProfiling::Detailed;
        let nvtx = self.nvtx.as_ref();
        if let Some(n) = nvtx {
            n.push(&format!(
                "max.forward {} tokens {} sequences",
                dims[0], dims[1]
            ));
        }
        for launch in &self.program.launches {
            let k = &self.module.kernels[launch.kernel as usize];
            let mut grid = [0u32; 3];
            for (g, extent) in grid.iter_mut().zip(&k.launch.grid) {
                let blocks = match extent {
                    GridExtent::Fixed(n) => *n,
                    GridExtent::CeilDiv { rows: r, by } => rows(r).div_ceil((*by).max(1)),
                };
                // CudaModule::validate bounded every grid at the bounds; dims are below them.
                *g = u32::try_from(blocks).map_err(|_| {
                    RuntimeError::Input(format!("{}: {blocks} blocks do not fit a grid", k.name))
                })?;
            }
            if grid.contains(&0) {
                continue;
            }
            let mut values: Vec<u64> = launch
                .buffers
                .iter()
                .map(|&b| self.bufs[b as usize])
                .collect();
            values.extend_from_slice(&dims);
            let mut params: Vec<*mut c_void> = values
                .iter_mut()
                .map(|v| (v as *mut u64).cast::<c_void>())
                .collect();
            let [bx, by, bz] = k.launch.block;
            if let (Some(n), true) = (nvtx, detailed) {
                n.push(&k.name);
            }
            // SAFETY: parameters follow the CUDA launch contract (buffers, then the step dims),
            // each a pointer to a live u64; grid and block come from the compiler.
            unsafe {
                result::launch_kernel(
                    self.funcs[launch.kernel as usize],
                    (grid[0], grid[1], grid[2]),
                    (bx, by, bz),
                    k.launch.shared_bytes,
                    self.stream.cu_stream(),
                    &mut params,
                )
            }
            .map_err(driver(&k.name))?;
            if let (Some(n), true) = (nvtx, detailed) {
                n.pop();
            }
        }
        if let Some(n) = nvtx {
            n.pop();
        }
        let out = *self
            .program
            .outputs
            .get("logits")
            .ok_or_else(|| RuntimeError::artifact(&self.artifact.dir, "no `logits` output"))?;
        let buf = &self.program.buffers[out as usize];
        let rows = match buf.shape.first() {
            Some(Extent::Step(d)) => dims[*d as usize] as usize,
            Some(Extent::Fixed(n)) => *n as usize,
            None => 1,
        };
        let vocab = self.program.vocab_size as usize;
        let mut data = vec![0f32; rows * vocab];
        // SAFETY: the logits buffer holds rows × vocab f32; synchronize before reading `data`.
        unsafe {
            result::memcpy_dtoh_async(&mut data, self.bufs[out as usize], self.stream.cu_stream())
        }
        .map_err(driver("logits"))?;
        self.stream.synchronize().map_err(driver("step"))?;
        Ok(Logits { rows, vocab, data })
    }

    /// Rows `rows` of the f32 `[rows, width]` output `name` of the last step (an output that
    /// lives to the step's end, as `hidden_states`), copied from the device; `None` where the
    /// program has no such output or the rows lie past its bound.
    pub fn output_rows(&mut self, name: &str, rows: std::ops::Range<usize>) -> Option<Vec<f32>> {
        let id = *self.program.outputs.get(name)? as usize;
        let (_, width) = self.program.row_output(name, &self.bounds, &rows)?;
        self.ctx.bind_to_thread().ok()?;
        let mut data = vec![0f32; rows.len() * width];
        let src = self.bufs[id] + (rows.start * width * 4) as u64;
        // SAFETY: the buffer holds `bound × width` f32 on the device and `rows` lie below
        // `bound`; the synchronize below completes the copy before `data` is read.
        unsafe { result::memcpy_dtoh_async(&mut data, src, self.stream.cu_stream()) }.ok()?;
        self.stream.synchronize().ok()?;
        Some(data)
    }
}
