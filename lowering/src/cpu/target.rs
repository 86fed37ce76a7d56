//! The code-generation target: a fixed architecture and feature set, the host check the
//! runtime mirrors, and the Cranelift ISA built from it with explicit settings.

use super::CpuError;
use cranelift_codegen::isa::{self, OwnedTargetIsa};
use cranelift_codegen::settings::{self, Configurable};

/// The fixed code-generation target: architecture + feature set. Fixed, not host-detected, so
/// compiler output is deterministic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuTarget {
    /// `"x86_64"` or `"aarch64"`.
    pub arch: String,
    /// Instruction-set features the code may use, e.g. `["sse3", "ssse3", "sse4.1", ...]`.
    pub features: Vec<String>,
}

impl CpuTarget {
    /// The baseline target for the architecture this compiler runs on: x86-64-v2 (128-bit SSE
    /// up to SSE4.2) on x86_64, NEON on aarch64; an error on other architectures.
    pub fn host_baseline() -> Result<Self, CpuError> {
        let (arch, features): (&str, &[&str]) = match std::env::consts::ARCH {
            "x86_64" => ("x86_64", &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt"]),
            "aarch64" => ("aarch64", &["neon"]),
            other => {
                return Err(CpuError::UnsupportedArch {
                    arch: other.to_string(),
                })
            }
        };
        Ok(CpuTarget {
            arch: arch.to_string(),
            features: features.iter().map(|f| f.to_string()).collect(),
        })
    }

    /// Whether the machine running this code has the target's architecture and every feature.
    pub fn host_supports(&self) -> bool {
        let target = maxc_runtime::schema::CpuTarget {
            arch: self.arch.clone(),
            features: self.features.clone(),
        };
        maxc_runtime::cpu::target::host_supports(&target).is_none()
    }
}

/// The Cranelift ISA for `target`, with explicit settings so output does not depend on the host.
pub(crate) fn build_isa(target: &CpuTarget) -> Result<OwnedTargetIsa, CpuError> {
    let isa_err = |message: String| CpuError::Isa {
        arch: target.arch.clone(),
        message,
    };
    let triple = match target.arch.as_str() {
        // kernel.rs fixes System V on x86-64, whatever the host OS.
        "x86_64" => "x86_64-unknown-linux-gnu",
        "aarch64" if cfg!(target_os = "macos") => "aarch64-apple-darwin",
        "aarch64" => "aarch64-unknown-linux-gnu",
        other => {
            return Err(CpuError::UnsupportedArch {
                arch: other.to_string(),
            })
        }
    };
    let mut shared = settings::builder();
    let debug = if cfg!(debug_assertions) {
        "true"
    } else {
        "false"
    };
    for (name, value) in [
        ("opt_level", "speed"),
        ("is_pic", "true"),
        ("enable_verifier", debug),
        ("enable_probestack", "false"),
    ] {
        shared
            .set(name, value)
            .map_err(|e| isa_err(format!("setting `{name}`: {e}")))?;
    }
    let mut builder = isa::lookup_by_name(triple).map_err(|e| isa_err(format!("{triple}: {e}")))?;
    for feature in &target.features {
        if let Some(flag) = isa_flag(&target.arch, feature)? {
            builder
                .enable(flag)
                .map_err(|e| isa_err(format!("enabling `{flag}` for `{feature}`: {e}")))?;
        }
    }
    builder
        .finish(settings::Flags::new(shared))
        .map_err(|e| isa_err(e.to_string()))
}

/// Target features and their Cranelift ISA flags (`None`: part of the architecture baseline).
const X86_FEATURES: &[(&str, Option<&str>)] = &[
    ("sse3", Some("has_sse3")),
    ("ssse3", Some("has_ssse3")),
    ("sse4.1", Some("has_sse41")),
    ("sse4.2", Some("has_sse42")),
    ("popcnt", Some("has_popcnt")),
    ("cmpxchg16b", Some("has_cmpxchg16b")),
    ("avx", Some("has_avx")),
    ("avx2", Some("has_avx2")),
    ("fma", Some("has_fma")),
    ("bmi1", Some("has_bmi1")),
    ("bmi2", Some("has_bmi2")),
    ("lzcnt", Some("has_lzcnt")),
];
const AARCH64_FEATURES: &[(&str, Option<&str>)] = &[
    ("neon", None),
    ("lse", Some("has_lse")),
    ("fp16", Some("has_fp16")),
    ("dotprod", Some("has_dotprod")),
];

/// The Cranelift flag for one target feature.
fn isa_flag(arch: &str, feature: &str) -> Result<Option<&'static str>, CpuError> {
    let table = if arch == "x86_64" {
        X86_FEATURES
    } else {
        AARCH64_FEATURES
    };
    table
        .iter()
        .find(|(name, _)| *name == feature)
        .map(|(_, flag)| *flag)
        .ok_or_else(|| CpuError::UnknownFeature {
            arch: arch.to_string(),
            feature: feature.to_string(),
            known: table
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}
