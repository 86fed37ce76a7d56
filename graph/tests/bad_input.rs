//! Bad checkpoints and settings give errors that name what they concern, never a panic.

use maxc_graph::interp::{Interpreter, StepInputs};
use maxc_graph::pipeline::{load_model, LoadOptions, LoadedModel};
use maxc_graph::weights::{read_safetensors_file, write_safetensors, StateDict, WeightTensor};
use maxc_graph::{Error, ModuleRuntime, Registry};
use std::path::{Path, PathBuf};

fn tiny_llama() -> PathBuf {
    std::env::var_os("MAXC_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/fixtures"))
        .join("tiny-llama")
}

/// A copy of tiny-llama's config with `edit` applied, and `weights` as model.safetensors.
fn checkpoint(
    edit: impl FnOnce(&mut serde_json::Value),
    weights: Option<&StateDict>,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_llama().join("config.json")).unwrap())
            .unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    if let Some(w) = weights {
        write_safetensors(&dir.path().join("model.safetensors"), w, None).unwrap();
    }
    dir
}

fn weights() -> StateDict {
    read_safetensors_file(&tiny_llama().join("model.safetensors")).unwrap()
}

fn load(dir: &Path) -> Result<LoadedModel, Error> {
    load_model(dir, &Registry::builtin(), &LoadOptions::default())
}

fn err(dir: &Path) -> String {
    load(dir).expect_err("the checkpoint is bad").to_string()
}

#[test]
fn the_unchanged_copy_loads() {
    let dir = checkpoint(|_| {}, Some(&weights()));
    assert!(load(dir.path()).is_ok());
}

