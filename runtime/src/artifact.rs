//! Reading an artifact: the manifest, checksums of every file, the programs, the native code and
//! the weights (memory-mapped, or read into huge pages for the CPU executor: [`WeightMemory`]).
//! Anything that differs from what the manifest says is an error naming the file.

use crate::error::{Result, RuntimeError};
use crate::schema::{
    bincode_config, manifest::FileEntry, CpuModule, CudaModule, DType, Manifest, Program,
    ProgramEnv, StepDim, StepLimits, WeightInfo, FORMAT_VERSION, MANIFEST_FILE, WEIGHTS_FILE,
};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::schema::sha256_hex;

/// Where a weight's bytes are in the mapped weights file.
#[derive(Clone, Debug)]
pub struct WeightView {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the file.
    pub range: std::ops::Range<usize>,
}

/// Where an opened artifact keeps its weights' bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightMemory {
    /// The file mapped read-only: no copy, pages shared through the page cache (inspection
    /// tools, the CUDA executor, which uploads the weights once).
    Mapped,
    /// Read into anonymous memory on transparent huge pages ([`crate::hugemem`]): the CPU
    /// executor streams every weight byte each decode step, about 1.4x as fast from 2 MiB pages.
    HugePages,
    /// Mapped and checked at open, as [`WeightMemory::Mapped`]; then, once the first step has
    /// run ([`Artifact::stage_weights`]), copied into huge pages by a thread of their own, and
    /// each executor moves its weight pointers there at its next step boundary. The first token
    /// waits for no copy (nor for the kernel zeroing the fresh huge pages), and decode gets
    /// the huge pages' speed a few steps later.
    Staged,
}

impl WeightMemory {
    /// For the CPU executor: staged into huge pages where the kernel offers them
    /// ([`WeightMemory::Staged`]), unless `MAXC_MAP_WEIGHTS` is set (to keep the page-cache
    /// mapping, e.g. for many processes serving one artifact); `MAXC_WEIGHTS=huge` reads them
    /// into huge pages before the first step instead.
    pub fn for_cpu() -> WeightMemory {
        let mapped = std::env::var_os("MAXC_MAP_WEIGHTS").is_some_and(|v| !v.is_empty());
        if mapped || !crate::hugemem::available() {
            WeightMemory::Mapped
        } else if std::env::var("MAXC_WEIGHTS").as_deref() == Ok("huge") {
            WeightMemory::HugePages
        } else {
            WeightMemory::Staged
        }
    }
}

/// The huge-page copy of [`WeightMemory::Staged`] weights.
#[derive(Default)]
struct Staging {
    started: std::sync::atomic::AtomicBool,
    /// The byte ranges of the weights file the executors of this process read
    /// ([`Artifact::want_weights`]); empty: every byte. Only these are copied, so a process
    /// that runs one tensor-parallel rank holds that rank's share (and the replicated
    /// weights), not every rank's.
    wanted: std::sync::Mutex<Vec<std::ops::Range<usize>>>,
    /// The copy once whole (`None`: it could not be made; the mapping stays).
    copy: std::sync::OnceLock<Option<crate::hugemem::HugeBuf>>,
}

/// A file's bytes, mapped or read.
enum FileBytes {
    Mapped(Mmap),
    Read(crate::hugemem::HugeBuf),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Read(b) => b,
        }
    }
}

/// An opened, validated artifact.
pub struct Artifact {
    /// The artifact directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Programs by role.
    pub programs: BTreeMap<String, Program>,
    /// Native CPU code by role.
    pub cpu: BTreeMap<String, CpuModule>,
    /// CUDA kernel entries by role (the PTX is `ROLE/module.ptx`).
    pub cuda: BTreeMap<String, CudaModule>,
    weights: Arc<FileBytes>,
    index: BTreeMap<String, WeightView>,
    /// Where the weights are staged into huge pages.
    staging: Option<Staging>,
}

/// `ranges` sorted and merged where they touch.
fn merge(mut ranges: Vec<std::ops::Range<usize>>) -> Vec<std::ops::Range<usize>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<std::ops::Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

fn weight_infos(index: &BTreeMap<String, WeightView>) -> BTreeMap<String, WeightInfo> {
    index
        .iter()
        .map(|(k, v)| {
            let info = WeightInfo {
                dtype: v.dtype,
                elements: v.shape.iter().product::<usize>() as u64,
                offset: v.range.start as u64,
            };
            (k.clone(), info)
        })
        .collect()
}

