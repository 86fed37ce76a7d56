//! The instruction sets the CPU kernels are compiled for, and the one this CPU runs: detected
//! once per process (`MAXC_CPU_ISA` may ask for a lower one).

/// The instruction sets the inner loops are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Baseline,
}

/// The best instruction set this CPU has for the library kernels, or a lower one that
/// `MAXC_CPU_ISA` (`avx2` or `baseline`) asks for: the kernels a CPU without AVX-512 runs,
/// measured on one with it. A value that names no lower set is ignored, with a warning.
pub fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let best = if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("f16c")
            {
                Isa::Avx512
            } else if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                Isa::Avx2
            } else {
                Isa::Baseline
            };
            let rank = |i: Isa| match i {
                Isa::Avx512 => 2,
                Isa::Avx2 => 1,
                Isa::Baseline => 0,
            };
            match std::env::var("MAXC_CPU_ISA").ok().as_deref() {
                None => best,
                Some(v) => {
                    let asked = match v {
                        "avx512" => Some(Isa::Avx512),
                        "avx2" => Some(Isa::Avx2),
                        "baseline" => Some(Isa::Baseline),
                        _ => None,
                    };
                    match asked {
                        Some(a) if rank(a) <= rank(best) => a,
                        _ => {
                            tracing::warn!(
                                "MAXC_CPU_ISA={v} ignored: expected avx512, avx2 or baseline, \
                                 at most what this CPU has ({best:?})"
                            );
                            best
                        }
                    }
                }
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    Isa::Baseline
}

/// Whether matmuls run on register tiles (AVX-512) on this CPU, faster than generated code at
/// every row count.
pub fn tiles_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa() == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether steps of a few rows run hand-vectorized kernels for every weight format on this CPU
/// (AVX-512 register tiles, or AVX2 row groups), faster than generated code at every row count.
pub fn few_rows_kernels_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return matches!(isa(), Isa::Avx512 | Isa::Avx2);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The name of the instruction set the weight kernels use on this CPU.
pub fn isa_name() -> &'static str {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "avx512",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "avx2+fma",
        Isa::Baseline => "baseline",
    }
}
