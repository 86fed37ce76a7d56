//! The CUDA backend: CUDA C emitted from the kernel IR, compiled by NVRTC to PTX.
