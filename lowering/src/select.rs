//! Kernel selection: each graph op becomes one kernel call (reshapes become views of their
//! operand, paged attention becomes a KV store and an attention call). Fusion comes after.

use crate::error::{LowerError, Result};
use crate::kgraph::{KGraph, KNode, KValue, ValueId, ValueKind};
use maxc_graph::ir::{Dim, Op, TensorType};
use maxc_graph::Graph;
use maxc_schema::{
    DType, EwInput, EwInstr, Extent, GatherIndex, KernelBody, KvGroup, KvLayout, RopeTable, Rows,
    StepDim,
};
use std::collections::BTreeMap;

fn extent(d: &Dim) -> Result<Extent> {
    match d {
        Dim::Fixed(n) => Ok(Extent::Fixed(*n as u64)),
        Dim::Sym(s) => StepDim::from_name(s)
            .map(Extent::Step)
            .ok_or_else(|| LowerError::Unbounded(s.clone())),
    }
}

fn rows_of(shape: &[Extent]) -> Rows {
    match shape.first() {
        Some(Extent::Step(d)) => Rows::Step(*d),
        Some(Extent::Fixed(n)) => Rows::Fixed(*n),
        None => Rows::Fixed(1),
    }
}

/// Product of the fixed dims after the first (the row width).
fn cols_of(shape: &[Extent]) -> u64 {
    shape
        .iter()
        .skip(1)
        .map(|e| if let Extent::Fixed(n) = e { *n } else { 1 })
        .product()
}

