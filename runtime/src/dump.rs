//! The artifact as reviewable text: the manifest (maxc version normalised, file checksums left
//! to the structural files), per role a plan listing and one file per kernel, the weights by
//! key, dtype, shape and hash. `maxc dump` writes it, `maxc diff` compares it, and the golden
//! tests check it in.

use crate::schema::sha256_hex;
use crate::schema::{Extent, Manifest, Program, Storage};
use crate::Artifact;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The value that replaces the maxc version in dumps.
pub const NORMALISED_VERSION: &str = "<maxc version>";

/// The dump: relative file path -> text.
pub type Dump = BTreeMap<String, String>;

fn extent(e: &Extent) -> String {
    match e {
        Extent::Fixed(n) => n.to_string(),
        Extent::Step(d) => d.name().to_string(),
    }
}

fn shape(s: &[Extent]) -> String {
    format!("[{}]", s.iter().map(extent).collect::<Vec<_>>().join(", "))
}

/// The text form of `artifact`.
pub fn dump(artifact: &Artifact) -> Dump {
    let mut out = Dump::new();
    let mut m: Manifest = artifact.manifest.clone();
    m.maxc_version = NORMALISED_VERSION.into();
    m.files.clear();
    let mut text = serde_json::to_string_pretty(&m).unwrap_or_default();
    text.push('\n');
    out.insert("manifest.json".into(), text);
    for (role, p) in &artifact.programs {
        let cpu = artifact.cpu.get(role);
        out.insert(
            format!("{role}/plan.txt"),
            plan(role, p, artifact.manifest.roles.get(role).map(|r| &r.dims)),
        );
        let starts: Vec<u64> = {
            let mut s: Vec<u64> = cpu
                .map(|c| c.entries.iter().flatten().copied().collect())
                .unwrap_or_default();
            s.sort_unstable();
            s
        };
        for (i, k) in p.kernels.iter().enumerate() {
            let mut t = format!("kernel {}\nkind {}\n", k.name, k.body.kind());
            match cpu.and_then(|c| c.entries.get(i).copied().flatten().map(|e| (c, e))) {
                Some((c, start)) => {
                    let end = starts
                        .iter()
                        .copied()
                        .find(|&x| x > start)
                        .unwrap_or(c.code.len() as u64);
                    let code = &c.code[start as usize..end as usize];
                    let _ = writeln!(
                        t,
                        "cpu generated, {} bytes (with padding), sha256 {}",
                        code.len(),
                        sha256_hex(code)
                    );
                }
                None => t.push_str("cpu library\n"),
            }
            if let Some(c) = artifact.cuda.get(role).and_then(|c| c.kernels.get(i)) {
                let _ = writeln!(
                    t,
                    "cuda {}: launch {:?}, {} registers, spills {}/{} B, shared {} B",
                    c.name, c.launch, c.registers, c.spill_stores, c.spill_loads, c.shared_bytes
                );
            }
            let _ = writeln!(t, "\n{:#?}", k.body);
            out.insert(format!("{role}/kernels/{}.txt", k.name), t);
        }
    }
    for role in artifact.cuda.keys() {
        let name = format!("{role}/kernels.cu");
        if let Ok(text) = std::fs::read_to_string(artifact.dir.join(&name)) {
            out.insert(name, text);
        }
    }
    let mut w = String::new();
    for (key, v) in artifact.weights() {
        let bytes = artifact
            .weight(key)
            .map(|(_, b)| sha256_hex(b))
            .unwrap_or_default();
        let _ = writeln!(w, "{key} {} {:?} {bytes}", v.dtype.name(), v.shape);
    }
    out.insert("weights.txt".into(), w);
    if let Some(tok) = artifact.manifest.files.get("tokenizer.json") {
        out.insert(
            "tokenizer.txt".into(),
            format!(
                "tokenizer.json {} bytes, sha256 {}\n",
                tok.bytes, tok.sha256
            ),
        );
    }
    out
}

fn plan(role: &str, p: &Program, dims: Option<&BTreeMap<String, u64>>) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "role {role}");
    let _ = writeln!(t, "arena_bytes {}", p.arena_bytes);
    let _ = writeln!(t, "vocab_size {}", p.vocab_size);
    match &p.kv {
        Some(kv) => {
            let _ = writeln!(t, "kv {kv:?}");
        }
        None => {
            let _ = writeln!(t, "kv none");
        }
    }
    for (d, b) in dims.into_iter().flatten() {
        let _ = writeln!(t, "dim {d} <= {b}");
    }
    let _ = writeln!(t, "\nbuffers");
    for (i, b) in p.buffers.iter().enumerate() {
        let at = match &b.storage {
            Storage::Arena { offset } => format!("arena @{offset}"),
            Storage::Param { key } => format!("weight {key}"),
            Storage::Input => "input".into(),
            Storage::KvCache => "kv cache".into(),
            Storage::KvCacheLayer { layer } => format!("kv cache from layer {layer}"),
            Storage::RopeTable { table } => format!("rope table {table}"),
        };
        let _ = writeln!(
            t,
            "  b{i:<4} {:<48} {}{} {at}",
            b.name,
            b.dtype.name(),
            shape(&b.shape)
        );
    }
    let _ = writeln!(t, "\ninputs {:?}\noutputs {:?}", p.inputs, p.outputs);
    for (i, r) in p.rope_tables.iter().enumerate() {
        let bits: Vec<u8> = r.inv_freq.iter().flat_map(|f| f.to_le_bytes()).collect();
        let _ = write!(
            t,
            "rope table {i}: {} frequencies, sha256 {}",
            r.inv_freq.len(),
            sha256_hex(&bits)
        );
        if r.scale != 1.0 {
            let _ = write!(t, ", scaled by {}", r.scale);
        }
        if let Some(l) = &r.long {
            let bits: Vec<u8> = l.inv_freq.iter().flat_map(|f| f.to_le_bytes()).collect();
            let _ = write!(t, ", from position {} sha256 {}", l.from, sha256_hex(&bits));
        }
        let _ = writeln!(t);
    }
    let _ = writeln!(t, "\nlaunches");
    for (i, l) in p.launches.iter().enumerate() {
        let args: Vec<String> = l.buffers.iter().map(|b| format!("b{b}")).collect();
        let name = p
            .kernels
            .get(l.kernel as usize)
            .map_or("?", |k| k.name.as_str());
        let _ = writeln!(
            t,
            "  {i:>4} {name}({})  # {}",
            args.join(", "),
            l.nodes.join(", ")
        );
    }
    t
}

/// Writes `dump` under `dir`.
pub fn write_dump(dump: &Dump, dir: &std::path::Path) -> std::io::Result<()> {
    for (name, text) in dump {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)?;
    }
    Ok(())
}

/// Reads a dump written by [`write_dump`].
pub fn read_dump(dir: &std::path::Path) -> std::io::Result<Dump> {
    let mut out = Dump::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let path = e?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(dir).map_err(std::io::Error::other)?;
                let name = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                out.insert(name, std::fs::read_to_string(&path)?);
            }
        }
    }
    Ok(out)
}
