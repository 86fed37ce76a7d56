//! Fused elementwise expressions: the [`EwInstr`] program becomes straight-line C.

use super::source::{self, fill, per_row, rows_expr, ull, Buf, Ctx};
use super::{CudaError, Emitted};
use maxc_schema::{CudaLaunch, EwInput, EwInstr, GridExtent, Rows};

/// Most blocks in y (CUDA's limit); columns beyond are covered by a grid-stride loop.
const MAX_GRID_Y: u64 = 65535;

/// Emits [`maxc_schema::KernelBody::Elementwise`]: blocks in x over rows `r < rows`,
/// blocks in y over column chunks with a grid-stride loop; each element evaluates the program
/// as one `const float vN = ...;` per instruction (broadcast inputs indexed by column only).
/// Every element is read and written by one thread, reads first, so `out` may be an input.
pub(crate) fn emit(
    cx: Ctx,
    rows: Rows,
    cols: u64,
    inputs: &[EwInput],
    program: &[EwInstr],
) -> Result<Emitted, CudaError> {
    let cols = cx.size("cols", cols)?;
    validate(cx, inputs.len(), program)?;
    let mut bufs = Vec::with_capacity(inputs.len() + 1);
    for (i, input) in inputs.iter().enumerate() {
        let ty = cx.float_type(&format!("inputs[{i}].dtype"), input.dtype)?;
        bufs.push(Buf::input(ty, &format!("in{i}")));
    }
    bufs.push(Buf::output("float", "out"));

    let mut expr = String::new();
    for (n, instr) in program.iter().enumerate() {
        let value = match *instr {
            EwInstr::Input(j) => {
                let index = if inputs[j as usize].broadcast {
                    "c"
                } else {
                    "r * ${COLS} + c"
                };
                format!("maxc_ld(in{j}, {index})")
            }
            EwInstr::Add(a, b) => format!("v{a} + v{b}"),
            EwInstr::Mul(a, b) => format!("v{a} * v{b}"),
            EwInstr::Silu(a) => format!("maxc_silu(v{a})"),
            EwInstr::GeluTanh(a) => format!("maxc_gelu_tanh(v{a})"),
        };
        expr.push_str(&format!("        const float v{n} = {value};\n"));
    }
    let last = program.len() - 1;
    let threads = source::row_threads(cols, 256);
    let col_blocks = cols.div_ceil(u64::from(threads)).min(MAX_GRID_Y);
    let template = format!(
        r#"
    const maxc_u64 r = blockIdx.x;
    if (r >= ${{ROWS}}) return;
    for (maxc_u64 c = (maxc_u64)blockIdx.y * blockDim.x + threadIdx.x; c < ${{COLS}};
         c += (maxc_u64)gridDim.y * blockDim.x) {{
{expr}        out[r * ${{COLS}} + c] = v{last};
    }}
"#
    );
    let body = fill(&template, &[("ROWS", rows_expr(rows)), ("COLS", ull(cols))]);
    let launch = CudaLaunch {
        grid: [
            per_row(rows),
            GridExtent::Fixed(col_blocks),
            GridExtent::Fixed(1),
        ],
        block: [threads, 1, 1],
        shared_bytes: 0,
    };
    Ok((source::kernel(cx.name, threads, &bufs, &body), launch))
}

/// Checks that the program is not empty, every operand is an earlier instruction and every
/// input exists.
fn validate(cx: Ctx, inputs: usize, program: &[EwInstr]) -> Result<(), CudaError> {
    if program.is_empty() {
        return Err(
            cx.invalid("the program is empty, expected at least one instruction".to_string())
        );
    }
    for (i, instr) in program.iter().enumerate() {
        let (operands, input): (&[u32], Option<u32>) = match instr {
            EwInstr::Input(j) => (&[], Some(*j)),
            EwInstr::Add(a, b) | EwInstr::Mul(a, b) => (&[*a, *b], None),
            EwInstr::Silu(a) | EwInstr::GeluTanh(a) => (&[*a], None),
        };
        if let Some(j) = input.filter(|&j| j as usize >= inputs) {
            return Err(cx.invalid(format!(
                "instruction {i} reads input {j}, but the kernel has {inputs} inputs"
            )));
        }
        if let Some(op) = operands.iter().find(|&&op| op as usize >= i) {
            return Err(cx.invalid(format!(
                "instruction {i} uses operand {op}, expected an earlier instruction (< {i})"
            )));
        }
    }
    Ok(())
}
