//! The CPU backend: Cranelift-generated native code for the kernel IR.
