//! maxc's lowering: from a role's graph to a [`maxc_runtime::schema::Program`]: named passes
//! (fusion, memory plan) and the backends that turn the kernel IR into code.

pub mod cpu;
