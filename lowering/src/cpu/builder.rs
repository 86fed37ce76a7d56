//! The kernel function under construction: its parameters, constants, memory access, locals
//! and control flow, shared by every kernel family; plus the checks of kernel size fields.
//!
//! Cranelift instructions are type-polymorphic, so most helpers take the float type `ty`
//! (`F32` or `F32X4`) and emit the same computation for a vector of four lanes or for one.

use super::CpuError;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{I32, I32X4, I64};
use cranelift_codegen::ir::{BlockArg, InstBuilder, MemFlagsData, Type, Value};
use cranelift_codegen::isa::TargetFrontendConfig;
use cranelift_frontend::{FunctionBuilder, Variable};
use maxc_schema::{Rows, StepDim};

/// Flags of every memory access: non-trapping, and not assumed aligned (rows of odd widths
/// start anywhere).
pub(crate) const MEM: MemFlagsData = MemFlagsData::new().with_notrap();

/// A kernel function under construction, positioned in its current block.
pub(crate) struct KernelBuilder<'a> {
    /// The Cranelift function builder.
    pub b: FunctionBuilder<'a>,
    kind: &'static str,
    bufs: Value,
    dims: Value,
    start: Value,
    end: Value,
}

impl<'a> KernelBuilder<'a> {
    /// Starts the kernel `kind`: creates the entry block holding the four parameters.
    pub fn new(mut b: FunctionBuilder<'a>, kind: &'static str) -> Self {
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let params = b.block_params(entry).to_vec();
        KernelBuilder {
            b,
            kind,
            bufs: params[0],
            dims: params[1],
            start: params[2],
            end: params[3],
        }
    }

    /// Returns from the kernel and completes the function.
    pub fn finish(mut self, config: TargetFrontendConfig) {
        self.b.ins().return_(&[]);
        self.b.seal_all_blocks();
        self.b.finalize(config);
    }

    /// The kernel kind's short name (for errors).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// First index of this call's slice of the parallel range.
    pub fn start(&self) -> Value {
        self.start
    }

    /// End (exclusive) of this call's slice of the parallel range.
    pub fn end(&self) -> Value {
        self.end
    }

    /// The pointer to buffer `index` (`bufs[index]`).
    pub fn buf(&mut self, index: usize) -> Value {
        let offset = i32::try_from(index * 8).expect("buffer count fits in i32 offsets");
        self.b.ins().load(I64, MEM, self.bufs, offset)
    }

    /// The step size `dim` (`dims[dim]`).
    pub fn dim(&mut self, dim: StepDim) -> Value {
        self.b.ins().load(I64, MEM, self.dims, (dim as i32) * 8)
    }

    /// The row count `rows` as an i64 value.
    pub fn rows(&mut self, rows: Rows) -> Value {
        match rows {
            Rows::Step(dim) => self.dim(dim),
            Rows::Fixed(n) => self.i64c(n),
        }
    }

    /// An i64 constant.
    pub fn i64c(&mut self, v: u64) -> Value {
        self.b.ins().iconst(I64, to_i64(v))
    }

    /// The f32 constant `v` in every lane of the float type `ty`.
    pub fn fconst(&mut self, ty: Type, v: f32) -> Value {
        let s = self.b.ins().f32const(v);
        if ty.is_vector() {
            self.b.ins().splat(ty, s)
        } else {
            s
        }
    }

    /// The i32 constant `v` in every lane of the integer type `ity` (`I32` or `I32X4`).
    pub fn iconst_lanes(&mut self, ity: Type, v: i32) -> Value {
        let s = self.b.ins().iconst(I32, i64::from(v));
        if ity.is_vector() {
            self.b.ins().splat(ity, s)
        } else {
            s
        }
    }

    /// Reinterprets the bits of `v` as type `ty` (same lane count).
    pub fn bitcast(&mut self, ty: Type, v: Value) -> Value {
        self.b.ins().bitcast(ty, MemFlagsData::new(), v)
    }

    /// Lane-wise `mask ? a : b`, where `mask` comes from `fcmp`/`icmp` on the lanes of `a`.
    pub fn pick(&mut self, mask: Value, a: Value, b: Value) -> Value {
        let ty = self.b.func.dfg.value_type(a);
        if ty.is_vector() {
            let mask = if self.b.func.dfg.value_type(mask) == ty {
                mask
            } else {
                self.bitcast(ty, mask)
            };
            self.b.ins().bitselect(mask, a, b)
        } else {
            self.b.ins().select(mask, a, b)
        }
    }

    /// `b < a ? a : b` lane-wise: one `maxps`/`maxss` on x86 (Cranelift's `fmax` is a long
    /// NaN-canonicalising sequence). A NaN in `b` propagates; a NaN in `a` does not.
    pub fn max(&mut self, a: Value, b: Value) -> Value {
        let mask = self.b.ins().fcmp(FloatCC::LessThan, b, a);
        self.pick(mask, a, b)
    }

    /// `a < b ? a : b` lane-wise: one `minps`/`minss` on x86. A NaN in `b` propagates; a NaN
    /// in `a` does not.
    pub fn min(&mut self, a: Value, b: Value) -> Value {
        let mask = self.b.ins().fcmp(FloatCC::LessThan, a, b);
        self.pick(mask, a, b)
    }

    /// `base + index · size`.
    pub fn addr(&mut self, base: Value, index: Value, size: u64) -> Value {
        let off = self.b.ins().imul_imm_s(index, to_i64(size));
        self.b.ins().iadd(base, off)
    }

