//! ptxas: assembles PTX for a real architecture and reports each kernel's resources.

use super::{CudaError, CudaTarget};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// What ptxas reports for one kernel (entry function).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The entry's name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of register spill stores.
    pub spill_stores: u32,
    /// Bytes of register spill loads.
    pub spill_loads: u32,
    /// Bytes of static shared memory per block.
    pub shared_bytes: u32,
}

/// Assembles `ptx` with `$MAXC_PTXAS` (else `ptxas` on `PATH`) `-arch=sm_XY -v` in a
/// temporary directory and returns every entry function's resources, in ptxas' order.
pub fn ptxas_check(ptx: &str, target: &CudaTarget) -> Result<Vec<KernelResources>, CudaError> {
    let program = std::env::var_os("MAXC_PTXAS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("ptxas"));
    let dir = TempDir::new()?;
    let input = dir.0.join("module.ptx");
    std::fs::write(&input, ptx).map_err(|source| CudaError::Io {
        what: format!("writing {}", input.display()),
        source,
    })?;
    let output = Command::new(&program)
        .arg(format!("-arch={}", target.arch))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(dir.0.join("module.cubin"))
        .output()
        .map_err(|e| CudaError::PtxasUnavailable {
            why: format!("cannot run `{}`: {e}", program.display()),
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() {
        return Err(CudaError::Ptxas {
            program: program.display().to_string(),
            arch: target.arch.clone(),
            status: output.status.to_string(),
            output: text,
        });
    }
    parse_report(&text)
}

/// Reads ptxas' `-v` report: per `Compiling entry function 'NAME'`, its `Function properties`
/// spill line and its `Used N registers, ... S bytes smem` line.
fn parse_report(text: &str) -> Result<Vec<KernelResources>, CudaError> {
    let bad = |what: String| CudaError::PtxasReport {
        what,
        output: text.to_string(),
    };
    let mut kernels: Vec<(KernelResources, bool)> = Vec::new();
    // The function the latest `Function properties for` line named.
    let mut properties_of = String::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            kernels.push((
                KernelResources {
                    name,
                    registers: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                    shared_bytes: 0,
                },
                false,
            ));
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            properties_of = rest.trim().to_string();
        } else if line.contains("bytes spill stores") {
            if let Some((k, _)) = kernels.last_mut().filter(|(k, _)| k.name == properties_of) {
                k.spill_stores = number_before(line, " bytes spill stores")
                    .ok_or_else(|| bad(format!("no spill-store count in `{line}`")))?;
                k.spill_loads = number_before(line, " bytes spill loads")
                    .ok_or_else(|| bad(format!("no spill-load count in `{line}`")))?;
            }
        } else if line.contains("Used ") && line.contains(" registers") {
            let (k, seen) = kernels
                .last_mut()
                .ok_or_else(|| bad(format!("`{line}` before any entry function")))?;
            k.registers = number_before(line, " registers")
                .ok_or_else(|| bad(format!("no register count in `{line}`")))?;
            k.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
            *seen = true;
        }
    }
    if let Some((k, _)) = kernels.iter().find(|(_, seen)| !seen) {
        return Err(bad(format!("no `Used N registers` line for `{}`", k.name)));
    }
    Ok(kernels.into_iter().map(|(k, _)| k).collect())
}

/// The number just before `suffix` in `line` (`"... 12 bytes smem"` → 12).
fn number_before(line: &str, suffix: &str) -> Option<u32> {
    let head = &line[..line.find(suffix)?];
    head.split_whitespace().last()?.parse().ok()
}

/// A fresh directory under the system temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self, CudaError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "maxc-ptxas-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|source| CudaError::Io {
            what: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover temporary directory is harmless.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::parse_report;

    #[test]
    fn reads_entries_and_skips_device_functions() {
        let report = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'moe' for 'sm_90'
ptxas info    : Function properties for moe
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 128 bytes smem
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 99 bytes spill stores, 99 bytes spill loads
ptxas info    : Compiling entry function 'top_k' for 'sm_90'
ptxas info    : Function properties for top_k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 23 registers, used 0 barriers
";
        let ks = parse_report(report).expect("parses");
        assert_eq!(ks.len(), 2);
        assert_eq!(
            (ks[0].name.as_str(), ks[0].registers, ks[0].spill_stores),
            ("moe", 32, 8)
        );
        assert_eq!((ks[0].spill_loads, ks[0].shared_bytes), (4, 128));
        assert_eq!(
            (ks[1].name.as_str(), ks[1].registers, ks[1].shared_bytes),
            ("top_k", 23, 0)
        );
    }
}
