//! One module per `maxc` subcommand.

pub mod bench;
#[cfg(feature = "compile")]
pub mod compile;
pub mod diff;
pub mod dump;
#[cfg(feature = "compile")]
pub mod eval;
pub mod generate;
pub mod inspect;
#[cfg(feature = "compile")]
pub mod models;
#[cfg(feature = "compile")]
pub mod plan;
pub mod profile;
pub mod run;
pub mod serve;
pub mod sign;
pub mod tokenize;
