//! Symbolic dims: a dim is a fixed size or a named symbol bounded at compile time by `max_dims`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// One dimension of a tensor type.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// A size known when the graph is built.
    Fixed(usize),
    /// A size known only per step, named (`total_seq_len`, `batch_size`, ...).
    Sym(String),
}

/// The per-step dims that decoder graphs use, by the names `max_dims` bounds.
pub mod names {
    /// Sequences in the step.
    pub const BATCH_SIZE: &str = "batch_size";
    /// Tokens in the step's ragged token stream.
    pub const TOTAL_SEQ_LEN: &str = "total_seq_len";
    /// Length of `input_row_offsets` (`batch_size + 1`).
    pub const INPUT_ROW_OFFSETS_LEN: &str = "input_row_offsets_len";
    /// Columns of the KV page lookup table (pages per context).
    pub const MAX_NUM_PAGES: &str = "max_num_pages";
    /// Pages in the KV cache.
    pub const TOTAL_NUM_PAGES: &str = "total_num_pages";
    /// Logit rows of a step: the token rows its `logit_indices` input names.
    pub const LOGIT_ROWS: &str = "logit_rows";
}

impl Dim {
    /// A symbolic dim.
    pub fn sym(name: &str) -> Self {
        Dim::Sym(name.to_string())
    }

    /// The fixed size, if known.
    pub fn fixed(&self) -> Option<usize> {
        match self {
            Dim::Fixed(n) => Some(*n),
            Dim::Sym(_) => None,
        }
    }

    /// The size under `bindings` (symbol -> size), if every symbol is bound.
    pub fn resolve(&self, bindings: &BTreeMap<String, usize>) -> Option<usize> {
        match self {
            Dim::Fixed(n) => Some(*n),
            Dim::Sym(s) => bindings.get(s).copied(),
        }
    }
}

impl From<usize> for Dim {
    fn from(n: usize) -> Self {
        Dim::Fixed(n)
    }
}

impl From<&str> for Dim {
    fn from(s: &str) -> Self {
        Dim::sym(s)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(s) => f.write_str(s),
        }
    }
}

/// A tensor shape: fixed and symbolic dims.
pub type Shape = Vec<Dim>;

/// `[a, b, c]` for a shape.
pub fn shape_string(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Whether two shapes hold the same number of elements for every binding of their symbols.
pub fn same_volume(a: &[Dim], b: &[Dim]) -> bool {
    fn split(s: &[Dim]) -> (usize, Vec<&str>) {
        let mut fixed = 1usize;
        let mut syms: Vec<&str> = Vec::new();
        for d in s {
            match d {
                Dim::Fixed(n) => fixed *= n,
                Dim::Sym(n) => syms.push(n),
            }
        }
        syms.sort_unstable();
        (fixed, syms)
    }
    split(a) == split(b)
}
