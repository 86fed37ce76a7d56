//! The compile driver and the artifact writer.

use crate::cuda;
use maxc_graph::pipeline::{load_model, read_tokenizer, LoadOptions, WeightFormat};
use maxc_graph::weights::{safetensors_data_offsets, write_safetensors_to, StateDict};
use maxc_graph::{ModuleRuntime, Registry};
use maxc_lowering::cpu::compile_kernel;
use maxc_lowering::passes::PassReport;
use maxc_lowering::{lower_graph, LowerOptions, Lowered};
use maxc_schema::sha256_hex;
use maxc_schema::{
    bincode_config, CpuModule, CpuTarget, FileEntry, KernelBody, Manifest, RoleEntry,
    RuntimeSettings, Targets, FORMAT_VERSION, MANIFEST_FILE, TOKENIZER_FILE, WEIGHTS_FILE,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// An export error.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Loading the checkpoint or building a graph failed.
    #[error(transparent)]
    Graph(#[from] maxc_graph::Error),
    /// Lowering failed.
    #[error(transparent)]
    Lower(#[from] maxc_lowering::LowerError),
    /// A file could not be written (the OS's reason in the message, not repeated as a
    /// source).
    #[error("{}: {err}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        err: std::io::Error,
    },
    /// The destination exists.
    #[error("{}: already exists; pass --force to replace it", .0.display())]
    Exists(PathBuf),
    /// Anything else, with what it concerns.
    #[error("{0}")]
    Other(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ExportError + '_ {
    move |err| ExportError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// How matmuls run on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CpuMatmul {
    /// The runtime chooses per CPU: the library's hand-vectorized kernels at every row count
    /// where it has them (AVX-512 register tiles, AVX2 row groups); elsewhere generated code for
    /// steps of 2 to [`AUTO_MATMUL_MAX_ROWS`] rows and `gemm` otherwise (measured: gemm wins at
    /// 1 row and at many, generated code in between).
    #[default]
    Auto,
    /// The runtime's `gemm` library kernel.
    Library,
    /// Cranelift-generated code.
    Generated,
}

/// The largest step, in rows, for which [`CpuMatmul::Auto`] runs generated matmuls.
pub const AUTO_MATMUL_MAX_ROWS: u64 = 16;

/// What to compile, and how.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The deployment's bounds.
    pub runtime: ModuleRuntime,
    /// The formats weights are stored in.
    pub weights: WeightFormat,
    /// Logits for every token row of a full step (scoring at full prefill speed): the
    /// `logit_rows` bound becomes the step's token budget, overriding the runtime's
    /// `max_logit_rows`.
    pub all_logits: bool,
    /// How matmuls run on the CPU.
    pub cpu_matmul: CpuMatmul,
    /// Replace an existing artifact.
    pub force: bool,
    /// Generate CPU code.
    pub cpu: bool,
    /// Generate CUDA code for this SM (`sm_90`); needs NVRTC.
    pub cuda_arch: Option<String>,
    /// Stop each role's fusion passes after this many rewrites (`None`: run them all), to
    /// bisect a wrong lowering to one rewrite.
    pub stop_after_rewrites: Option<usize>,
}

/// What a compile produced.
#[derive(Clone, Debug)]
pub struct CompileSummary {
    /// The artifact directory.
    pub dir: PathBuf,
    /// Kernels per role.
    pub kernels: BTreeMap<String, usize>,
    /// The fusion passes' rewrites per role.
    pub passes: BTreeMap<String, PassReport>,
    /// Total bytes written.
    pub bytes: u64,
}

/// Compiles the checkpoint at `model` into the artifact directory `out`. `progress` hears each
/// stage.
pub fn compile(
    model: &Path,
    out: &Path,
    opts: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<CompileSummary, ExportError> {
    if out.exists() && !opts.force {
        return Err(ExportError::Exists(out.to_path_buf()));
    }
    let mut opts = opts.clone();
    if opts.all_logits {
        let b = &mut opts.runtime.batch;
        b.max_logit_rows = Some(b.max_batch_active_tokens().max(b.least_logit_rows()));
    }
    let opts = &opts;
    progress(&format!("loading {}", model.display()));
    let load = LoadOptions {
        runtime: opts.runtime.clone(),
        weights: opts.weights,
        roles: Vec::new(),
    };
    let loaded = load_model(model, &Registry::builtin(), &load)?;
    let target = CpuTarget::host_baseline().ok_or_else(|| {
        ExportError::Other(format!(
            "maxc generates no CPU code for {} (x86_64 and aarch64 only)",
            std::env::consts::ARCH
        ))
    })?;

    let cuda_target = match &opts.cuda_arch {
        Some(arch) => Some(cuda::check_tools(arch)?),
        None => None,
    };
    let mut cuda_info = None;
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut roles = BTreeMap::new();
    let mut weights = StateDict::new();
    let mut kernels = BTreeMap::new();
    let mut programs = BTreeMap::new();
    let mut reports = BTreeMap::new();
    // Each tensor-parallel rank is a role of its own (`decoder@tp1`, ...): the same graph,
    // its own share of the weights under its name.
    let ranks = loaded.roles.iter().flat_map(|(role, rg)| {
        std::iter::once((role.to_string(), rg, &rg.weights)).chain(
            rg.rank_weights
                .iter()
                .enumerate()
                .map(move |(i, w)| (format!("{role}@tp{}", i + 1), rg, w)),
        )
    });
    for (role, rg, role_weights) in ranks {
        let kv_windows = rg
            .graph
            .kv_layout()
            .map(|l| l.windows())
            .unwrap_or_default();
        let dims = opts
            .runtime
            .max_dims(rg.graph.step_dims().iter().map(String::as_str), &kv_windows)?;

        progress(&format!("lowering role {role}"));
        let lower = LowerOptions {
            bounds: dims.clone(),
            max_seq_len: opts.runtime.batch.max_seq_len,
            stop_after_rewrites: opts.stop_after_rewrites,
            weights_role: Some(role.clone()),
        };
        let Lowered {
            mut program,
            passes,
        } = lower_graph(&rg.graph, &lower)?;
        // A tensor-parallel rank's replicated weights (embeddings, norms, the vocabulary
        // projection) are rank 0's bytes: its program reads rank 0's copy, stored once.
        let shared = share_replicated(&mut program, &role, rg);
        reports.insert(role.to_string(), passes);
        let program_file = format!("{role}/program.bin");
        files.insert(program_file.clone(), encode(&program)?);
        let cpu_code = match opts.cpu {
            false => None,
            true => {
                let module = cpu_module(&role, &program, &target, opts.cpu_matmul, progress)?;
                let file = format!("{role}/cpu.bin");
                files.insert(file.clone(), encode(&module)?);
                Some(file)
            }
        };
        let cuda_code = match &cuda_target {
            None => None,
            Some(t) => {
                progress(&format!(
                    "role {role}: {} CUDA kernels through NVRTC ({})",
                    program.kernels.len(),
                    t.arch
                ));
                let (module, source, ptx) = cuda::cuda_module(&program, t)?;
                cuda_info = Some(module.target.clone());
                files.insert(format!("{role}/kernels.cu"), source.into_bytes());
                files.insert(format!("{role}/module.ptx"), ptx.into_bytes());
                let file = format!("{role}/cuda.bin");
                files.insert(file.clone(), encode(&module)?);
                Some(file)
            }
        };
        roles.insert(
            role.to_string(),
            RoleEntry {
                dims: dims.iter().map(|(k, v)| (k.clone(), *v as u64)).collect(),
                program: program_file,
                cpu_code,
                cuda_code,
                arena_bytes: program.arena_bytes,
                kernels: program.kernels.len() as u64,
                launches: program.launches.len() as u64,
            },
        );
        kernels.insert(role.to_string(), program.kernels.len());
        programs.insert(role.to_string(), program);
        for (key, w) in role_weights.iter().filter(|(k, _)| !shared.contains(*k)) {
            weights.insert(format!("{role}/{key}"), w.clone());
        }
    }
    validate_programs(&programs, &roles, &weights, opts)?;

    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .ok_or_else(|| ExportError::Other(format!("{}: not a directory name", out.display())))?;
    std::fs::create_dir_all(parent).map_err(|e| {
        ExportError::Other(format!(
            "{}: cannot create the directory the artifact goes in ({e})",
            parent.display()
        ))
    })?;
    remove_stale_partials(parent, &name.to_string_lossy());
    let tmp = parent.join(format!(
        ".{}.partial-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write_dir(
        &tmp,
        model,
        &loaded,
        opts,
        &files,
        &weights,
        roles,
        Targets {
            cpu: opts.cpu.then(|| target.clone()),
            cuda: cuda_info,
        },
        progress,
    );
    let bytes = match result {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        let old = parent.join(format!(
            ".{}.old-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        std::fs::rename(out, &old).map_err(io(out))?;
        std::fs::rename(&tmp, out).map_err(io(out))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(&tmp, out).map_err(io(out))?;
    }
    progress(&format!("wrote {} ({bytes} bytes)", out.display()));
    Ok(CompileSummary {
        dir: out.to_path_buf(),
        kernels,
        passes: reports,
        bytes,
    })
}

/// Runs the runtime's own check ([`maxc_schema::Program::validate`]) on every role's program
/// against the manifest entries and weights layout about to be written, so that a wrong
/// lowering fails the compile instead of the load.
fn validate_programs(
    programs: &BTreeMap<String, maxc_schema::Program>,
    roles: &BTreeMap<String, RoleEntry>,
    weights: &StateDict,
    opts: &CompileOptions,
) -> Result<(), ExportError> {
    let offsets = safetensors_data_offsets(weights, None)
        .map_err(|e| ExportError::Other(format!("{WEIGHTS_FILE}: {e}")))?;
    let infos: BTreeMap<String, maxc_schema::WeightInfo> = weights
        .iter()
        .map(|(k, t)| {
            let info = maxc_schema::WeightInfo {
                dtype: t.dtype,
                elements: t.shape.iter().product::<usize>() as u64,
                offset: offsets.get(k).copied().unwrap_or(0),
            };
            (k.clone(), info)
        })
        .collect();
    for (role, program) in programs {
        let Some(entry) = roles.get(role) else {
            continue;
        };
        let env = maxc_schema::ProgramEnv {
            dims: &entry.dims,
            max_seq_len: opts.runtime.batch.max_seq_len as u64,
            page_size: opts.runtime.kv.page_size as u64,
            arena_bytes: entry.arena_bytes,
            weights: &infos,
        };
        program.validate(&env).map_err(|e| {
            ExportError::Other(format!(
                "role {role}: the lowered program fails the runtime's validation ({e}); \
                 nothing was written. This is a compiler bug: please report it with the model"
            ))
        })?;
    }
    Ok(())
}

/// Removes what earlier, interrupted compiles to the same destination left behind.
fn remove_stale_partials(parent: &Path, name: &str) {
    let prefixes = [format!(".{name}.partial-"), format!(".{name}.old-")];
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        if prefixes.iter().any(|p| file.starts_with(p.as_str())) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A role's native CPU code: every kernel that runs generated on the CPU, in one blob.
/// Points the parameters of tensor-parallel rank `role` (not rank 0) whose weight is the same
/// as rank 0's at rank 0's key, and returns those weights' keys (which the rank then does not
/// store).
fn share_replicated(
    program: &mut maxc_schema::Program,
    role: &str,
    rg: &maxc_graph::pipeline::RoleGraph,
) -> std::collections::BTreeSet<String> {
    let mut shared = std::collections::BTreeSet::new();
    let Some((base, _)) = role.split_once("@tp") else {
        return shared;
    };
    let rank: usize = role
        .rsplit_once("@tp")
        .and_then(|(_, r)| r.parse().ok())
        .unwrap_or(0);
    let Some(mine) = rank.checked_sub(1).and_then(|i| rg.rank_weights.get(i)) else {
        return shared;
    };
    for b in &mut program.buffers {
        let maxc_schema::Storage::Param { key } = &mut b.storage else {
            continue;
        };
        let Some(k) = key.strip_prefix(&format!("{role}/")).map(str::to_string) else {
            continue;
        };
        let same = match (mine.get(&k), rg.weights.get(&k)) {
            (Some(a), Some(b)) => {
                a.dtype == b.dtype && a.shape == b.shape && a.bytes() == b.bytes()
            }
            _ => false,
        };
        if same {
            *key = format!("{base}/{k}");
            shared.insert(k);
        }
    }
    shared
}

fn cpu_module(
    role: &str,
    program: &maxc_schema::Program,
    target: &CpuTarget,
    matmul: CpuMatmul,
    progress: &mut dyn FnMut(&str),
) -> Result<CpuModule, ExportError> {
    let mut code = Vec::new();
    let mut entries = Vec::new();
    let total = program.kernels.len();
    for (i, k) in program.kernels.iter().enumerate() {
        let generate = k.body.is_generated_on_cpu()
            || (matmul != CpuMatmul::Library
                && matches!(k.body, KernelBody::Matmul { .. })
                && !k.body.reads_blocks());
        if !generate {
            entries.push(None);
            continue;
        }
        progress(&format!("role {role}: kernel {}/{total} {}", i + 1, k.name));
        let bytes = compile_kernel(&k.body, target).map_err(|e| {
            ExportError::Lower(maxc_lowering::LowerError::Codegen {
                kernel: k.name.clone(),
                message: e.to_string(),
            })
        })?;
        code.resize(code.len().next_multiple_of(64), 0);
        entries.push(Some(code.len() as u64));
        code.extend_from_slice(&bytes);
    }
    let generated_matmul_max_rows = (matmul == CpuMatmul::Auto).then_some(AUTO_MATMUL_MAX_ROWS);
    Ok(CpuModule {
        target: target.clone(),
        code,
        entries,
        kernel_digests: program.kernels.iter().map(|k| k.body.digest()).collect(),
        generated_matmul_max_rows,
    })
}

fn encode<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, ExportError> {
    bincode::serde::encode_to_vec(value, bincode_config())
        .map_err(|e| ExportError::Other(format!("bincode: {e}")))
}

fn token_ids(config: &serde_json::Value, key: &str) -> Vec<i64> {
    let v = config
        .get(key)
        .or_else(|| config.get("text_config").and_then(|t| t.get(key)));
    match v {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_i64()).collect(),
        _ => Vec::new(),
    }
}

/// A writer that hashes what passes through it: whole, and in pieces of
/// [`maxc_schema::manifest::CHECKSUM_CHUNK`] bytes.
struct Hashing<W> {
    inner: W,
    sha: sha2::Sha256,
    chunk: maxc_schema::manifest::PieceHasher,
    /// Bytes in `chunk` so far.
    in_chunk: u64,
    chunks: Vec<String>,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use maxc_schema::manifest::CHECKSUM_CHUNK;
        let n = self.inner.write(buf)?;
        sha2::Digest::update(&mut self.sha, &buf[..n]);
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let take = rest.len().min((CHECKSUM_CHUNK - self.in_chunk) as usize);
            self.chunk.update(&rest[..take]);
            self.in_chunk += take as u64;
            rest = &rest[take..];
            if self.in_chunk == CHECKSUM_CHUNK {
                let done = std::mem::take(&mut self.chunk);
                self.chunks.push(done.finish());
                self.in_chunk = 0;
            }
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The checksum ([`maxc_schema::manifest::piece_digest`]) of each
/// [`maxc_schema::manifest::CHECKSUM_CHUNK`] bytes of `bytes`, where it is more than one piece.
fn chunk_sums(bytes: &[u8]) -> Vec<String> {
    if FileEntry::chunks_for(bytes.len() as u64) == 0 {
        return Vec::new();
    }
    bytes
        .chunks(maxc_schema::manifest::CHECKSUM_CHUNK as usize)
        .map(maxc_schema::manifest::piece_digest)
        .collect()
}

/// Writes the weights file, hashing it on the way out (no second read of a large file).
fn write_weights(path: &Path, weights: &StateDict) -> Result<FileEntry, ExportError> {
    let file = std::fs::File::create(path).map_err(io(path))?;
    let mut out = Hashing {
        inner: std::io::BufWriter::new(file),
        sha: sha2::Digest::new(),
        chunk: Default::default(),
        in_chunk: 0,
        chunks: Vec::new(),
    };
    let bytes = write_safetensors_to(&mut out, weights, None)
        .map_err(|e| ExportError::Other(format!("{}: {e}", path.display())))?;
    out.flush().map_err(io(path))?;
    let mut chunks = out.chunks;
    if out.in_chunk > 0 {
        chunks.push(out.chunk.finish());
    }
    if FileEntry::chunks_for(bytes) == 0 {
        chunks.clear();
    }
    Ok(FileEntry {
        bytes,
        sha256: maxc_schema::hex(&sha2::Digest::finalize(out.sha)),
        chunk_blake3: chunks,
    })
}

#[allow(clippy::too_many_arguments)]
fn write_dir(
    tmp: &Path,
    model: &Path,
    loaded: &maxc_graph::pipeline::LoadedModel,
    opts: &CompileOptions,
    files: &BTreeMap<String, Vec<u8>>,
    weights: &StateDict,
    roles: BTreeMap<String, RoleEntry>,
    targets: Targets,
    progress: &mut dyn FnMut(&str),
) -> Result<u64, ExportError> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(io(tmp))?;
    }
    std::fs::create_dir_all(tmp).map_err(|e| {
        ExportError::Other(format!(
            "{}: cannot create the directory the artifact is written in before it is renamed \
             into place ({e})",
            tmp.display()
        ))
    })?;
    let mut entries = BTreeMap::new();
    let mut total = 0u64;
    for (name, bytes) in files {
        let path = tmp.join(name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        std::fs::write(&path, bytes).map_err(io(&path))?;
        entries.insert(
            name.clone(),
            FileEntry {
                bytes: bytes.len() as u64,
                sha256: sha256_hex(bytes),
                chunk_blake3: chunk_sums(bytes),
            },
        );
        total += bytes.len() as u64;
    }
    progress(&format!("writing {} weights", weights.len()));
    let wpath = tmp.join(WEIGHTS_FILE);
    let entry = write_weights(&wpath, weights)?;
    total += entry.bytes;
    entries.insert(WEIGHTS_FILE.into(), entry);
    let tokenizer = read_tokenizer(model)?;
    if let Some(why) = &tokenizer.left_out {
        tracing::warn!("{why}");
        progress(&format!("warning: {why}"));
    }
    if let Some(json) = &tokenizer.json {
        let bytes = json.as_bytes();
        let path = tmp.join(TOKENIZER_FILE);
        std::fs::write(&path, bytes).map_err(io(&path))?;
        entries.insert(
            TOKENIZER_FILE.into(),
            FileEntry {
                bytes: bytes.len() as u64,
                sha256: sha256_hex(bytes),
                chunk_blake3: chunk_sums(bytes),
            },
        );
        total += bytes.len() as u64;
    }
    let b = &opts.runtime.batch;
    // The decoder's KV cache pages (its page groups' windows known; the first role's where
    // there is no decoder).
    let kv_windows = loaded
        .roles
        .iter()
        .find(|(role, _)| role.name() == "decoder")
        .or_else(|| loaded.roles.iter().next())
        .and_then(|(_, rg)| rg.graph.kv_layout().map(|l| l.windows()))
        .unwrap_or_default();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        maxc_version: env!("CARGO_PKG_VERSION").into(),
        architecture: loaded.spec.architecture().into(),
        config: loaded.config_json.clone(),
        param_dtype: opts.weights.name(),
        runtime: RuntimeSettings {
            max_batch_size: b.max_batch_size as u64,
            max_seq_len: b.max_seq_len as u64,
            max_batch_input_tokens: b.max_batch_input_tokens as u64,
            enable_chunked_prefill: b.enable_chunked_prefill,
            data_parallel_degree: b.data_parallel_degree as u64,
            page_size: opts.runtime.kv.page_size as u64,
            kv_cache_pages: opts.runtime.kv.total_pages(b, &kv_windows) as u64,
            num_speculative_tokens: b.num_speculative_tokens as u64,
        },
        roles,
        targets,
        export_records: loaded.deployment.export_records(&opts.runtime),
        bos_token_id: token_ids(&loaded.config_json, "bos_token_id")
            .first()
            .copied(),
        eos_token_ids: token_ids(&loaded.config_json, "eos_token_id"),
        chat_template: tokenizer.chat_template,
        files: entries,
    };
    let mut text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| ExportError::Other(format!("manifest: {e}")))?;
    text.push('\n');
    let mpath = tmp.join(MANIFEST_FILE);
    std::fs::write(&mpath, &text).map_err(io(&mpath))?;
    Ok(total + text.len() as u64)
}