/// Builds the kernel graph of `graph`: one kernel per op. Weight keys get `key_prefix`.
pub fn select_kernels(graph: &Graph, key_prefix: &str) -> Result<KGraph> {
    let mut k = KGraph {
        role: graph.role.to_string(),
        ..Default::default()
    };
    let mut val: BTreeMap<maxc_graph::ir::NodeIndex, ValueId> = BTreeMap::new();
    // The graph's KV layout: which page group and slot each decoder layer has.
    let mut kv_graph: Option<maxc_graph::ir::KvLayout> = None;
    let mut tables: Vec<(RopeTable, ValueId)> = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        let unsupported = |message: &str| LowerError::Unsupported {
            node: node.name.clone(),
            op: node.op.name().into(),
            message: message.into(),
        };
        let new_value = |k: &mut KGraph, ty: &TensorType, kind: ValueKind| -> Result<ValueId> {
            let shape = ty.shape.iter().map(extent).collect::<Result<Vec<_>>>()?;
            Ok(k.value(KValue {
                name: node.name.clone(),
                dtype: ty.dtype,
                shape,
                kind,
            }))
        };
        let ops: Vec<ValueId> = graph.operands(id).iter().map(|o| val[o]).collect();
        let shape_of = |k: &KGraph, v: ValueId| k.values[v].shape.clone();
        let body = match &node.op {
            Op::Input => {
                let v = new_value(&mut k, &node.ty, ValueKind::Input)?;
                k.inputs.insert(node.name.clone(), v);
                val.insert(id, v);
                continue;
            }
            Op::KvCache(l) => {
                let v = new_value(&mut k, &node.ty, ValueKind::KvCache)?;
                k.inputs.insert(node.name.clone(), v);
                k.kv = Some(KvLayout {
                    num_layers: l.num_layers as u64,
                    kv_heads: l.num_kv_heads as u64,
                    head_dim: l.head_dim as u64,
                    page_size: l.page_size as u64,
                    planes: l.planes as u64,
                    dtype: l.dtype,
                    groups: l
                        .groups
                        .iter()
                        .map(|g| KvGroup {
                            window: g.window.map(|w| w as u64),
                            layers: g.layers.iter().map(|&l| l as u64).collect(),
                        })
                        .collect(),
                });
                kv_graph = Some(l.clone());
                val.insert(id, v);
                continue;
            }
            Op::Param => {
                let v = new_value(
                    &mut k,
                    &node.ty,
                    ValueKind::Param(format!("{key_prefix}{}", node.name)),
                )?;
                val.insert(id, v);
                continue;
            }
            Op::Reshape { shape } => {
                // A view: a temp's consumers read the temp itself (kernels take their widths
                // from their bodies); any other value gets a value of the new shape.
                let src = k.values[ops[0]].clone();
                let v = if src.kind == ValueKind::Temp {
                    ops[0]
                } else {
                    let shape = shape.iter().map(extent).collect::<Result<Vec<_>>>()?;
                    k.value(KValue {
                        name: node.name.clone(),
                        shape,
                        ..src
                    })
                };
                val.insert(id, v);
                continue;
            }
            Op::Embedding { scale } => {
                let table = &k.values[ops[0]];
                k.vocab_size = match table.shape[0] {
                    Extent::Fixed(n) => n,
                    Extent::Step(_) => {
                        return Err(unsupported("the embedding table has a symbolic row count"))
                    }
                };
                KernelBody::Gather {
                    rows: rows_of(&shape_of(&k, ops[1])),
                    cols: cols_of(&table.shape),
                    index: GatherIndex::Tokens,
                    src_dtype: table.dtype,
                    scale: *scale,
                }
            }
            Op::LogitRows => {
                let out_shape = node
                    .ty
                    .shape
                    .iter()
                    .map(extent)
                    .collect::<Result<Vec<_>>>()?;
                KernelBody::Gather {
                    rows: rows_of(&out_shape),
                    cols: cols_of(&out_shape),
                    index: GatherIndex::LogitRows,
                    src_dtype: DType::F32,
                    scale: 1.0,
                }
            }
            Op::Positions => {
                // Operands: tokens (only for its length), offsets, cache lengths.
                let out = new_value(&mut k, &node.ty, ValueKind::Temp)?;
                k.nodes.push(KNode {
                    body: KernelBody::Positions,
                    inputs: vec![ops[1], ops[2]],
                    outputs: vec![out],
                    nodes: vec![node.name.clone()],
                });
                val.insert(id, out);
                continue;
            }
            Op::Linear => {
                let (x, w) = (&k.values[ops[0]], &k.values[ops[1]]);
                let (n, kk) = match (w.shape[0], w.shape[1]) {
                    (Extent::Fixed(n), Extent::Fixed(kk)) => (n, kk),
                    _ => return Err(unsupported("the weight has symbolic dims")),
                };
                KernelBody::Matmul {
                    rows: rows_of(&x.shape),
                    n,
                    k: kk,
                    weight_dtype: w.dtype,
                    bias: false,
                }
            }
            Op::Add | Op::Mul | Op::Silu | Op::GeluTanh => {
                let shape = shape_of(&k, ops[0]);
                let inputs: Vec<EwInput> = ops
                    .iter()
                    .map(|&o| EwInput {
                        dtype: k.values[o].dtype,
                        broadcast: k.values[o].shape.len() == 1 && shape.len() > 1,
                    })
                    .collect();
                let program = match &node.op {
                    Op::Add => vec![EwInstr::Input(0), EwInstr::Input(1), EwInstr::Add(0, 1)],
                    Op::Mul => vec![EwInstr::Input(0), EwInstr::Input(1), EwInstr::Mul(0, 1)],
                    Op::GeluTanh => vec![EwInstr::Input(0), EwInstr::GeluTanh(0)],
                    _ => vec![EwInstr::Input(0), EwInstr::Silu(0)],
                };
                if inputs.iter().any(|i| i.broadcast)
                    && ops
                        .iter()
                        .any(|&o| k.values[o].shape.len() != 1 && k.values[o].shape != shape)
                {
                    return Err(unsupported("only [cols] operands broadcast"));
                }
                KernelBody::Elementwise {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                    inputs,
                    program,
                }
            }
            Op::RmsNorm { eps, offset } => {
                let shape = shape_of(&k, ops[0]);
                let width = match k.values[ops[1]].shape.first() {
                    Some(Extent::Fixed(w)) => *w,
                    _ => return Err(unsupported("the norm weight has a symbolic size")),
                };
                KernelBody::RmsNorm {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                    width,
                    weight_offset: *offset,
                    eps: *eps,
                    residual: false,
                    weight_dtype: k.values[ops[1]].dtype,
                }
            }
            Op::Rope { table } => {
                let rot = table.half() as u64 * 2;
                let d = match node.ty.shape.get(2).and_then(|d| d.fixed()) {
                    Some(d) => d as u64,
                    None => return Err(unsupported("the head dim is symbolic")),
                };
                let tv = match tables.iter().find(|t| &t.0 == table) {
                    Some(t) => t.1,
                    None => {
                        let index = tables.len() as u32;
                        let tv = k.value(KValue {
                            name: format!("rope_table_{index}"),
                            dtype: DType::F32,
                            shape: vec![Extent::Fixed(rot / 2)],
                            kind: ValueKind::RopeTable(index),
                        });
                        tables.push((table.clone(), tv));
                        tv
                    }
                };
                let heads = cols_of(&shape_of(&k, ops[0])) / d;
                let out = new_value(&mut k, &node.ty, ValueKind::Temp)?;
                k.nodes.push(KNode {
                    body: KernelBody::Rope {
                        heads,
                        head_dim: d,
                        rotary_dim: rot,
                    },
                    inputs: vec![ops[0], ops[1], tv],
                    outputs: vec![out],
                    nodes: vec![node.name.clone()],
                });
                val.insert(id, out);
                continue;
            }
            Op::PagedAttention { .. }
            | Op::LatentAttention { .. }
            | Op::DecompressedLatentAttention { .. } => {
                let l =
                    k.kv.clone()
                        .ok_or_else(|| unsupported("attention before the KV cache input"))?;
                let layer = match &node.op {
                    Op::PagedAttention { layer, .. }
                    | Op::LatentAttention { layer, .. }
                    | Op::DecompressedLatentAttention { layer, .. } => *layer,
                    _ => unreachable!("matched above"),
                };
                // The layer's slot in its page group's pages (its lookup table is the operand).
                let slot = kv_graph
                    .as_ref()
                    .and_then(|g| g.slot(layer))
                    .ok_or_else(|| unsupported("attention of a layer in no KV page group"))?;
                // What is stored (keys and values, or the latent), the rest of the operands,
                // the values' width, the score scale and the window.
                let (stored, rest, value_dim, scale, window) = match &node.op {
                    Op::PagedAttention { scale, window, .. } => {
                        (&ops[1..3], &ops[3..], l.head_dim, *scale, *window)
                    }
                    Op::LatentAttention {
                        scale, value_dim, ..
                    } => {
                        let window = kv_graph
                            .as_ref()
                            .and_then(|g| g.groups.get(slot.group))
                            .and_then(|g| g.window);
                        (&ops[1..2], &ops[2..], *value_dim as u64, *scale, window)
                    }
                    Op::DecompressedLatentAttention { scale, .. } => {
                        (&ops[2..3], &ops[5..], 0, *scale, None)
                    }
                    _ => unreachable!("matched above"),
                };
                let (q, lut, lens, offs) = (ops[0], rest[1], rest[2], rest[3]);
                let planes = stored.len() as u64;
                // Every layer's kernels see a view of the cache at their layer's slot, so the
                // kernels of all layers are one kernel.
                let whole = k.values[rest[0]].clone();
                let cache = k.value(KValue {
                    name: format!("kv_cache.layer{layer}"),
                    kind: ValueKind::KvCacheLayer(slot.slot as u64),
                    ..whole
                });
                // The query's heads, from its graph type (a reshaped temp keeps its first shape
                // in the kernel graph).
                let heads = match graph.node(graph.operands(id)[0]).ty.shape[1].fixed() {
                    Some(h) => h as u64,
                    None => return Err(unsupported("symbolic head count")),
                };
                let mut store_inputs = stored.to_vec();
                store_inputs.extend([cache, lut, lens, offs]);
                k.nodes.push(KNode {
                    body: KernelBody::KvStore {
                        layer: 0,
                        num_layers: l.num_layers,
                        kv_heads: l.kv_heads,
                        head_dim: l.head_dim,
                        page_size: l.page_size,
                        planes,
                        kv_dtype: l.dtype,
                    },
                    inputs: store_inputs,
                    outputs: vec![],
                    nodes: vec![node.name.clone()],
                });
                let out = new_value(&mut k, &node.ty, ValueKind::Temp)?;
                if let Op::DecompressedLatentAttention { .. } = &node.op {
                    // The operands' graph types (a reshaped temp keeps its first shape here).
                    let operands = graph.operands(id);
                    let fixed = |o: usize, i: usize| match graph
                        .node(operands[o])
                        .ty
                        .shape
                        .get(i)
                        .and_then(Dim::fixed)
                    {
                        Some(n) => Ok(n as u64),
                        None => Err(unsupported("a symbolic attention width")),
                    };
                    let (w_uk, w_uv) = (ops[3], ops[4]);
                    let body = KernelBody::DecompressedAttention {
                        layer: 0,
                        num_layers: l.num_layers,
                        heads,
                        head_dim: l.head_dim,
                        page_size: l.page_size,
                        rope: fixed(1, 2)?,
                        nope: fixed(0, 2)?,
                        value: fixed(4, 1)?,
                        scale,
                        weight_dtype: k.values[w_uk].dtype,
                        kv_dtype: l.dtype,
                    };
                    k.nodes.push(KNode {
                        body,
                        inputs: vec![ops[0], ops[1], w_uk, w_uv, cache, lut, lens, offs, ops[9]],
                        outputs: vec![out],
                        nodes: vec![node.name.clone()],
                    });
                    val.insert(id, out);
                    continue;
                }
                k.nodes.push(KNode {
                    body: KernelBody::Attention {
                        layer: 0,
                        num_layers: l.num_layers,
                        heads,
                        kv_heads: l.kv_heads,
                        head_dim: l.head_dim,
                        page_size: l.page_size,
                        planes,
                        value_dim,
                        scale,
                        window: window.map(|w| w as u64),
                        kv_dtype: l.dtype,
                    },
                    inputs: vec![q, cache, lut, lens, offs],
                    outputs: vec![out],
                    nodes: vec![node.name.clone()],
                });
                val.insert(id, out);
                continue;
            }
            Op::Concat => {
                let (a, b) = (shape_of(&k, ops[0]), shape_of(&k, ops[1]));
                let fixed = |e: Option<&Extent>| match e {
                    Some(Extent::Fixed(n)) => Ok(*n),
                    _ => Err(unsupported("a symbolic concatenated dim")),
                };
                let (wa, wb) = (fixed(a.last())?, fixed(b.last())?);
                KernelBody::Concat {
                    rows: rows_of(&a),
                    groups: cols_of(&a) / wa.max(1),
                    a: wa,
                    b: wb,
                }
            }
            Op::HeadLinear => {
                let (x, w) = (&k.values[ops[0]], &k.values[ops[1]]);
                let (heads, n, kk) = match (w.shape[0], w.shape[1], w.shape[2]) {
                    (Extent::Fixed(h), Extent::Fixed(n), Extent::Fixed(kk)) => (h, n, kk),
                    _ => return Err(unsupported("the weight has symbolic dims")),
                };
                KernelBody::HeadMatmul {
                    rows: rows_of(&x.shape),
                    heads,
                    n,
                    k: kk,
                    weight_dtype: w.dtype,
                }
            }
            Op::MoeRouter {
                top_k,
                n_group,
                topk_group,
                scoring,
                group_score,
                renormalize,
                scale,
            } => {
                let shape = shape_of(&k, ops[0]);
                KernelBody::MoeRouter {
                    rows: rows_of(&shape),
                    experts: cols_of(&shape),
                    top_k: *top_k as u64,
                    n_group: *n_group as u64,
                    topk_group: *topk_group as u64,
                    scoring: *scoring,
                    group_score: *group_score,
                    renormalize: *renormalize,
                    scale: *scale,
                    bias_dtype: k.values[ops[1]].dtype,
                }
            }
            Op::Softmax => {
                let shape = shape_of(&k, ops[0]);
                KernelBody::Softmax {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                }
            }
            Op::TopK {
                k: top,
                renormalize,
            } => {
                let shape = shape_of(&k, ops[0]);
                KernelBody::TopK {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                    k: *top as u64,
                    renormalize: *renormalize,
                }
            }
            Op::Zeros { dtype, shape } => {
                let elements = shape.iter().filter_map(Dim::fixed).product::<usize>();
                KernelBody::Zeros {
                    elements: elements as u64,
                    dtype: *dtype,
                }
            }
            Op::AllReduceSum => {
                let shape = shape_of(&k, ops[0]);
                KernelBody::AllReduce {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                }
            }
            Op::AllGather { ranks } => {
                let shape = shape_of(&k, ops[0]);
                KernelBody::AllGather {
                    rows: rows_of(&shape),
                    cols: cols_of(&shape),
                    ranks: *ranks as u64,
                }
            }
            Op::RankExperts { experts_per_rank } => KernelBody::RankExperts {
                experts_per_rank: *experts_per_rank as u64,
            },
            Op::MoeExperts { num_experts } => {
                let shape = shape_of(&k, ops[0]);
                let ffn = match k.values[ops[2]].shape[0] {
                    Extent::Fixed(f) => f,
                    Extent::Step(_) => return Err(unsupported("symbolic expert width")),
                };
                KernelBody::MoeExperts {
                    rows: rows_of(&shape),
                    hidden: cols_of(&shape),
                    ffn,
                    experts: *num_experts as u64,
                    weight_dtype: k.values[ops[2]].dtype,
                }
            }
        };
        let inputs = ops.clone();
        let out = new_value(&mut k, &node.ty, ValueKind::Temp)?;
        k.nodes.push(KNode {
            body,
            inputs,
            outputs: vec![out],
            nodes: vec![node.name.clone()],
        });
        val.insert(id, out);
    }
    for (name, id) in graph.outputs() {
        k.outputs.insert(name.clone(), val[id]);
    }
    k.rope_tables = tables.into_iter().map(|(table, _)| table).collect();
    k.validate("select_kernels")?;
    Ok(k)
}
