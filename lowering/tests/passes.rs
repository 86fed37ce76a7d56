//! The lowering passes on real graphs: what each fusion removes, and the memory plan's guarantee
//! (no two live intermediates share bytes), checked independently of the planner.

use maxc_graph::pipeline::{load_model, LoadOptions};
use maxc_graph::{Graph, ModuleRuntime, Registry};
use maxc_lowering::kgraph::{KGraph, ValueKind};
use maxc_lowering::passes::{bytes_at_bounds, default_passes, plan_memory, run_passes};
use maxc_lowering::select::select_kernels;
use maxc_lowering::{lower_graph, LowerOptions};
use maxc_schema::{EwInstr, KernelBody, StepDim, Storage};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn graph(model: &str) -> (Graph, ModuleRuntime) {
    let dir = std::env::var_os("MAXC_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/fixtures"))
        .join(model);
    let mut rt = ModuleRuntime::default();
    rt.batch.max_seq_len = 256;
    let opts = LoadOptions {
        runtime: rt.clone(),
        ..Default::default()
    };
    let mut loaded = load_model(&dir, &Registry::builtin(), &opts).expect("fixture loads");
    (loaded.roles.pop_first().expect("a role").1.graph, rt)
}

fn kinds(k: &KGraph) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in &k.nodes {
        let name = match &n.body {
            KernelBody::RmsNorm { residual: true, .. } => "rms_norm+residual".to_string(),
            KernelBody::Matmul { bias: true, .. } => "matmul+bias".to_string(),
            b => b.kind().to_string(),
        };
        *m.entry(name).or_insert(0) += 1;
    }
    m
}

fn fused(model: &str) -> (KGraph, KGraph) {
    let (g, _) = graph(model);
    let before = select_kernels(&g, "decoder/").unwrap();
    let mut after = before.clone();
    run_passes(&mut after, &default_passes(), None).unwrap();
    (before, after)
}

#[test]
fn llama_fusion_merges_swiglu_and_residual_adds_into_norms() {
    let (before, after) = fused("tiny-llama");
    let (b, a) = (kinds(&before), kinds(&after));
    // Per layer: two residual adds, silu and mul; 4 layers.
    assert_eq!(b["elementwise"], 4 * 4);
    // SwiGLU is one kernel per layer.
    assert_eq!(a["elementwise"], 4);
    let swiglu = after
        .nodes
        .iter()
        .find(|n| matches!(n.body, KernelBody::Elementwise { .. }))
        .unwrap();
    let KernelBody::Elementwise { program, .. } = &swiglu.body else {
        unreachable!()
    };
    assert!(
        program.iter().any(|i| matches!(i, EwInstr::Silu(_)))
            && program.iter().any(|i| matches!(i, EwInstr::Mul(..)))
    );
    // Every residual add feeds a norm: 8 norms take their residual; the first is plain.
    assert_eq!(a["rms_norm+residual"], 8);
    assert_eq!(a["rms_norm"], 1);
    assert_eq!(after.nodes.len(), 61);
}

#[test]
fn the_pass_runner_counts_rewrites_and_stops_after_n() {
    let (g, _) = graph("tiny-qwen2");
    let before = select_kernels(&g, "decoder/").unwrap();
    let mut all = before.clone();
    let full = run_passes(&mut all, &default_passes(), None).unwrap();
    // Every fusion rewrite replaces two kernels by one.
    assert_eq!(full.total(), before.nodes.len() - all.nodes.len());
    assert!(!full.stopped);
    let names: Vec<&str> = full.rewrites.iter().map(|(p, _)| *p).collect();
    assert_eq!(
        names,
        [
            "fuse_matmul_bias",
            "fuse_elementwise",
            "fuse_residual_rms_norm"
        ]
    );
    assert_eq!(full.rewrites[0].1, 3 * 4, "q, k and v biases in 4 layers");
    for n in [
        0,
        1,
        12,
        13,
        full.total() - 1,
        full.total(),
        full.total() + 5,
    ] {
        let mut k = before.clone();
        let r = run_passes(&mut k, &default_passes(), Some(n)).unwrap();
        let made = n.min(full.total());
        assert_eq!(r.total(), made, "stop after {n}");
        assert_eq!(k.nodes.len(), before.nodes.len() - made, "stop after {n}");
        assert_eq!(r.stopped, n <= full.total(), "stop after {n}");
        // The first rewrites are the pipeline's own, in order: a prefix of the full run.
        let mut left = made;
        for ((pass, got), (fpass, fmade)) in r.rewrites.iter().zip(&full.rewrites) {
            assert_eq!(pass, fpass);
            assert_eq!(*got, left.min(*fmade), "{pass} after {n}");
            left -= got;
        }
    }
    let mut k = before.clone();
    run_passes(&mut k, &default_passes(), Some(0)).unwrap();
    assert_eq!(kinds(&k), kinds(&before), "0 rewrites leaves the selection");
}

