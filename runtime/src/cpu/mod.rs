//! The CPU executor's pieces: native code loading and (in time) the executor itself.

pub mod code;
