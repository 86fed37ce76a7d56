//! The CPU executor: native code loading, the executor (which calls the library kernels of
//! `maxc-kernels` where they beat generated code) and the expert-parallel exchange.

pub mod code;
mod codrive;
pub mod ep;
pub mod executor;

pub use executor::{CpuExecutor, KernelChoice};
