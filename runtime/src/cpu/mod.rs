//! The CPU executor: native code loading, library kernels and the executor.

pub mod code;
pub mod executor;
pub mod library;

pub use executor::CpuExecutor;
