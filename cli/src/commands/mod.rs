//! One module per `maxc` subcommand.

pub mod eval;
pub mod models;
pub mod plan;
