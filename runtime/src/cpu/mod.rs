//! The CPU executor: native code loading, library kernels and the executor.

pub mod code;
pub mod executor;
pub mod library;
pub mod pool;
mod simd;
pub mod weights;

pub use executor::CpuExecutor;
