//! One module per `maxc` subcommand.

pub mod compile;
pub mod diff;
pub mod dump;
pub mod eval;
pub mod generate;
pub mod inspect;
pub mod models;
pub mod plan;
pub mod run;
pub mod tokenize;
