//! maxc's runtime: the artifact schema, its reader and validation, and the executors. It holds
//! no compiler: artifacts are compiled ahead of time by `maxc compile`.

pub mod cpu;
pub mod schema;
