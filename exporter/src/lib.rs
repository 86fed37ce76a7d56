//! maxc's exporter: compiles a checkpoint into an artifact directory `NAME.maxc/`: the manifest,
//! per role the program (bincode 2) and native code, the prepared weights and the tokenizer.
//! The same inputs give the same bytes. The artifact is built in a temporary directory beside the
//! destination and renamed into place, so an interrupted compile leaves no artifact.

mod cuda;
mod write;

pub use write::{
    compile, CompileOptions, CompileSummary, CpuMatmul, ExportError, AUTO_MATMUL_MAX_ROWS,
};
