//! The Cranelift ISA for a code-generation target ([`CpuTarget`], from the schema: a fixed
//! architecture, calling convention and feature set, never host-detected, so compiler output is
//! deterministic), built with explicit settings.

use super::CpuError;
use cranelift_codegen::isa::{self, OwnedTargetIsa};
use cranelift_codegen::settings::{self, Configurable};
pub use maxc_schema::CpuTarget;

/// The Cranelift ISA for `target`, with explicit settings so output does not depend on the host.
pub(crate) fn build_isa(target: &CpuTarget) -> Result<OwnedTargetIsa, CpuError> {
    let isa_err = |message: String| CpuError::Isa {
        arch: target.arch.clone(),
        message,
    };
    // The triple only selects the calling convention the target names.
    let triple = match (target.arch.as_str(), target.abi.as_str()) {
        ("x86_64", "sysv64") => "x86_64-unknown-linux-gnu",
        ("aarch64", "darwin-arm64") => "aarch64-apple-darwin",
        ("aarch64", "aapcs64") => "aarch64-unknown-linux-gnu",
        (arch, abi) => {
            return Err(CpuError::UnsupportedArch {
                arch: format!("{arch} with the {abi} calling convention"),
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
