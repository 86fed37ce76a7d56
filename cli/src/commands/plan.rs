//! `maxc plan MODEL`: runs the deployment hooks and the weight pipeline, builds every role's graph
//! and reports parameters, op counts, inputs and the bound of every dim.

use crate::runtime_args::RuntimeArgs;
use anyhow::{Context, Result};
use maxc_graph::ir::shape_string;
use maxc_graph::pipeline::{load_model, read_config, LoadOptions, WeightFormat};
use maxc_graph::{ModuleRuntime, Registry};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `maxc plan`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (config.json + safetensors).
    model: PathBuf,
    #[command(flatten)]
    runtime: RuntimeArgs,
    /// The formats weights are stored in: `keep` (the checkpoint's), a float type (`f32`,
    /// `bf16`, `f16`) or a block type to quantize matmul weights to (`q8_0`, `q4_0`, `q4_k`, ...).
    #[arg(long, alias = "dtype", default_value = "keep")]
    weights: WeightFormat,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Builds the plan report as JSON.
pub fn plan_json(
    model: &std::path::Path,
    runtime: &ModuleRuntime,
    weights: WeightFormat,
) -> Result<Value> {
    let registry = Registry::builtin();
    let opts = LoadOptions {
        runtime: runtime.clone(),
        weights,
        ..Default::default()
    };
    let loaded = load_model(model, &registry, &opts)?;
    let mut all_dims = BTreeMap::new();
    let mut roles = Map::new();
    for (role, rg) in &loaded.roles {
        let g = &rg.graph;
        let dims = runtime
            .max_dims(
                g.step_dims().iter().map(String::as_str),
                &g.kv_layout().map(|l| l.windows()).unwrap_or_default(),
            )
            .with_context(|| format!("role {role}"))?;
        all_dims.extend(dims.clone());
        let mut bytes_by_dtype: BTreeMap<String, usize> = BTreeMap::new();
        let mut elements = 0;
        for (_, w) in rg.weights.iter() {
            *bytes_by_dtype.entry(w.dtype.to_string()).or_insert(0) += w.bytes().len();
            elements += w.numel();
        }
        let inputs: Vec<Value> = g
            .inputs()
            .iter()
            .map(|&i| {
                let n = g.node(i);
                json!({"name": n.name, "dtype": n.ty.dtype.name(), "shape": shape_string(&n.ty.shape)})
            })
            .collect();
        roles.insert(
            role.to_string(),
            json!({
                "parameters": {"count": rg.weights.len(), "elements": elements, "bytes_by_dtype": bytes_by_dtype},
                "ops": g.op_counts(),
                "nodes": g.len(),
                "inputs": inputs,
                "kv_layout": g.kv_layout(),
                "dims": dims,
            }),
        );
    }
    let b = &runtime.batch;
    Ok(json!({
        "model": model.display().to_string(),
        "architecture": loaded.spec.architecture(),
        "param_dtype": weights.name(),
        "runtime": runtime,
        "max_global_batch_size": b.max_global_batch_size(),
        "max_batch_active_tokens": b.max_batch_active_tokens(),
        "dims": all_dims,
        "roles": roles,
    }))
}

/// Prints the plan.
pub fn run(args: Args) -> Result<()> {
    let (_, spec) = read_config(&args.model, &Registry::builtin())?;
    let runtime = args.runtime.runtime(spec.as_ref());
    let plan = plan_json(&args.model, &runtime, args.weights)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    let b = &runtime.batch;
    println!("model         {}", args.model.display());
    println!(
        "architecture  {}",
        plan["architecture"].as_str().unwrap_or("?")
    );
    println!(
        "runtime       max_batch_size {} x {} replica(s) = {}, max_seq_len {}, max_batch_input_tokens {}, chunked prefill {}, page size {}",
        b.max_batch_size,
        b.data_parallel_degree,
        b.max_global_batch_size(),
        b.max_seq_len,
        b.max_batch_input_tokens,
        if b.enable_chunked_prefill { "on" } else { "off" },
        runtime.kv.page_size,
    );
    println!("max_batch_active_tokens  {}", b.max_batch_active_tokens());
    if b.num_speculative_tokens > 0 {
        println!(
            "num_speculative_tokens   {} (up to {} logit rows per step)",
            b.num_speculative_tokens,
            b.max_logit_rows()
        );
    }
    for (role, r) in plan["roles"].as_object().into_iter().flatten() {
        println!("\nrole {role}");
        let p = &r["parameters"];
        let bytes: Vec<String> = p["bytes_by_dtype"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(d, n)| format!("{d} {}", human_bytes(n.as_u64().unwrap_or(0))))
            .collect();
        println!(
            "  parameters  {} tensors, {} elements, {}",
            p["count"],
            p["elements"],
            bytes.join(", ")
        );
        let ops: Vec<String> = r["ops"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(o, n)| format!("{o} {n}"))
            .collect();
        println!("  ops         {} ({} nodes)", ops.join(", "), r["nodes"]);
        println!("  inputs");
        for i in r["inputs"].as_array().into_iter().flatten() {
            println!(
                "    {:<24} {}{}",
                i["name"].as_str().unwrap_or(""),
                i["dtype"].as_str().unwrap_or(""),
                i["shape"].as_str().unwrap_or("")
            );
        }
        println!("  dim bounds");
        for (d, n) in r["dims"].as_object().into_iter().flatten() {
            println!("    {d:<24} {n}");
        }
    }
    Ok(())
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.2} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}
