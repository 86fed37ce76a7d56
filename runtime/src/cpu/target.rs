//! Whether this machine can run code generated for a [`CpuTarget`].

use crate::schema::CpuTarget;

/// `None` when this machine runs `target`'s code; otherwise what it lacks.
pub fn host_supports(target: &CpuTarget) -> Option<String> {
    let arch = std::env::consts::ARCH;
    if target.arch != arch {
        return Some(format!(
            "the artifact's CPU code is for {}, this machine is {arch}",
            target.arch
        ));
    }
    let missing: Vec<&str> = target
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
    fn another_architecture_or_an_unknown_feature_is_refused() {
        let other = CpuTarget {
            arch: "riscv64".into(),
            features: vec![],
        };
        assert!(host_supports(&other).unwrap().contains("riscv64"));
        let unknown = CpuTarget {
            arch: std::env::consts::ARCH.into(),
            features: vec!["quantum-simd".into()],
        };
        assert!(host_supports(&unknown).unwrap().contains("quantum-simd"));
    }
}
