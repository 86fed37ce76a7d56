//! Column loops over a row of compile-time width: an f32x4 main loop, with several
//! independent accumulators for reductions, and the `width % 4` tail as straight-line scalar
//! code (at most three elements, so no tail loop is needed).

use super::builder::KernelBuilder;
use cranelift_codegen::ir::types::{F32, F32X4};
use cranelift_codegen::ir::{InstBuilder, Type, Value};
use cranelift_frontend::Variable;

/// Lanes of the vector type.
pub(crate) const LANES: u64 = 4;

/// How [`KernelBuilder::reduce_cols`] combines terms.
#[derive(Clone, Copy)]
pub(crate) enum Reduce {
    /// Sum.
    Add,
    /// Maximum.
    Max,
}

impl KernelBuilder<'_> {
    /// Emits `body(ty, col)` over columns `0..cols`: an f32x4 loop over groups of four, then
    /// the `cols % 4` remaining columns as straight-line f32 code.
    pub fn map_cols(&mut self, cols: u64, mut body: impl FnMut(&mut Self, Type, Value)) {
        let vec_end = cols / LANES * LANES;
        if vec_end == LANES {
            let c = self.i64c(0);
            body(self, F32X4, c);
        } else if vec_end > 0 {
            let lo = self.i64c(0);
            let hi = self.i64c(vec_end);
            self.for_range(lo, hi, LANES, |kb, c| body(kb, F32X4, c));
        }
        for c in vec_end..cols {
            let c = self.i64c(c);
            body(self, F32, c);
        }
    }

    /// Reduces `term(ty, col)` over columns `0..cols` to one f32 with `op`: a loop over 16
    /// columns with four independent f32x4 accumulators, the remaining groups of four into
    /// the first, a horizontal reduction, then the `cols % 4` tail as scalars.
    /// Empty rows give `init`.
    pub fn reduce_cols(
        &mut self,
        cols: u64,
        op: Reduce,
        init: f32,
        mut term: impl FnMut(&mut Self, Type, Value) -> Value,
    ) -> Value {
        const UNROLL: u64 = 4;
        let block = UNROLL * LANES;
        let unrolled_end = cols / block * block;
        let vec_end = cols / LANES * LANES;
        let mut acc: Option<Value> = None;
        if unrolled_end > 0 {
            let init_v = self.fconst(F32X4, init);
            let accs: Vec<Variable> = (0..UNROLL).map(|_| self.var(F32X4, init_v)).collect();
            let lo = self.i64c(0);
            let hi = self.i64c(unrolled_end);
            self.for_range(lo, hi, block, |kb, c| {
                for (j, &var) in accs.iter().enumerate() {
                    let col = kb.offset(c, j as u64 * LANES);
                    let t = term(kb, F32X4, col);
                    let a = kb.get(var);
                    let a = kb.apply(op, a, t);
                    kb.set(var, a);
                }
            });
            let v: Vec<Value> = accs.iter().map(|&var| self.get(var)).collect();
            let lo = self.apply(op, v[0], v[1]);
            let hi = self.apply(op, v[2], v[3]);
            acc = Some(self.apply(op, lo, hi));
        }
        for c in (unrolled_end..vec_end).step_by(LANES as usize) {
            let col = self.i64c(c);
            let t = term(self, F32X4, col);
            acc = Some(match acc {
                Some(a) => self.apply(op, a, t),
                None => t,
            });
        }
        let mut scalar = acc.map(|v| self.horizontal(op, v));
        for c in vec_end..cols {
            let col = self.i64c(c);
            let t = term(self, F32, col);
            scalar = Some(match scalar {
                Some(s) => self.apply(op, s, t),
                None => t,
            });
        }
        match scalar {
            Some(s) => s,
            None => self.fconst(F32, init),
        }
    }

    /// `op(a, b)` lane-wise.
    pub fn apply(&mut self, op: Reduce, a: Value, b: Value) -> Value {
        match op {
            Reduce::Add => self.b.ins().fadd(a, b),
            Reduce::Max => self.max(a, b),
        }
    }

    /// Reduces the four lanes of an f32x4 to one f32 with `op`.
    pub fn horizontal(&mut self, op: Reduce, v: Value) -> Value {
        let lanes: Vec<Value> = (0..4u8).map(|i| self.b.ins().extractlane(v, i)).collect();
        let lo = self.apply(op, lanes[0], lanes[1]);
        let hi = self.apply(op, lanes[2], lanes[3]);
        self.apply(op, lo, hi)
    }
}