#[test]
fn qwen2_biases_fuse_into_their_matmuls() {
    let (before, after) = fused("tiny-qwen2");
    assert_eq!(kinds(&before).get("matmul+bias"), None);
    assert_eq!(kinds(&after)["matmul+bias"], 3 * 4);
    assert_eq!(kinds(&after)["elementwise"], 4);
}

#[test]
fn the_memory_plan_never_overlaps_live_values() {
    for model in ["tiny-llama", "tiny-mixtral"] {
        let (g, rt) = graph(model);
        let mut k = select_kernels(&g, "decoder/").unwrap();
        run_passes(&mut k, &default_passes(), None).unwrap();
        let dims = rt
            .max_dims(
                g.step_dims().iter().map(String::as_str),
                &g.kv_layout().map(|l| l.windows()).unwrap_or_default(),
            )
            .unwrap();
        let bounds: BTreeMap<StepDim, u64> = StepDim::ALL
            .into_iter()
            .filter_map(|d| dims.get(d.name()).map(|&b| (d, b as u64)))
            .collect();
        let plan = plan_memory(&k, &bounds).unwrap();
        // Lifetimes recomputed here: first write to last read (outputs to the end).
        let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for (i, n) in k.nodes.iter().enumerate() {
            for &v in n.outputs.iter() {
                live.entry(v).or_insert((i, i));
            }
            for &v in &n.inputs {
                if let Some(l) = live.get_mut(&v) {
                    l.1 = l.1.max(i);
                }
            }
        }
        for &v in k.outputs.values() {
            live.get_mut(&v).unwrap().1 = k.nodes.len();
        }
        let temps: Vec<usize> = live
            .keys()
            .copied()
            .filter(|&v| k.values[v].kind == ValueKind::Temp)
            .collect();
        let range = |v: usize| {
            let o = plan.offsets[&v];
            (
                o,
                o + bytes_at_bounds(&k.values[v].shape, k.values[v].dtype.size(), &bounds).unwrap(),
            )
        };
        for (i, &a) in temps.iter().enumerate() {
            let (ra, la) = (range(a), live[&a]);
            assert!(ra.1 <= plan.arena_bytes && ra.0 % 64 == 0);
            for &b in &temps[i + 1..] {
                let (rb, lb) = (range(b), live[&b]);
                let overlap_time = la.0 <= lb.1 && lb.0 <= la.1;
                let overlap_bytes = ra.0 < rb.1 && rb.0 < ra.1;
                assert!(
                    !(overlap_time && overlap_bytes),
                    "{model}: `{}` and `{}` share bytes while both live",
                    k.values[a].name,
                    k.values[b].name
                );
            }
        }
        // Reuse happens: the arena is smaller than the sum of all intermediates.
        let total: u64 = temps.iter().map(|&v| range(v).1 - range(v).0).sum();
        assert!(
            plan.arena_bytes < total / 4,
            "{model}: arena {} of {total}",
            plan.arena_bytes
        );
    }
}

#[test]
fn programs_dedupe_kernels_and_reference_weights_by_role_key() {
    let (g, rt) = graph("tiny-llama");
    let dims = rt
        .max_dims(
            g.step_dims().iter().map(String::as_str),
            &g.kv_layout().map(|l| l.windows()).unwrap_or_default(),
        )
        .unwrap();
    let p = lower_graph(
        &g,
        &LowerOptions {
            bounds: dims,
            max_seq_len: 256,
            stop_after_rewrites: None,
            weights_role: None,
        },
    )
    .unwrap()
    .program;
    assert_eq!(p.launches.len(), 61);
    // Layers share their kernels: attention and KV store read a per-layer view of the cache.
    assert_eq!(
        p.kernels.len(),
        15,
        "{:?}",
        p.kernels.iter().map(|k| &k.name).collect::<Vec<_>>()
    );
    assert_eq!(
        p.kernels
            .iter()
            .filter(|k| k.body.kind() == "attention")
            .count(),
        1
    );
    assert_eq!(
        p.launches
            .iter()
            .filter(|l| p.kernels[l.kernel as usize].body.kind() == "attention")
            .count(),
        4
    );
    let keys: Vec<&str> = p
        .buffers
        .iter()
        .filter_map(|b| match &b.storage {
            Storage::Param { key } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(keys.len(), 39);
    assert!(keys.iter().all(|k| k.starts_with("decoder/")));
    assert_eq!(p.vocab_size, 1024);
}
