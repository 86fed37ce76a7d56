//! The CPU executor: native code loading, library kernels and the executor.

#[cfg(target_arch = "x86_64")]
mod attend;
#[cfg(target_arch = "x86_64")]
mod attend_avx2;
pub mod code;
pub mod ep;
#[cfg(target_arch = "x86_64")]
mod ew;
pub mod executor;
pub mod library;
pub mod pool;
mod simd;
#[cfg(target_arch = "x86_64")]
mod tile;
pub mod weights;

pub use executor::CpuExecutor;
