//! The CUDA executor: runs a role's PTX module on an NVIDIA GPU through the CUDA driver API
//! (cudarc, loaded dynamically). No NVRTC: the PTX was compiled ahead of time.

mod executor;
pub mod nvtx;

pub use executor::{cuda_available, CudaExecutor};
