//! Loading float buffers of any storage type as f32: bf16 and f16 weights are widened on load
//! with exact integer bit manipulation (no F16 arithmetic, no library calls).

use super::builder::{int_lanes, KernelBuilder, MEM};
use super::CpuError;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::I32;
use cranelift_codegen::ir::{InstBuilder, Type, Value};
use maxc_schema::DType;

/// The storage type of a float buffer a kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloatType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl FloatType {
    /// The float type of `dtype`, or an error naming the kernel and `field` for integer types.
    pub fn of(kind: &'static str, field: &str, dtype: DType) -> Result<Self, CpuError> {
        match dtype {
            DType::F32 => Ok(FloatType::F32),
            DType::F16 => Ok(FloatType::F16),
            DType::BF16 => Ok(FloatType::Bf16),
            other => Err(CpuError::Unsupported {
                kind,
                what: format!("`{field}` is {}, expected f32, f16 or bf16", other.name()),
            }),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::Bf16 => 2,
        }
    }
}

/// Element `index` of `base` (stored as `ft`) widened to the float type `ty` (f32 or f32x4).
pub(crate) fn load(
    kb: &mut KernelBuilder,
    ty: Type,
    ft: FloatType,
    base: Value,
    index: Value,
) -> Value {
    let widen: fn(&mut KernelBuilder, Value) -> Value = match ft {
        FloatType::F32 => return kb.load_f32(ty, base, index),
        FloatType::Bf16 => |kb, bits| shl(kb, bits, 16),
        FloatType::F16 => f16_to_f32_bits,
    };
    let addr = kb.addr(base, index, ft.size());
    let bits = if ty.is_vector() {
        kb.b.ins().uload16x4(MEM, addr, 0)
    } else {
        kb.b.ins().uload16(I32, MEM, addr, 0)
    };
    let f32_bits = widen(kb, bits);
    kb.bitcast(ty, f32_bits)
}

/// `x << n` for i32 or i32x4 lanes.
fn shl(kb: &mut KernelBuilder, x: Value, n: i64) -> Value {
    let n = kb.b.ins().iconst(I32, n);
    kb.b.ins().ishl(x, n)
}

/// The f32 bit pattern of the f16 whose bits are the low 16 bits of each i32 lane of `h`
/// (upper bits zero). Exact for every input: normals are rebiased, subnormals normalised by
/// an exact f32 subtraction, inf/NaN keep their payload, zeros keep their sign.
fn f16_to_f32_bits(kb: &mut KernelBuilder, h: Value) -> Value {
    let ity = kb.b.func.dfg.value_type(h);
    let fty = if ity.is_vector() {
        cranelift_codegen::ir::types::F32X4
    } else {
        cranelift_codegen::ir::types::F32
    };
    debug_assert_eq!(int_lanes(fty), ity);
    let c = |kb: &mut KernelBuilder, v: i32| kb.iconst_lanes(ity, v);

    let sign_mask = c(kb, 0x8000);
    let sign = kb.b.ins().band(h, sign_mask);
    let sign = shl(kb, sign, 16);
    let magnitude_mask = c(kb, 0x7fff);
    let magnitude = kb.b.ins().band(h, magnitude_mask);
    // Exponent and mantissa moved to their f32 positions; the exponent is still f16-biased.
    let shifted = shl(kb, magnitude, 13);
    let exp_mask = c(kb, 0x7c00 << 13);
    let exp = kb.b.ins().band(shifted, exp_mask);
    let rebias = c(kb, (127 - 15) << 23);
    let normal = kb.b.ins().iadd(shifted, rebias);

    // Inf/NaN: move the exponent the rest of the way to 255.
    let inf_adjust = c(kb, (128 - 16) << 23);
    let inf_nan = kb.b.ins().iadd(normal, inf_adjust);
    let is_inf_nan = kb.b.ins().icmp(IntCC::Equal, exp, exp_mask);

    // Zero/subnormal: 2^-14 · (1 + m/1024) - 2^-14 = m · 2^-24, exact in f32.
    let one_exp = c(kb, 1 << 23);
    let biased = kb.b.ins().iadd(normal, one_exp);
    let biased = kb.bitcast(fty, biased);
    let magic = kb.fconst(fty, f32::from_bits(113 << 23));
    let sub = kb.b.ins().fsub(biased, magic);
    let sub = kb.bitcast(ity, sub);
    let zero = c(kb, 0);
    let is_sub = kb.b.ins().icmp(IntCC::Equal, exp, zero);

    let v = kb.pick(is_inf_nan, inf_nan, normal);
    let v = kb.pick(is_sub, sub, v);
    kb.b.ins().bor(v, sign)
}
