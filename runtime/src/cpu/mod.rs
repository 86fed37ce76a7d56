//! The CPU executor: native code loading, host target checks, library kernels and the executor.

pub mod code;
pub mod executor;
pub mod library;
pub mod target;

pub use executor::CpuExecutor;
