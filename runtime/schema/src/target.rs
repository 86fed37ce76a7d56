//! CPU code-generation targets: what generated code needs from the machine that runs it, and
//! the one check of a host against it (the compiler's tests and the runtime both use it).

use serde::{Deserialize, Serialize};

/// A CPU code-generation target: architecture, calling convention and the instruction-set
/// features the code uses.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CpuTarget {
    /// `x86_64` or `aarch64`.
    pub arch: String,
    /// The kernels' calling convention: `sysv64` (x86-64 System V, on every OS), `aapcs64`
    /// (aarch64 Linux) or `darwin-arm64` (aarch64 Apple).
    pub abi: String,
    /// Features the code needs (`sse4.2`, ...), sorted.
    pub features: Vec<String>,
}

impl CpuTarget {
    /// The baseline target for the architecture this process runs on: x86-64-v2 (128-bit SSE
    /// up to SSE4.2, popcnt) on x86_64, NEON on aarch64; `None` on other architectures.
    pub fn host_baseline() -> Option<Self> {
        let (arch, features): (&str, &[&str]) = match std::env::consts::ARCH {
            "x86_64" => ("x86_64", &["popcnt", "sse3", "sse4.1", "sse4.2", "ssse3"]),
            "aarch64" => ("aarch64", &["neon"]),
            _ => return None,
        };
        Some(CpuTarget {
            arch: arch.to_string(),
            abi: host_abi()?.to_string(),
            features: features.iter().map(|f| f.to_string()).collect(),
        })
    }

    /// `None` when this machine runs the target's code; otherwise what it lacks.
    pub fn host_lacks(&self) -> Option<String> {
        let arch = std::env::consts::ARCH;
        if self.arch != arch {
            return Some(format!(
                "the artifact's CPU code is for {}, this machine is {arch}",
                self.arch
            ));
        }
        let abi = host_abi().unwrap_or("unknown");
        if self.abi != abi {
            return Some(format!(
                "the artifact's CPU code uses the {} calling convention, this runtime calls kernels with {abi}",
                self.abi
            ));
        }
        let missing: Vec<&str> = self
            .features
            .iter()
            .map(String::as_str)
            .filter(|f| !has_feature(f))
            .collect();
        if missing.is_empty() {
            None
        } else {
            Some(format!(
                "the artifact's CPU code needs {}, which this CPU lacks",
                missing.join(", ")
            ))
        }
    }

    /// Whether this machine runs the target's code.
    pub fn host_supports(&self) -> bool {
        self.host_lacks().is_none()
    }
}

/// The calling convention the runtime uses to call kernels on this machine (see
/// [`CpuTarget::abi`]); `None` where maxc generates no CPU code.
pub fn host_abi() -> Option<&'static str> {
    if cfg!(target_arch = "x86_64") {
        Some("sysv64")
    } else if cfg!(all(target_arch = "aarch64", target_vendor = "apple")) {
        Some("darwin-arm64")
    } else if cfg!(target_arch = "aarch64") {
        Some("aapcs64")
    } else {
        None
    }
}

#[cfg(target_arch = "x86_64")]
fn has_feature(f: &str) -> bool {
    match f {
        "sse2" => std::arch::is_x86_feature_detected!("sse2"),
        "sse3" => std::arch::is_x86_feature_detected!("sse3"),
        "ssse3" => std::arch::is_x86_feature_detected!("ssse3"),
        "sse4.1" => std::arch::is_x86_feature_detected!("sse4.1"),
        "sse4.2" => std::arch::is_x86_feature_detected!("sse4.2"),
        "popcnt" => std::arch::is_x86_feature_detected!("popcnt"),
        "avx" => std::arch::is_x86_feature_detected!("avx"),
        "avx2" => std::arch::is_x86_feature_detected!("avx2"),
        "fma" => std::arch::is_x86_feature_detected!("fma"),
        "bmi1" => std::arch::is_x86_feature_detected!("bmi1"),
        "bmi2" => std::arch::is_x86_feature_detected!("bmi2"),
        "lzcnt" => std::arch::is_x86_feature_detected!("lzcnt"),
        "cmpxchg16b" => std::arch::is_x86_feature_detected!("cmpxchg16b"),
        _ => false,
    }
}

#[cfg(target_arch = "aarch64")]
fn has_feature(f: &str) -> bool {
    match f {
        "neon" => std::arch::is_aarch64_feature_detected!("neon"),
        "lse" => std::arch::is_aarch64_feature_detected!("lse"),
        "fp16" => std::arch::is_aarch64_feature_detected!("fp16"),
        "dotprod" => std::arch::is_aarch64_feature_detected!("dotprod"),
        _ => false,
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn has_feature(_: &str) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_architecture_abi_or_an_unknown_feature_is_refused() {
        let Some(host) = CpuTarget::host_baseline() else {
            return;
        };
        assert!(host.host_supports(), "{:?}", host.host_lacks());
        let other = CpuTarget {
            arch: "riscv64".into(),
            ..host.clone()
        };
        assert!(other.host_lacks().unwrap().contains("riscv64"));
        let win = CpuTarget {
            abi: "win64".into(),
            ..host.clone()
        };
        assert!(win.host_lacks().unwrap().contains("win64"));
        let unknown = CpuTarget {
            features: vec!["quantum-simd".into()],
            ..host
        };
        assert!(unknown.host_lacks().unwrap().contains("quantum-simd"));
    }
}
