//! The `maxc` binary end to end on the fixtures.

use maxc_golden::fixtures;
use maxc_graph::weights::read_safetensors_file;
use std::process::{Command, Output};

fn maxc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .expect("maxc runs")
}

fn plan_json(extra: &[&str]) -> serde_json::Value {
    let model = fixtures().join("tiny-llama");
    let mut args = vec!["plan", model.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = maxc(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("plan --json prints JSON")
}

#[test]
fn models_lists_every_architecture() {
    let out = maxc(&["models"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for name in [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "MixtralForCausalLM",
        "LlamaWithDraftForCausalLM",
    ] {
        assert!(text.contains(name), "{text}");
    }
}

#[test]
fn plan_reports_bounds_with_chunked_prefill_off() {
    let p = plan_json(&[
        "--max-batch-size",
        "2",
        "--max-seq-len",
        "128",
        "--max-batch-input-tokens",
        "8192",
        "--no-chunked-prefill",
    ]);
    assert_eq!(p["max_batch_active_tokens"], 256);
    assert_eq!(p["max_global_batch_size"], 2);
    assert_eq!(p["dims"]["total_seq_len"], 256);
    assert_eq!(p["dims"]["input_row_offsets_len"], 3);
}

#[test]
fn plan_reports_bounds_with_data_parallel_replicas() {
    let p = plan_json(&[
        "--max-batch-size",
        "8",
        "--max-seq-len",
        "8192",
        "--max-batch-input-tokens",
        "2048",
        "--data-parallel-degree",
        "4",
    ]);
    assert_eq!(p["max_batch_active_tokens"], 8192);
    assert_eq!(p["max_global_batch_size"], 32);
    assert_eq!(p["dims"]["batch_size"], 32);
    assert_eq!(p["dims"]["max_num_pages"], 64);
    let params = &p["roles"]["decoder"]["parameters"];
    assert_eq!(params["count"], 39);
    // The fixture stores bf16, kept by default.
    assert_eq!(p["param_dtype"], "keep");
    assert_eq!(
        params["bytes_by_dtype"]["bf16"],
        params["elements"].as_u64().unwrap() * 2
    );
}

#[test]
fn plan_of_a_two_role_checkpoint_shows_both_roles() {
    let model = fixtures().join("tiny-roles");
    let out = maxc(&["plan", model.to_str().unwrap(), "--json", "--dtype", "bf16"]);
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["roles"]["decoder"]["parameters"]["count"], 21);
    assert_eq!(p["roles"]["draft"]["parameters"]["count"], 12);
    assert!(
        p["roles"]["draft"]["parameters"]["bytes_by_dtype"]["bf16"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn eval_dumps_logits_that_match_the_fixture() {
    let dir = fixtures().join("tiny-qwen2");
    let reference = read_safetensors_file(&dir.join("reference.safetensors")).unwrap();
    let tokens = reference
        .get("p1.tokens")
        .unwrap()
        .to_i64("p1.tokens")
        .unwrap();
    let want = reference
        .get("p1.logits")
        .unwrap()
        .to_f32("p1.logits")
        .unwrap();
    let list: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("logits.safetensors");
    let out = maxc(&[
        "eval",
        dir.to_str().unwrap(),
        "--tokens",
        &list.join(","),
        "--dump-logits",
        dump.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = read_safetensors_file(&dump).unwrap();
    let logits = got.get("logits").unwrap();
    assert_eq!(logits.shape, vec![tokens.len(), 1024]);
    let d = logits
        .to_f32("logits")
        .unwrap()
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d < 1e-3, "max |logit diff| {d}");
}

#[test]
fn bad_flags_and_inputs_are_clear_errors() {
    let model = fixtures().join("tiny-llama");
    let m = model.to_str().unwrap();
    for (args, want) in [
        (vec!["plan", m, "--max-batch-size", "0"], "--max-batch-size"),
        (vec!["plan", m, "--page-size", "-4"], "--page-size"),
        (
            vec!["plan", "/nonexistent/model"],
            "/nonexistent/model/config.json",
        ),
        (vec!["eval", m, "--tokens", "1,x"], "`x` is not an integer"),
        (
            vec!["eval", m, "--tokens", "1,99999"],
            "outside the vocabulary",
        ),
        (vec!["eval", m, "--tokens", "1", "--role", "draft"], "draft"),
    ] {
        let out = maxc(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