#[test]
fn missing_safetensors_file() {
    let dir = checkpoint(|_| {}, None);
    let e = err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains(&dir.path().display().to_string()),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_file() {
    let dir = checkpoint(|_| {}, None);
    let bytes = std::fs::read(tiny_llama().join("model.safetensors")).unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(dir.path());
    assert!(
        e.contains(&path.display().to_string()) && e.contains("not a valid safetensors"),
        "{e}"
    );
    std::fs::write(&path, &bytes[..5]).unwrap();
    let e = err(dir.path());
    assert!(e.contains(&path.display().to_string()), "{e}");
}

#[test]
fn sharded_checkpoint_loads_and_a_missing_shard_is_named() {
    let dir = checkpoint(|_| {}, None);
    let all = weights();
    let (a, b): (Vec<_>, Vec<_>) = all
        .iter()
        .map(|(k, t)| (k.clone(), t.clone()))
        .partition(|(k, _)| k.contains("layers.0") || k.contains("embed"));
    let (a, b): (StateDict, StateDict) = (a.into_iter().collect(), b.into_iter().collect());
    write_safetensors(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &a,
        None,
    )
    .unwrap();
    write_safetensors(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &b,
        None,
    )
    .unwrap();
    let map: serde_json::Map<String, serde_json::Value> = a
        .keys()
        .map(|k| (k.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(
            b.keys()
                .map(|k| (k.clone(), "model-00002-of-00002.safetensors".into())),
        )
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let loaded = load(dir.path()).expect("sharded checkpoint loads");
    assert_eq!(
        loaded.roles.values().next().unwrap().weights.len(),
        all.len()
    );

    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = err(dir.path());
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("absent"),
        "{e}"
    );
}

#[test]
fn missing_key() {
    let mut w = weights();
    w.remove("model.layers.2.mlp.up_proj.weight");
    let dir = checkpoint(|_| {}, Some(&w));
    let e = err(dir.path());
    assert!(
        e.contains("missing weight `model.layers.2.mlp.up_proj.weight`"),
        "{e}"
    );
}

#[test]
fn unused_key() {
    let mut w = weights();
    w.insert(
        "model.layers.9.extra.weight",
        WeightTensor::from_f32(vec![2], &[1.0, 2.0]),
    );
    let dir = checkpoint(|_| {}, Some(&w));
    let e = err(dir.path());
    assert!(
        e.contains("unused") && e.contains("model.layers.9.extra.weight"),
        "{e}"
    );
}

#[test]
fn mis_shaped_tensor() {
    let mut w = weights();
    w.insert(
        "model.norm.weight",
        WeightTensor::from_f32(vec![255], &[1.0; 255]),
    );
    let dir = checkpoint(|_| {}, Some(&w));
    let e = err(dir.path());
    assert!(
        e.contains("model.norm.weight") && e.contains("[255]") && e.contains("[256]"),
        "{e}"
    );
}

#[test]
fn unknown_architecture() {
    let dir = checkpoint(
        |c| c["architectures"] = serde_json::json!(["FalconForCausalLM"]),
        Some(&weights()),
    );
    let e = err(dir.path());
    assert!(
        e.contains("FalconForCausalLM")
            && e.contains("config.json")
            && e.contains("LlamaForCausalLM"),
        "{e}"
    );
}

#[test]
fn config_missing_a_required_field() {
    let dir = checkpoint(
        |c| drop(c.as_object_mut().unwrap().remove("hidden_size")),
        Some(&weights()),
    );
    let e = err(dir.path());
    assert!(
        e.contains("config.json") && e.contains("`hidden_size`") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn config_with_a_wrong_type_or_value() {
    let dir = checkpoint(
        |c| c["num_key_value_heads"] = serde_json::json!(3),
        Some(&weights()),
    );
    let e = err(dir.path());
    assert!(
        e.contains("num_key_value_heads") && e.contains("divisor"),
        "{e}"
    );
    let dir = checkpoint(
        |c| c["vocab_size"] = serde_json::json!("big"),
        Some(&weights()),
    );
    let e = err(dir.path());
    assert!(e.contains("vocab_size") && e.contains("\"big\""), "{e}");
}

#[test]
fn config_that_is_not_json() {
    let dir = checkpoint(|_| {}, Some(&weights()));
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = err(dir.path());
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );
}

#[test]
fn unknown_dim_and_zero_bound() {
    let rt = ModuleRuntime::default();
    let e = rt.max_dims(["num_images"], &[]).unwrap_err().to_string();
    assert!(e.contains("num_images") && e.contains("batch_size"), "{e}");
    let mut rt = ModuleRuntime::default();
    rt.batch.max_seq_len = 0;
    let dir = checkpoint(|_| {}, Some(&weights()));
    let opts = LoadOptions {
        runtime: rt,
        ..Default::default()
    };
    let e = load_model(dir.path(), &Registry::builtin(), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_seq_len") && e.contains("at least 1"), "{e}");
}

#[test]
fn dynamic_ntk_past_its_context_names_max_seq_len() {
    let dir = checkpoint(
        |c| {
            c["max_position_embeddings"] = serde_json::json!(256);
            c["rope_parameters"] =
                serde_json::json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0});
        },
        Some(&weights()),
    );
    let at = |len: usize| {
        let mut runtime = ModuleRuntime::default();
        runtime.batch.max_seq_len = len;
        let opts = LoadOptions {
            runtime,
            ..Default::default()
        };
        load_model(dir.path(), &Registry::builtin(), &opts)
    };
    assert!(at(256).is_ok());
    let e = at(512).unwrap_err().to_string();
    assert!(
        e.contains("max_seq_len") && e.contains("512") && e.contains("dynamic"),
        "{e}"
    );
}

#[test]
fn bad_step_inputs_are_errors() {
    let dir = checkpoint(|_| {}, Some(&weights()));
    let mut loaded = load(dir.path()).unwrap();
    let rg = loaded.roles.pop_first().unwrap().1;
    let interp = Interpreter::new(rg.graph, &rg.weights).unwrap();
    let mut cache = interp.new_kv_cache(2);
    let good = StepInputs {
        tokens: vec![1, 2, 3],
        input_row_offsets: vec![0, 3],
        cache_lengths: vec![0],
        kv_lookup_table: vec![1],
        pages_per_seq: 1,
        kv_groups: 1,
        logit_indices: vec![2],
    };
    assert!(interp.step(&good, &mut cache).is_ok());
    let cases: [(StepInputs, &str); 5] = [
        (
            StepInputs {
                tokens: vec![1, 2048, 3],
                ..good.clone()
            },
            "outside the vocabulary",
        ),
        (
            StepInputs {
                input_row_offsets: vec![0, 2],
                ..good.clone()
            },
            "input_row_offsets ends at 2",
        ),
        (
            StepInputs {
                kv_lookup_table: vec![7],
                ..good.clone()
            },
            "page 7",
        ),
        (
            StepInputs {
                cache_lengths: vec![127],
                ..good.clone()
            },
            "beyond its 1 pages",
        ),
        (
            StepInputs {
                logit_indices: vec![3],
                ..good.clone()
            },
            "logit index 3",
        ),
    ];
    for (inputs, want) in cases {
        let e = interp.step(&inputs, &mut cache).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}
