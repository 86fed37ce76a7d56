//! The checked shape of a matmul kernel, shared by the tiled f32 kernel ([`super::matmul`]) and
//! the tensor-core kernel ([`super::mma`]).

use super::source::Buf;
use maxc_schema::{GridExtent, Rows};

/// The checked shape of a matmul kernel.
pub(crate) struct Shape {
    /// Rows of `x`.
    pub rows: Rows,
    /// Output features.
    pub n: u64,
    /// Input features.
    pub k: u64,
    /// C type of `w` and `bias`.
    pub w_ty: &'static str,
    /// Whether a bias follows `w`.
    pub bias: bool,
}

impl Shape {
    /// The kernel's buffers: `x`, `w`, optionally `bias`, `out`.
    pub fn bufs(&self) -> Vec<Buf> {
        let mut bufs = vec![Buf::input("float", "x"), Buf::input(self.w_ty, "w")];
        if self.bias {
            bufs.push(Buf::input(self.w_ty, "bias"));
        }
        bufs.push(Buf::output("float", "out"));
        bufs
    }

    /// The C expression added to an output in column `col`.
    pub fn bias_expr(&self, col: &str) -> String {
        if self.bias {
            format!("maxc_ld(bias, {col})")
        } else {
            "0.0f".to_string()
        }
    }

    /// A grid of `tile_n`-column tiles in x and `tile_rows`-row tiles in y.
    pub fn grid(&self, tile_n: u64, tile_rows: u64) -> [GridExtent; 3] {
        [
            GridExtent::Fixed(self.n.div_ceil(tile_n)),
            GridExtent::CeilDiv {
                rows: self.rows,
                by: tile_rows,
            },
            GridExtent::Fixed(1),
        ]
    }
}
