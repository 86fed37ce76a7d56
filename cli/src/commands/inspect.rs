//! `maxc inspect ARTIFACT`: roles, dims and bounds, kernels, arena, weights.

use anyhow::Result;
use maxc_runtime::Artifact;
use maxc_schema::Storage;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `maxc inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    artifact: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The inspection report as JSON.
pub fn report(a: &Artifact) -> Value {
    let m = &a.manifest;
    let mut roles = serde_json::Map::new();
    for (role, p) in &a.programs {
        let entries = a
            .cpu
            .get(role)
            .map(|c| c.entries.clone())
            .unwrap_or_default();
        let code_len = a.cpu.get(role).map_or(0, |c| c.code.len() as u64);
        let mut launches: BTreeMap<u32, usize> = BTreeMap::new();
        for l in &p.launches {
            *launches.entry(l.kernel).or_insert(0) += 1;
        }
        let mut starts: Vec<u64> = entries.iter().flatten().copied().collect();
        starts.sort_unstable();
        let kernels: Vec<Value> = p
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let entry = entries.get(i).copied().flatten();
                let bytes =
                    entry.map(|s| starts.iter().find(|&&x| x > s).copied().unwrap_or(code_len) - s);
                json!({
                    "name": k.name,
                    "kind": k.body.kind(),
                    "cpu": if entry.is_some() { "generated" } else { "library" },
                    "code_bytes": bytes,
                    "launches": launches.get(&(i as u32)).copied().unwrap_or(0),
                    "cuda": a.cuda.get(role).and_then(|c| c.kernels.get(i)).map(|c| json!({
                        "registers": c.registers,
                        "spill_stores": c.spill_stores,
                        "spill_loads": c.spill_loads,
                        "shared_bytes": c.shared_bytes,
                        "block": c.launch.block,
                    })),
                })
            })
            .collect();
        let weights = p
            .buffers
            .iter()
            .filter(|b| matches!(b.storage, Storage::Param { .. }))
            .count();
        // The layout, and what one token and one sequence at max_seq_len hold: sliding page
        // groups keep only the pages their windows reach, against every page where no group
        // slid.
        let kv = p.kv.as_ref().map(|kv| {
            let mut v = serde_json::to_value(kv).unwrap_or_default();
            let len = m.runtime.max_seq_len;
            if let Some(o) = v.as_object_mut() {
                o.insert("bytes_per_token".into(), json!(kv.bytes_per_token()));
                o.insert("page_bytes".into(), json!(kv.page_bytes()));
                o.insert(
                    "pages_per_sequence".into(),
                    json!(kv.pages_per_sequence(len)),
                );
                o.insert(
                    "pages_per_sequence_without_windows".into(),
                    json!(kv.num_groups() * len.div_ceil(kv.page_size.max(1))),
                );
                o.insert(
                    "bytes_per_sequence".into(),
                    json!(kv.bytes_per_sequence(len)),
                );
            }
            v
        });
        roles.insert(
            role.clone(),
            json!({
                "dims": m.roles[role].dims,
                "arena_bytes": p.arena_bytes,
                "kv": kv,
                "vocab_size": p.vocab_size,
                "launches": p.launches.len(),
                "kernels": kernels,
                "weights": weights,
            }),
        );
    }
    let mut by_dtype: BTreeMap<&str, u64> = BTreeMap::new();
    for w in a.weights().values() {
        *by_dtype.entry(w.dtype.name()).or_insert(0) += w.range.len() as u64;
    }
    json!({
        "artifact": a.dir.display().to_string(),
        "format_version": m.format_version,
        "maxc_version": m.maxc_version,
        "architecture": m.architecture,
        "param_dtype": m.param_dtype,
        "runtime": m.runtime,
        "export_records": m.export_records,
        "targets": m.targets,
        "roles": roles,
        "weights": {"count": a.weights().len(), "bytes_by_dtype": by_dtype},
        "files": m.files,
    })
}

/// Prints the report.
pub fn run(args: Args) -> Result<()> {
    let a = Artifact::open(&args.artifact)?;
    let r = report(&a);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let m = &a.manifest;
    println!("artifact      {}", a.dir.display());
    println!(
        "format        {} (maxc {})",
        m.format_version, m.maxc_version
    );
    println!(
        "architecture  {}  weights {}",
        m.architecture, m.param_dtype
    );
    if let Some(cuda) = &m.targets.cuda {
        println!(
            "cuda target   {} (PTX from NVRTC {})",
            cuda.arch, cuda.nvrtc_version
        );
    }
    if let Some(cpu) = &m.targets.cpu {
        println!("cpu target    {} [{}]", cpu.arch, cpu.features.join(", "));
    }
    let rt = &m.runtime;
    println!(
        "runtime       max_batch_size {} x {}, max_seq_len {}, max_batch_input_tokens {}, chunked prefill {}, page size {}, kv pages {}",
        rt.max_batch_size, rt.data_parallel_degree, rt.max_seq_len, rt.max_batch_input_tokens,
        if rt.enable_chunked_prefill { "on" } else { "off" }, rt.page_size, rt.kv_cache_pages
    );
    if rt.num_speculative_tokens > 0 {
        println!(
            "speculation   the decoder verifies up to {} draft tokens per step",
            rt.num_speculative_tokens
        );
    }
    if !m.export_records.is_empty() {
        println!("records");
        for (k, v) in &m.export_records {
            println!("  {k:<24} {v}");
        }
    }
    for (role, r) in r["roles"].as_object().into_iter().flatten() {
        let when = if role == maxc_runtime::schema::ep_init::ROLE {
            "launches once at load on each expert-parallel rank"
        } else {
            "launches per step"
        };
        println!(
            "\nrole {role}: {} {when}, arena {} bytes",
            r["launches"], r["arena_bytes"]
        );
        let dims: Vec<String> = r["dims"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(d, b)| format!("{d} <= {b}"))
            .collect();
        if dims.is_empty() {
            println!("  dims     (none: every size is fixed)");
        } else {
            println!("  dims     {}", dims.join(", "));
        }
        if let Some(kv) = r["kv"].as_object() {
            let windows: Vec<String> = kv["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|g| match g["window"].as_u64() {
                    Some(w) => format!("window {w}"),
                    None => "full".to_string(),
                })
                .collect();
            let planes = match kv["planes"].as_u64() {
                Some(1) => "one latent per token",
                _ => "keys and values",
            };
            println!(
                "  kv cache ({}) {} page groups of {} layers ({}; {planes}), {} bytes per page",
                kv["dtype"].as_str().unwrap_or("?"),
                windows.len(),
                kv["num_layers"],
                windows.join(", "),
                kv["page_bytes"]
            );
            println!(
                "           {} bytes per token; a sequence at max_seq_len {} holds {} pages ({} without sliding windows), {} bytes",
                kv["bytes_per_token"],
                m.runtime.max_seq_len,
                kv["pages_per_sequence"],
                kv["pages_per_sequence_without_windows"],
                kv["bytes_per_sequence"]
            );
        }
        println!("  kernels");
        for k in r["kernels"].as_array().into_iter().flatten() {
            let bytes = k["code_bytes"]
                .as_u64()
                .map(|b| format!("{b} B"))
                .unwrap_or_else(|| "-".into());
            let cuda = match k["cuda"].as_object() {
                Some(c) => format!(
                    "  cuda: {} regs, spills {}/{} B, smem {} B",
                    c["registers"], c["spill_stores"], c["spill_loads"], c["shared_bytes"]
                ),
                None => String::new(),
            };
            println!(
                "    {:<24} {:<12} {:<9} {:>8}  x{}{cuda}",
                k["name"].as_str().unwrap_or(""),
                k["kind"].as_str().unwrap_or(""),
                k["cpu"].as_str().unwrap_or(""),
                bytes,
                k["launches"]
            );
        }
    }
    // What this CPU's library matmuls would run (the executor chooses the same at load, under
    // the options it is given; `maxc profile` prints its own).
    let mut plans = Vec::new();
    for p in a.programs.values() {
        let mut seen = std::collections::BTreeSet::new();
        for l in &p.launches {
            if let maxc_schema::KernelBody::Matmul { k, .. } = &p.kernels[l.kernel as usize].body {
                match l.buffers.get(1).map(|&w| (w, &p.buffers[w as usize])) {
                    Some((w, b))
                        if matches!(b.storage, Storage::Param { .. }) && seen.insert(w) =>
                    {
                        let opts = maxc_runtime::kernels::options::KernelOptions::default();
                        let plan = maxc_runtime::kernels::matmul::MatmulPlan::new(
                            b.dtype,
                            *k as usize,
                            &opts,
                        );
                        plans.push((b.dtype, *k, plan.describe()));
                    }
                    _ => {}
                }
            }
        }
    }
    if !plans.is_empty() {
        println!(
            "\nmatmuls on this CPU ({} instruction set, default kernel options; by weight format and k)",
            maxc_runtime::kernels::isa::isa_name()
        );
        super::profile::print_matmul_plans(plans.into_iter());
    }
    println!(
        "\nweights       {} tensors, {}",
        r["weights"]["count"], r["weights"]["bytes_by_dtype"]
    );
    Ok(())
}
