//! Fusion passes: bias adds into matmuls, elementwise chains into one kernel, residual adds
//! into the RMSNorm that follows them.

use super::Pass;
use crate::error::Result;
use crate::kgraph::{KGraph, ValueKind};
use maxc_schema::{EwInstr, KernelBody};

/// Guarantee: a matmul whose only consumer adds a `[n]` weight of the matmul's weight dtype to
/// it becomes a matmul with a bias; the add disappears.
pub struct FuseMatmulBias;

impl Pass for FuseMatmulBias {
    fn name(&self) -> &'static str {
        "fuse_matmul_bias"
    }
    fn run(&self, g: &mut KGraph) -> Result<bool> {
        let consumers = g.consumers();
        for (i, n) in g.nodes.iter().enumerate() {
            let KernelBody::Matmul {
                bias: false,
                n: width,
                weight_dtype,
                ..
            } = n.body
            else {
                continue;
            };
            let out = n.outputs[0];
            let [c] = consumers.get(&out).map(Vec::as_slice).unwrap_or(&[]) else {
                continue;
            };
            if g.is_output(out) {
                continue;
            }
            let add = &g.nodes[*c];
            let KernelBody::Elementwise {
                inputs, program, ..
            } = &add.body
            else {
                continue;
            };
            if program.as_slice() != [EwInstr::Input(0), EwInstr::Input(1), EwInstr::Add(0, 1)]
                || add.inputs[0] != out
            {
                continue;
            }
            let b = add.inputs[1];
            let is_bias = inputs[1].broadcast
                && matches!(g.values[b].kind, ValueKind::Param(_))
                && g.values[b].shape == [maxc_schema::Extent::Fixed(width)]
                && g.values[b].dtype == weight_dtype;
            if !is_bias {
                continue;
            }
            let (c, mut mm) = (*c, g.nodes[i].clone());
            if let KernelBody::Matmul { bias, .. } = &mut mm.body {
                *bias = true;
            }
            let add = g.nodes[c].clone();
            mm.inputs.push(b);
            mm.outputs = add.outputs.clone();
            mm.nodes.extend(add.nodes);
            g.nodes[c] = mm;
            g.nodes.remove(i);
            return Ok(true);
        }
        Ok(false)
    }
}

/// Guarantee: an elementwise kernel whose output has exactly one reader, itself elementwise over
/// the same rows and columns, is inlined into that reader; the intermediate is never stored.
pub struct FuseElementwise;

impl Pass for FuseElementwise {
    fn name(&self) -> &'static str {
        "fuse_elementwise"
    }
    fn run(&self, g: &mut KGraph) -> Result<bool> {
        let consumers = g.consumers();
        for (i, p) in g.nodes.iter().enumerate() {
            let KernelBody::Elementwise {
                rows,
                cols,
                inputs: p_in,
                program: p_prog,
            } = &p.body
            else {
                continue;
            };
            let out = p.outputs[0];
            let [c] = consumers.get(&out).map(Vec::as_slice).unwrap_or(&[]) else {
                continue;
            };
            if g.is_output(out) {
                continue;
            }
            let cn = &g.nodes[*c];
            let KernelBody::Elementwise {
                rows: cr,
                cols: cc,
                inputs: c_in,
                program: c_prog,
            } = &cn.body
            else {
                continue;
            };
            if (rows, cols) != (cr, cc) {
                continue;
            }
            if matches!(c_prog.last(), Some(EwInstr::Input(k)) if cn.inputs[*k as usize] == out) {
                continue; // the consumer only forwards the value
            }
            // New inputs: the producer's, then the consumer's other than `out`.
            let mut inputs = p_in.clone();
            let mut values = p.inputs.clone();
            let mut program = p_prog.clone();
            let p_result = (program.len() - 1) as u32;
            let mut remap = Vec::with_capacity(c_prog.len());
            for instr in c_prog {
                let shift = |x: u32, remap: &Vec<u32>| remap[x as usize];
                let new = match *instr {
                    EwInstr::Input(k) if cn.inputs[k as usize] == out => {
                        remap.push(p_result);
                        continue;
                    }
                    EwInstr::Input(k) => {
                        inputs.push(c_in[k as usize]);
                        values.push(cn.inputs[k as usize]);
                        EwInstr::Input((values.len() - 1) as u32)
                    }
                    EwInstr::Add(a, b) => EwInstr::Add(shift(a, &remap), shift(b, &remap)),
                    EwInstr::Mul(a, b) => EwInstr::Mul(shift(a, &remap), shift(b, &remap)),
                    EwInstr::Silu(a) => EwInstr::Silu(shift(a, &remap)),
                    EwInstr::GeluTanh(a) => EwInstr::GeluTanh(shift(a, &remap)),
                };
                program.push(new);
                remap.push((program.len() - 1) as u32);
            }
            let mut fused = cn.clone();
            fused.body = KernelBody::Elementwise {
                rows: *rows,
                cols: *cols,
                inputs,
                program,
            };
            fused.inputs = values;
            fused.nodes = p.nodes.iter().chain(&cn.nodes).cloned().collect();
            let c = *c;
            g.nodes[c] = fused;
            g.nodes.remove(i);
            return Ok(true);
        }
        Ok(false)
    }
}

/// Guarantee: a two-operand add `a + b` read by an RMSNorm becomes that norm's residual input;
/// the norm writes both the sum and the normalized rows, so the sum is computed once and read
/// once more than before, not twice. Other readers of the sum must run after the norm.
pub struct FuseResidualRmsNorm;

impl Pass for FuseResidualRmsNorm {
    fn name(&self) -> &'static str {
        "fuse_residual_rms_norm"
    }
    fn run(&self, g: &mut KGraph) -> Result<bool> {
        let consumers = g.consumers();
        for (i, a) in g.nodes.iter().enumerate() {
            let KernelBody::Elementwise {
                inputs, program, ..
            } = &a.body
            else {
                continue;
            };
            if program.as_slice() != [EwInstr::Input(0), EwInstr::Input(1), EwInstr::Add(0, 1)]
                || inputs.iter().any(|x| x.broadcast)
            {
                continue;
            }
            let sum = a.outputs[0];
            let readers = consumers.get(&sum).cloned().unwrap_or_default();
            let Some(&ni) = readers.iter().find(|&&r| {
                matches!(
                    g.nodes[r].body,
                    KernelBody::RmsNorm {
                        residual: false,
                        ..
                    }
                ) && g.nodes[r].inputs[0] == sum
            }) else {
                continue;
            };
            if readers.iter().any(|&r| r < ni) {
                continue;
            }
            let mut norm = g.nodes[ni].clone();
            if let KernelBody::RmsNorm { residual, .. } = &mut norm.body {
                *residual = true;
            }
            norm.inputs = vec![a.inputs[0], a.inputs[1], norm.inputs[1]];
            norm.outputs = vec![sum, norm.outputs[0]];
            norm.nodes = a.nodes.iter().chain(&norm.nodes).cloned().collect();
            g.nodes[ni] = norm;
            g.nodes.remove(i);
            return Ok(true);
        }
        Ok(false)
    }
}
