//! From a role's graph to its [`Program`]: kernel selection, the fusion passes, the memory plan,
//! and emission of buffers, kernels and launches.

use crate::error::{LowerError, Result};
use crate::kgraph::{KGraph, ValueKind};
use crate::passes::{default_passes, plan_memory, run_passes, PassReport};
use crate::select::select_kernels;
use maxc_graph::Graph;
use maxc_schema::{Buffer, Extent, Kernel, Launch, Program, StepDim, Storage};
use std::collections::BTreeMap;

/// What lowering needs of the deployment.
#[derive(Clone, Debug)]
pub struct LowerOptions {
    /// The bound of every dim the graph uses (from `max_dims`).
    pub bounds: BTreeMap<String, usize>,
    /// Longest context: the rows of rotary tables.
    pub max_seq_len: usize,
    /// Make no more than this many fusion rewrites (`None`: all of them), to bisect a wrong
    /// lowering to the rewrite that broke it.
    pub stop_after_rewrites: Option<usize>,
    /// The program's role, which its weight keys start with (before `/`): the graph's where
    /// `None`; a tensor-parallel rank's (`decoder@tp1`), whose weights are that rank's share.
    pub weights_role: Option<String>,
}

/// A role's lowered program and what the fusion passes did to it.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The program.
    pub program: Program,
    /// The rewrites each pass made.
    pub passes: PassReport,
}

/// Lowers `graph` to a program of the role [`LowerOptions::weights_role`] names, else the
/// graph's. Weight keys in the program are `{role}/{parameter}`.
pub fn lower_graph(graph: &Graph, opts: &LowerOptions) -> Result<Lowered> {
    let role = match &opts.weights_role {
        Some(r) => r.clone(),
        None => graph.role.to_string(),
    };
    let mut k = select_kernels(graph, &format!("{role}/"))?;
    k.role = role;
    let passes = run_passes(&mut k, &default_passes(), opts.stop_after_rewrites)?;
    let mut bounds = BTreeMap::new();
    for d in StepDim::ALL {
        if let Some(&b) = opts.bounds.get(d.name()) {
            bounds.insert(d, b as u64);
        }
    }
    let plan = plan_memory(&k, &bounds)?;
    let program = emit(&k, &plan.offsets, plan.arena_bytes, opts.max_seq_len)?;
    Ok(Lowered { program, passes })
}

fn emit(
    k: &KGraph,
    offsets: &BTreeMap<usize, u64>,
    arena_bytes: u64,
    max_seq_len: usize,
) -> Result<Program> {
    // Buffers in order of first reference: inputs (by name), launches, outputs.
    let mut ids: BTreeMap<usize, u32> = BTreeMap::new();
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut buffer = |v: usize| -> Result<u32> {
        if let Some(&id) = ids.get(&v) {
            return Ok(id);
        }
        let val = &k.values[v];
        let (storage, shape) = match &val.kind {
            ValueKind::Temp => {
                let offset = *offsets.get(&v).ok_or_else(|| LowerError::Invalid {
                    pass: "memory_plan".into(),
                    message: format!("`{}` has no arena offset", val.name),
                })?;
                (Storage::Arena { offset }, val.shape.clone())
            }
            ValueKind::Param(key) => (Storage::Param { key: key.clone() }, val.shape.clone()),
            ValueKind::Input => (Storage::Input, val.shape.clone()),
            ValueKind::KvCache => (Storage::KvCache, val.shape.clone()),
            ValueKind::KvCacheLayer(layer) => {
                (Storage::KvCacheLayer { layer: *layer }, val.shape.clone())
            }
            ValueKind::RopeTable(t) => {
                let half = match val.shape.first() {
                    Some(Extent::Fixed(h)) => *h,
                    _ => 0,
                };
                (
                    Storage::RopeTable { table: *t },
                    vec![
                        Extent::Fixed(max_seq_len as u64),
                        Extent::Fixed(2),
                        Extent::Fixed(half),
                    ],
                )
            }
        };
        buffers.push(Buffer {
            name: val.name.clone(),
            dtype: val.dtype,
            shape,
            storage,
        });
        let id = (buffers.len() - 1) as u32;
        ids.insert(v, id);
        Ok(id)
    };
    let mut inputs = BTreeMap::new();
    for (name, &v) in &k.inputs {
        inputs.insert(name.clone(), buffer(v)?);
    }
    let mut kernels: Vec<Kernel> = Vec::new();
    let mut launches = Vec::new();
    for n in &k.nodes {
        let kernel = match kernels.iter().position(|x| x.body == n.body) {
            Some(i) => i,
            None => {
                kernels.push(Kernel {
                    name: kernel_name(&n.body),
                    body: n.body.clone(),
                });
                kernels.len() - 1
            }
        } as u32;
        let bufs = n
            .inputs
            .iter()
            .chain(&n.outputs)
            .map(|&v| buffer(v))
            .collect::<Result<Vec<_>>>()?;
        launches.push(Launch {
            kernel,
            buffers: bufs,
            nodes: n.nodes.clone(),
        });
    }
    let mut outputs = BTreeMap::new();
    for (name, &v) in &k.outputs {
        outputs.insert(name.clone(), buffer(v)?);
    }
    // Every program but the EP init program has a KV cache.
    let kv = k.kv.clone();
    if kv.is_none() && k.role != maxc_schema::ep_init::ROLE {
        return Err(LowerError::Invalid {
            pass: "emit".into(),
            message: "no KV cache".into(),
        });
    }
    Ok(Program {
        role: k.role.clone(),
        buffers,
        inputs,
        outputs,
        kv,
        vocab_size: k.vocab_size,
        rope_tables: k.rope_tables.clone(),
        kernels,
        launches,
        arena_bytes,
    })
}

/// A kernel's name: its kind and a hash of its body, so that names stay put when other kernels
/// come or go (diffs of artifacts then show the kernels that really changed).
fn kernel_name(body: &maxc_schema::KernelBody) -> String {
    let bytes =
        bincode::serde::encode_to_vec(body, maxc_schema::bincode_config()).unwrap_or_default();
    // FNV-1a, 64-bit: stable across platforms and versions, unlike std's hasher.
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{}_{:08x}", body.kind(), hash >> 32)
}