/// What a file's bytes hashed to: the whole, or each piece of
/// [`CHECKSUM_CHUNK`](crate::schema::manifest::CHECKSUM_CHUNK) bytes.
enum Sums {
    Whole(String),
    Pieces(Vec<String>),
}

/// `path`'s bytes, mapped, or read into huge pages where `memory` says so, with their sha256
/// (hex), whole or in pieces (`pieces`, hashed on every CPU at once); `bytes` is the size the
/// manifest gives (checked before anything is read).
fn load_file(
    path: &Path,
    memory: WeightMemory,
    bytes: u64,
    pieces: bool,
) -> Result<(FileBytes, Sums)> {
    use crate::schema::manifest::CHECKSUM_CHUNK;
    let io = |source| RuntimeError::Io {
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len != bytes {
        return Err(RuntimeError::artifact(
            path,
            format!("{len} bytes, the manifest says {bytes}"),
        ));
    }
    let piece = CHECKSUM_CHUNK as usize;
    match memory {
        // SAFETY: read-only map of an artifact file; artifacts are not modified while served.
        WeightMemory::Mapped | WeightMemory::Staged => {
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            let sums = if pieces {
                let bytes: &[u8] = &map;
                Sums::Pieces(
                    crate::hugemem::hash_pieces(map.len(), piece, &|from, to| Ok(&bytes[from..to]))
                        .map_err(io)?,
                )
            } else {
                Sums::Whole(sha256_hex(&map))
            };
            Ok((FileBytes::Mapped(map), sums))
        }
        WeightMemory::HugePages => {
            let len = usize::try_from(len).map_err(|_| {
                RuntimeError::artifact(path, "larger than this machine's address space")
            })?;
            if pieces {
                crate::hugemem::HugeBuf::read_file_piece_hashed(&file, len, piece)
                    .map(|(b, sums)| (FileBytes::Read(b), Sums::Pieces(sums)))
                    .map_err(io)
            } else {
                crate::hugemem::HugeBuf::read_file_hashed(&file, len)
                    .map(|(b, sum)| (FileBytes::Read(b), Sums::Whole(sum)))
                    .map_err(io)
            }
        }
    }
}

impl Artifact {
    /// Opens `dir`: checks the format version, the presence, size and sha256 of every file the
    /// manifest lists, decodes the programs and code, and validates every program
    /// ([`Program::validate`]) and code module against the manifest and the weights, before
    /// anything is mapped executable or any pointer computed. The weights stay mapped.
    pub fn open(dir: &Path) -> Result<Self> {
        Artifact::open_verified(dir, None, WeightMemory::Mapped)
    }

    /// [`Artifact::open`], first checking, where `key` is given, that the manifest carries a
    /// valid signature by it ([`crate::signature`]): nothing else of the artifact is read before,
    /// and exactly the verified bytes are parsed; the weights kept as `memory` says.
    pub fn open_verified(
        dir: &Path,
        key: Option<&ed25519_dalek::VerifyingKey>,
        memory: WeightMemory,
    ) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        if !dir.is_dir() {
            return Err(RuntimeError::artifact(
                dir,
                "not a directory; expected a maxc artifact (NAME.maxc/)",
            ));
        }
        let bytes = std::fs::read(&manifest_path).map_err(|e| {
            RuntimeError::artifact(
                &manifest_path,
                format!("cannot read the manifest ({e}); is this a maxc artifact?"),
            )
        })?;
        if let Some(key) = key {
            crate::signature::verify(dir, &bytes, key)?;
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| RuntimeError::artifact(&manifest_path, format!("not UTF-8: {e}")))?;
        let raw: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| RuntimeError::artifact(&manifest_path, format!("not valid JSON: {e}")))?;
        match raw.get("format_version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            Some(v) => {
                return Err(RuntimeError::artifact(
                    &manifest_path,
                    format!("artifact format version {v}, but this maxc reads format version {FORMAT_VERSION}: recompile the model with this maxc (`maxc compile`)"),
                ))
            }
            None => return Err(RuntimeError::artifact(&manifest_path, "no `format_version`")),
        }
        let manifest: Manifest = serde_json::from_value(raw).map_err(|e| {
            RuntimeError::artifact(
                &manifest_path,
                format!("does not match the manifest schema: {e}"),
            )
        })?;

        let mut maps: BTreeMap<String, FileBytes> = BTreeMap::new();
        for (name, entry) in &manifest.files {
            let path = dir.join(name);
            if name.contains("..") || Path::new(name).is_absolute() {
                return Err(RuntimeError::artifact(
                    &manifest_path,
                    format!("file `{name}` is outside the artifact"),
                ));
            }
            if !path.is_file() {
                return Err(RuntimeError::artifact(
                    &path,
                    "missing: the manifest lists it, the artifact does not have it",
                ));
            }
            let memory = if name == WEIGHTS_FILE {
                memory
            } else {
                WeightMemory::Mapped
            };
            let want_pieces = FileEntry::chunks_for(entry.bytes);
            if entry.chunk_blake3.len() != want_pieces {
                return Err(RuntimeError::artifact(
                    &manifest_path,
                    format!(
                        "file `{name}`: chunk_blake3 lists {} sums; a file of {} bytes has {want_pieces} pieces of {} bytes",
                        entry.chunk_blake3.len(),
                        entry.bytes,
                        crate::schema::manifest::CHECKSUM_CHUNK
                    ),
                ));
            }
            let (map, sums) = load_file(&path, memory, entry.bytes, want_pieces > 0)?;
            match sums {
                Sums::Whole(sum) if sum != entry.sha256 => {
                    return Err(RuntimeError::artifact(
                        &path,
                        format!("sha256 {sum} differs from the manifest's {}", entry.sha256),
                    ));
                }
                Sums::Pieces(sums) => {
                    let piece = crate::schema::manifest::CHECKSUM_CHUNK;
                    if let Some((i, (got, want))) = sums
                        .iter()
                        .zip(&entry.chunk_blake3)
                        .enumerate()
                        .find(|(_, (g, w))| g != w)
                    {
                        return Err(RuntimeError::artifact(
                            &path,
                            format!(
                                "bytes {}..{} (piece {i}) have BLAKE3 {got}, the manifest's chunk_blake3[{i}] is {want}",
                                i as u64 * piece,
                                ((i as u64 + 1) * piece).min(entry.bytes)
                            ),
                        ));
                    }
                }
                Sums::Whole(_) => {}
            }
            maps.insert(name.clone(), map);
        }
        fn take<'m>(
            maps: &'m BTreeMap<String, FileBytes>,
            name: &str,
            manifest: &Path,
        ) -> Result<&'m [u8]> {
            maps.get(name).map(|m| &m[..]).ok_or_else(|| {
                RuntimeError::artifact(
                    manifest,
                    format!("`{name}` is not among the manifest's files"),
                )
            })
        }
        let mut programs = BTreeMap::new();
        let mut cpu = BTreeMap::new();
        let mut cuda = BTreeMap::new();
        for (role, entry) in &manifest.roles {
            let bytes = take(&maps, &entry.program, &manifest_path)?;
            let (program, _): (Program, usize) =
                bincode::serde::decode_from_slice(bytes, bincode_config()).map_err(|e| {
                    RuntimeError::artifact(
                        dir.join(&entry.program),
                        format!("cannot decode the program: {e}"),
                    )
                })?;
            programs.insert(role.clone(), program);
            if let Some(code) = &entry.cpu_code {
                let (module, _): (CpuModule, usize) = bincode::serde::decode_from_slice(
                    take(&maps, code, &manifest_path)?,
                    bincode_config(),
                )
                .map_err(|e| {
                    RuntimeError::artifact(
                        dir.join(code),
                        format!("cannot decode the CPU code: {e}"),
                    )
                })?;
                cpu.insert(role.clone(), module);
            }
            if let Some(code) = &entry.cuda_code {
                let (module, _): (CudaModule, usize) = bincode::serde::decode_from_slice(
                    take(&maps, code, &manifest_path)?,
                    bincode_config(),
                )
                .map_err(|e| {
                    RuntimeError::artifact(
                        dir.join(code),
                        format!("cannot decode the CUDA entries: {e}"),
                    )
                })?;
                cuda.insert(role.clone(), module);
            }
        }
        let weights_path = dir.join(WEIGHTS_FILE);
        let weights = Arc::new(maps.remove(WEIGHTS_FILE).ok_or_else(|| {
            RuntimeError::artifact(
                &manifest_path,
                format!("`{WEIGHTS_FILE}` is not among the manifest's files"),
            )
        })?);
        let index = index_weights(&weights, &weights_path)?;
        let infos = weight_infos(&index);
        for (role, entry) in &manifest.roles {
            let program = &programs[role];
            let path = dir.join(&entry.program);
            let bad = |m: String| RuntimeError::artifact(&path, format!("role {role}: {m}"));
            if program.role != *role {
                return Err(bad(format!("the program is for role `{}`", program.role)));
            }
            if (program.kernels.len() as u64, program.launches.len() as u64)
                != (entry.kernels, entry.launches)
            {
                return Err(bad(format!(
                    "{} kernels and {} launches, the manifest says {} and {}",
                    program.kernels.len(),
                    program.launches.len(),
                    entry.kernels,
                    entry.launches
                )));
            }
            let env = ProgramEnv {
                dims: &entry.dims,
                max_seq_len: manifest.runtime.max_seq_len,
                page_size: manifest.runtime.page_size,
                arena_bytes: entry.arena_bytes,
                weights: &infos,
            };
            program.validate(&env).map_err(|e| bad(e.to_string()))?;
            if let (Some(module), Some(file)) = (cpu.get(role), &entry.cpu_code) {
                module
                    .validate(program)
                    .map_err(|e| RuntimeError::artifact(dir.join(file), e.to_string()))?;
            }
            if let (Some(module), Some(file)) = (cuda.get(role), &entry.cuda_code) {
                module
                    .validate(program, &entry.dims)
                    .map_err(|e| RuntimeError::artifact(dir.join(file), e.to_string()))?;
            }
        }
        Ok(Artifact {
            dir: dir.to_path_buf(),
            manifest,
            programs,
            cpu,
            cuda,
            weights,
            index,
            staging: (memory == WeightMemory::Staged).then(Staging::default),
        })
    }

    /// Starts copying [`WeightMemory::Staged`] weights into huge pages, on a thread of their
    /// own, unless that has started (or the weights are kept otherwise). Executors call it
    /// after a step; [`Artifact::staged_weights`] gives the copy once it is whole.
    pub fn stage_weights(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        let Some(staging) = &self.staging else {
            return;
        };
        if staging.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let artifact = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("maxc-weights".into())
            .spawn(move || {
                // The kernels' width ignores this one-off competition.
                let _own = maxc_kernels::pool::own_work();
                let src: &[u8] = &artifact.weights;
                let wanted = artifact
                    .staging
                    .as_ref()
                    .map(|s| merge(s.wanted.lock().unwrap_or_else(|e| e.into_inner()).clone()))
                    .unwrap_or_default();
                // The copy has the file's length and offsets; pages never written are never
                // touched, so they take no memory.
                let copy = crate::hugemem::HugeBuf::zeroed(src.len()).map(|mut b| {
                    if wanted.is_empty() {
                        b.as_mut_slice().copy_from_slice(src);
                    } else {
                        for r in &wanted {
                            b.as_mut_slice()[r.clone()].copy_from_slice(&src[r.clone()]);
                        }
                    }
                    b
                });
                if let Err(e) = &copy {
                    // The mapping stays: slower decode, nothing lost.
                    tracing::warn!("weights stay mapped: no memory for their huge-page copy ({e})");
                }
                if let Some(s) = &artifact.staging {
                    let _ = s.copy.set(copy.ok());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("weights stay mapped: cannot start the copy ({e})");
            let _ = staging.copy.set(None);
        }
    }

    /// Blocks while a started huge-page copy of staged weights is being made (benchmarks
    /// measure after it).
    pub fn wait_for_staged_weights(&self) {
        use std::sync::atomic::Ordering;
        if let Some(s) = &self.staging {
            while s.started.load(Ordering::Acquire) && s.copy.get().is_none() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    /// Notes that an executor of this process reads `ranges` of the weights file: with
    /// [`WeightMemory::Staged`] weights, the huge-page copy holds the ranges noted before it
    /// starts (every byte where none were).
    pub fn want_weights(&self, ranges: impl IntoIterator<Item = std::ops::Range<usize>>) {
        if let Some(s) = &self.staging {
            s.wanted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(ranges);
        }
    }

    /// Drops the mapped weights' pages from this process's memory (they were read whole when
    /// the checksums were checked), once an executor has moved to the staged copy: an
    /// executor still reading the mapping faults them back in from the page cache, and drops
    /// them again when it moves.
    pub fn release_mapped_weights(&self) {
        if let (Some(_), FileBytes::Mapped(m)) = (self.staged_weights(), &*self.weights) {
            // SAFETY: a read-only view of a file that nothing writes: a dropped page faults
            // back in with the same bytes.
            let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// The byte range of `bytes` in the weights file, where it lies in it.
    pub fn weights_range(&self, bytes: *const u8, len: usize) -> Option<std::ops::Range<usize>> {
        let file = self.weights.as_ptr_range();
        file.contains(&bytes).then(|| {
            let at = bytes as usize - file.start as usize;
            at..at + len
        })
    }

    /// The weights file's bytes where the executors first bind them (the mapping, or the
    /// huge pages they were read into).
    pub fn weights_bytes(&self) -> &[u8] {
        &self.weights
    }

    /// The huge-page copy of [`WeightMemory::Staged`] weights, once whole: the same bytes as
    /// [`Artifact::weights_bytes`], at another address.
    pub fn staged_weights(&self) -> Option<&[u8]> {
        self.staging
            .as_ref()?
            .copy
            .get()?
            .as_ref()
            .map(|b| b.as_slice())
    }

    /// The bound of each step dim of `role` (0 where the role does not use the dim; `logit_rows`
    /// defaults to `batch_size`'s bound) and the
    /// limits every step of it is checked against.
    pub fn step_limits(&self, role: &str) -> Result<([u64; StepDim::COUNT], StepLimits)> {
        let (entry, program) = match (self.manifest.roles.get(role), self.programs.get(role)) {
            (Some(e), Some(p)) => (e, p),
            _ => {
                return Err(RuntimeError::Input(format!(
                    "the artifact has no role `{role}`; it has {:?}",
                    self.programs.keys().collect::<Vec<_>>()
                )))
            }
        };
        let mut bounds = [0u64; StepDim::COUNT];
        for d in StepDim::ALL {
            bounds[d as usize] = entry.dims.get(d.name()).copied().unwrap_or(0);
        }
        // A program returning logits for every token row has no logit_rows dim: one row per
        // sequence is what its steps ask for.
        if !entry.dims.contains_key(StepDim::LogitRows.name()) {
            bounds[StepDim::LogitRows as usize] = bounds[StepDim::BatchSize as usize];
        }
        let limits = StepLimits {
            bounds,
            vocab_size: program.vocab_size,
            page_size: program.page_size(),
            max_seq_len: self.manifest.runtime.max_seq_len,
            kv_windows: program
                .kv
                .as_ref()
                .map(|kv| kv.windows())
                .unwrap_or_default(),
        };
        Ok((bounds, limits))
    }

    /// What [`Program::validate`] is told of each weight (dtype, elements, offset), by key.
    pub fn weight_infos(&self) -> BTreeMap<String, WeightInfo> {
        weight_infos(&self.index)
    }

    /// The weight under `key`, with its bytes.
    pub fn weight(&self, key: &str) -> Result<(&WeightView, &[u8])> {
        let view = self.index.get(key).ok_or_else(|| {
            RuntimeError::artifact(
                self.dir.join(WEIGHTS_FILE),
                format!("no weight `{key}`, which the program reads"),
            )
        })?;
        Ok((view, &self.weights[view.range.clone()]))
    }

    /// Every weight, by key.
    pub fn weights(&self) -> &BTreeMap<String, WeightView> {
        &self.index
    }
}

fn index_weights(map: &[u8], path: &Path) -> Result<BTreeMap<String, WeightView>> {
    let parsed = safetensors::SafeTensors::deserialize(map)
        .map_err(|e| RuntimeError::artifact(path, format!("not a valid safetensors file: {e}")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(map)
        .map_err(|e| RuntimeError::artifact(path, format!("not a valid safetensors file: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let base = map.as_ptr() as usize;
    let mut out = BTreeMap::new();
    for (key, view) in parsed.tensors() {
        let (dtype, shape) = DType::of_safetensors_tensor(&key, view.dtype(), view.shape(), &meta)
            .map_err(|m| RuntimeError::artifact(path, m))?;
        let start = view.data().as_ptr() as usize - base;
        out.insert(
            key,
            WeightView {
                dtype,
                shape,
                range: start..start + view.data().len(),
            },
        );
    }
    Ok(out)
}
