//! Fused elementwise expressions: the [`EwInstr`] program is interpreted at compile time into
//! straight-line IR, emitted once for f32x4 lanes and once for the scalar tail.

use super::builder::{check_size, KernelBuilder};
use super::dtype::{self, FloatType};
use super::math;
use super::CpuError;
use cranelift_codegen::ir::{InstBuilder, Type, Value};
use maxc_schema::{EwInput, EwInstr};

/// Emits [`maxc_schema::KernelBody::Elementwise`]: per row, an f32x4 loop over the
/// columns evaluating the program (broadcast inputs are indexed by column only), then the
/// `cols % 4` tail.
pub(crate) fn emit(
    kb: &mut KernelBuilder,
    cols: u64,
    inputs: &[EwInput],
    program: &[EwInstr],
) -> Result<(), CpuError> {
    let kind = kb.kind();
    let cols = check_size(kind, "cols", cols)?;
    validate(kind, inputs.len(), program)?;
    let types = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| FloatType::of(kind, &format!("inputs[{i}].dtype"), input.dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let bufs: Vec<Value> = (0..inputs.len()).map(|i| kb.buf(i)).collect();
    let out = kb.buf(inputs.len());
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let rows: Vec<Value> = inputs
            .iter()
            .zip(&types)
            .zip(&bufs)
            .map(|((input, ft), &buf)| {
                if input.broadcast {
                    buf
                } else {
                    kb.addr(buf, r, cols * ft.size())
                }
            })
            .collect();
        let out_row = kb.addr(out, r, cols * 4);
        kb.map_cols(cols, |kb, ty, c| {
            let v = eval(kb, ty, program, &types, &rows, c);
            kb.store_f32(v, out_row, c);
        });
    });
    Ok(())
}

/// Checks that every operand refers to an earlier instruction and every input exists.
fn validate(kind: &'static str, inputs: usize, program: &[EwInstr]) -> Result<(), CpuError> {
    if program.is_empty() {
        return Err(CpuError::Invalid {
            kind,
            what: "the program is empty, expected at least one instruction".to_string(),
        });
    }
    for (i, instr) in program.iter().enumerate() {
        let (operands, input): (&[u32], Option<u32>) = match instr {
            EwInstr::Input(j) => (&[], Some(*j)),
            EwInstr::Add(a, b) | EwInstr::Mul(a, b) => (&[*a, *b], None),
            EwInstr::Silu(a) | EwInstr::GeluTanh(a) => (&[*a], None),
        };
        let bad = |what: String| CpuError::Invalid { kind, what };
        if let Some(j) = input.filter(|&j| j as usize >= inputs) {
            return Err(bad(format!(
                "instruction {i} reads input {j}, but the kernel has {inputs} inputs"
            )));
        }
        if let Some(op) = operands.iter().find(|&&op| op as usize >= i) {
            return Err(bad(format!(
                "instruction {i} uses operand {op}, expected an earlier instruction (< {i})"
            )));
        }
    }
    Ok(())
}

/// The program's result at column `c` (lanes of `ty`); each input is loaded at most once.
fn eval(
    kb: &mut KernelBuilder,
    ty: Type,
    program: &[EwInstr],
    types: &[FloatType],
    rows: &[Value],
    c: Value,
) -> Value {
    let mut loaded: Vec<Option<Value>> = vec![None; rows.len()];
    let mut vals: Vec<Value> = Vec::with_capacity(program.len());
    for instr in program {
        let v = match *instr {
            EwInstr::Input(j) => {
                let j = j as usize;
                match loaded[j] {
                    Some(v) => v,
                    None => {
                        let v = dtype::load(kb, ty, types[j], rows[j], c);
                        loaded[j] = Some(v);
                        v
                    }
                }
            }
            EwInstr::Add(a, b) => kb.b.ins().fadd(vals[a as usize], vals[b as usize]),
            EwInstr::Mul(a, b) => kb.b.ins().fmul(vals[a as usize], vals[b as usize]),
            EwInstr::Silu(a) => math::silu(kb, vals[a as usize]),
            EwInstr::GeluTanh(a) => math::gelu_tanh(kb, vals[a as usize]),
        };
        vals.push(v);
    }
    *vals.last().expect("validated: the program is not empty")
}

/// Emits [`maxc_schema::KernelBody::Concat`]: per row of this call's slice and each of its
/// `groups`, the `a` values of `a` then the `b` values of `b` (f32x4 copies).
pub(crate) fn emit_concat(kb: &mut KernelBuilder, groups: u64, a: u64, b: u64) {
    let (src_a, src_b, out) = (kb.buf(0), kb.buf(1), kb.buf(2));
    let (start, end) = (kb.start(), kb.end());
    kb.for_range(start, end, 1, |kb, r| {
        let zero = kb.i64c(0);
        let n = kb.i64c(groups);
        kb.for_range(zero, n, 1, |kb, g| {
            let gi = kb.b.ins().imul_imm_s(r, groups as i64);
            let gi = kb.b.ins().iadd(gi, g);
            let row_a = kb.addr(src_a, gi, a * 4);
            let row_b = kb.addr(src_b, gi, b * 4);
            let dst = kb.addr(out, gi, (a + b) * 4);
            kb.map_cols(a, |kb, ty, c| {
                let x = kb.load_f32(ty, row_a, c);
                kb.store_f32(x, dst, c);
            });
            let dst_b = kb.offset(dst, a * 4);
            kb.map_cols(b, |kb, ty, c| {
                let x = kb.load_f32(ty, row_b, c);
                kb.store_f32(x, dst_b, c);
            });
        });
    });
}
