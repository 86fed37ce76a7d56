//! The CUDA target architecture.

use super::CudaError;

/// The GPU architecture kernels are generated and compiled for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudaTarget {
    /// `"sm_XY"` (or `"sm_XYa"`); NVRTC gets `--gpu-architecture=compute_XY`, ptxas
    /// `-arch=sm_XY`.
    pub arch: String,
}

impl Default for CudaTarget {
    /// `sm_90` (Hopper).
    fn default() -> Self {
        CudaTarget {
            arch: "sm_90".to_string(),
        }
    }
}

impl CudaTarget {
    /// The lowest compute capability the backend supports.
    pub const MIN_SM: u32 = 70;

    /// The target `arch` (`"sm_90"`, `"sm_80"`, `"sm_90a"`...); an error for anything else or
    /// an architecture below [`CudaTarget::MIN_SM`].
    pub fn parse(arch: &str) -> Result<Self, CudaError> {
        let bad = || CudaError::Arch {
            arch: arch.to_string(),
        };
        let rest = arch.strip_prefix("sm_").ok_or_else(bad)?;
        let digits = rest.strip_suffix('a').unwrap_or(rest);
        if digits.is_empty() || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let sm: u32 = digits.parse().map_err(|_| bad())?;
        if sm < Self::MIN_SM {
            return Err(bad());
        }
        Ok(CudaTarget {
            arch: arch.to_string(),
        })
    }

    /// The compute capability as a number: `sm_90` → 90. Assumes a parsed target; an invalid
    /// `arch` gives 0.
    pub fn sm(&self) -> u32 {
        let rest = self.arch.strip_prefix("sm_").unwrap_or("");
        rest.strip_suffix('a').unwrap_or(rest).parse().unwrap_or(0)
    }

    /// The virtual architecture NVRTC compiles for: `compute_90` (or `compute_90a`).
    pub fn compute(&self) -> String {
        format!("compute_{}", self.arch.strip_prefix("sm_").unwrap_or(""))
    }

    /// Whether the target has the `mma.sync.m16n8k16` bf16/f16 tensor-core instructions.
    pub fn has_mma_bf16(&self) -> bool {
        self.sm() >= 80
    }
}