    /// `base + offset`, for a constant byte offset.
    pub fn offset(&mut self, base: Value, bytes: u64) -> Value {
        if bytes == 0 {
            base
        } else {
            self.b.ins().iadd_imm_s(base, to_i64(bytes))
        }
    }

    /// Element `index` of an i32 buffer, sign-extended to i64.
    pub fn load_i32(&mut self, base: Value, index: Value) -> Value {
        let addr = self.addr(base, index, 4);
        self.b.ins().sload32(MEM, addr, 0)
    }

    /// Element `index` of an i64 buffer.
    pub fn load_i64(&mut self, base: Value, index: Value) -> Value {
        let addr = self.addr(base, index, 8);
        self.b.ins().load(I64, MEM, addr, 0)
    }

    /// `ty` (f32 or f32x4) at f32 element `index` of `base`.
    pub fn load_f32(&mut self, ty: Type, base: Value, index: Value) -> Value {
        let addr = self.addr(base, index, 4);
        self.b.ins().load(ty, MEM, addr, 0)
    }

    /// Stores `v` (f32 or f32x4) at f32 element `index` of `base`.
    pub fn store_f32(&mut self, v: Value, base: Value, index: Value) {
        let addr = self.addr(base, index, 4);
        self.b.ins().store(MEM, v, addr, 0);
    }

    /// A mutable local of type `ty` holding `init`.
    pub fn var(&mut self, ty: Type, init: Value) -> Variable {
        let var = self.b.declare_var(ty);
        self.b.def_var(var, init);
        var
    }

    /// The current value of `var`.
    pub fn get(&mut self, var: Variable) -> Value {
        self.b.use_var(var)
    }

    /// Assigns `v` to `var`.
    pub fn set(&mut self, var: Variable, v: Value) {
        self.b.def_var(var, v);
    }

    /// Runs `body(i)` for `i = lo, lo + step, ...` while `i + step <= hi` (a bottom-tested
    /// loop behind an entry check; `i` is i64).
    pub fn for_range(
        &mut self,
        lo: Value,
        hi: Value,
        step: u64,
        mut body: impl FnMut(&mut Self, Value),
    ) {
        let body_block = self.b.create_block();
        let exit = self.b.create_block();
        let i = self.b.append_block_param(body_block, I64);
        let enter = self.fits(lo, hi, step);
        self.b
            .ins()
            .brif(enter, body_block, &[BlockArg::Value(lo)], exit, &[]);
        self.b.switch_to_block(body_block);
        body(self, i);
        let next = self.b.ins().iadd_imm_s(i, to_i64(step));
        let again = self.fits(next, hi, step);
        self.b
            .ins()
            .brif(again, body_block, &[BlockArg::Value(next)], exit, &[]);
        self.b.seal_block(body_block);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
    }

    /// Whether `i + step <= hi` (i.e. `i < hi` for a step of one).
    fn fits(&mut self, i: Value, hi: Value, step: u64) -> Value {
        if step == 1 {
            self.b.ins().icmp(IntCC::SignedLessThan, i, hi)
        } else {
            let last = self.b.ins().iadd_imm_s(i, to_i64(step));
            self.b.ins().icmp(IntCC::SignedLessThanOrEqual, last, hi)
        }
    }

    /// Runs `then` where the i8 condition `cond` is non-zero, `otherwise` elsewhere.
    pub fn if_else(
        &mut self,
        cond: Value,
        then: impl FnOnce(&mut Self),
        otherwise: impl FnOnce(&mut Self),
    ) {
        let then_block = self.b.create_block();
        let else_block = self.b.create_block();
        let merge = self.b.create_block();
        self.b.ins().brif(cond, then_block, &[], else_block, &[]);
        self.b.switch_to_block(then_block);
        self.b.seal_block(then_block);
        then(self);
        self.b.ins().jump(merge, &[]);
        self.b.switch_to_block(else_block);
        self.b.seal_block(else_block);
        otherwise(self);
        self.b.ins().jump(merge, &[]);
        self.b.switch_to_block(merge);
        self.b.seal_block(merge);
    }
}

/// The integer type with the lane layout of the float type `ty`.
pub(crate) fn int_lanes(ty: Type) -> Type {
    if ty.is_vector() {
        I32X4
    } else {
        I32
    }
}

/// A compile-time size as an i64 immediate.
pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).expect("kernel sizes are validated by `check_size` to fit in i64")
}

/// The largest size (elements, rows, or products of them) a kernel field may have, so that
/// every byte offset computed at compile time fits in an i64.
pub(crate) const MAX_SIZE: u64 = 1 << 40;

/// Checks a kernel size field: at least 1 and at most [`MAX_SIZE`].
pub(crate) fn check_size(kind: &'static str, field: &str, v: u64) -> Result<u64, CpuError> {
    if (1..=MAX_SIZE).contains(&v) {
        Ok(v)
    } else {
        Err(CpuError::Invalid {
            kind,
            what: format!("`{field}` is {v}, expected 1..={MAX_SIZE}"),
        })
    }
}

/// Checks that the product of the size fields `factors` (named `field`) is at most
/// [`MAX_SIZE`].
pub(crate) fn check_product(
    kind: &'static str,
    field: &str,
    factors: &[u64],
) -> Result<u64, CpuError> {
    factors
        .iter()
        .try_fold(1u64, |acc, &v| {
            acc.checked_mul(v).filter(|&p| p <= MAX_SIZE)
        })
        .ok_or_else(|| CpuError::Invalid {
            kind,
            what: format!("`{field}` = {factors:?} multiplies to more than {MAX_SIZE}"),
        })
}
