//! Tensor parallelism through `maxc compile --tensor-parallel-degree N` and the CPU's
//! in-process ranks: every dense fixture at degrees 2 and 4 gives degree 1's logits at every
//! prompt position (within 1e-4) and its greedy tokens; replicated weights are stored once;
//! what cannot be split yet, or run, is refused naming why.

use maxc_golden::fixtures;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn maxc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .expect("maxc runs")
}

fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn compile(model: &str, degree: usize, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{model}-tp{degree}.maxc"));
    ok(maxc(&[
        "compile",
        fixtures().join(model).to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--max-seq-len",
        "64",
        "--page-size",
        "16",
        "--max-batch-input-tokens",
        "64",
        "--tensor-parallel-degree",
        &degree.to_string(),
    ]));
    out
}

const PROMPT: &str = "1,5,9,200,31,7,77,3,12,40";

/// The logits of every prompt position, `[positions][vocab]`.
fn logits(artifact: &Path) -> Vec<Vec<f32>> {
    let file = artifact.with_extension("logits");
    ok(maxc(&[
        "run",
        artifact.to_str().unwrap(),
        "--tokens",
        PROMPT,
        "--dump-logits",
        file.to_str().unwrap(),
    ]));
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let vocab = t.shape()[1];
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    values.chunks(vocab).map(<[f32]>::to_vec).collect()
}

fn greedy(artifact: &Path) -> serde_json::Value {
    let o = ok(maxc(&[
        "generate",
        artifact.to_str().unwrap(),
        "--tokens",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["generated"].clone()
}

#[test]
fn every_dense_fixture_at_degrees_2_and_4_gives_degree_1s_logits_and_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    // Llama (2 KV heads: at 4 ranks each holds a copy of one), Qwen2 (q/k/v biases), Qwen3
    // (per-head norms), Gemma 3 (sandwich norms, sliding layers), Mistral (sliding window),
    // Phi-3 (fused q/k/v and gate/up, split when the weights are prepared).
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-mistral-swa",
        "tiny-phi3",
    ] {
        let one = compile(model, 1, tmp.path());
        let (want, tokens) = (logits(&one), greedy(&one));
        for degree in [2, 4] {
            let a = compile(model, degree, tmp.path());
            let got = logits(&a);
            assert_eq!(got.len(), want.len(), "{model} at {degree}");
            let mut worst = 0f32;
            for (g, w) in got.iter().zip(&want) {
                for (x, y) in g.iter().zip(w) {
                    worst = worst.max((x - y).abs());
                }
            }
            assert!(
                worst <= 1e-4,
                "{model} at degree {degree}: max |diff| {worst}"
            );
            assert_eq!(greedy(&a), tokens, "{model} at degree {degree}");
        }
    }
}

#[test]
fn the_artifact_records_its_ranks_and_stores_replicated_weights_once() {
    let tmp = tempfile::tempdir().unwrap();
    let a = compile("tiny-llama", 2, tmp.path());
    let o = ok(maxc(&["inspect", a.to_str().unwrap(), "--json"]));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["export_records"]["tp.degree"], 2);
    assert_eq!(
        r["export_records"]["tp.roles"],
        serde_json::json!(["decoder", "decoder@tp1"])
    );
    let text = std::fs::read_to_string(a.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(m["roles"]["decoder@tp1"].is_object(), "{text}");
    // The split weights are each rank's own; the embeddings, norms and head are rank 0's.
    let bytes = std::fs::read(a.join("weights.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(
        st.tensor(&format!("decoder/{q}")).unwrap().shape(),
        [128, 256]
    );
    assert_eq!(
        st.tensor(&format!("decoder@tp1/{q}")).unwrap().shape(),
        [128, 256]
    );
    for shared in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ] {
        assert!(names.contains(&format!("decoder/{shared}")));
        assert!(
            !names.contains(&format!("decoder@tp1/{shared}")),
            "{shared} is stored twice"
        );
    }
    // `dump` writes each rank's plan, its all-reduce launches in it.
    let d = tmp.path().join("dump");
    ok(maxc(&["dump", a.to_str().unwrap(), d.to_str().unwrap()]));
    for role in ["decoder", "decoder@tp1"] {
        let plan = std::fs::read_to_string(d.join(role).join("plan.txt")).unwrap();
        assert!(plan.contains("all_reduce"), "{role}: {plan}");
    }
}

#[test]
fn what_cannot_be_split_or_run_is_refused_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let model = |m: &str| fixtures().join(m).to_str().unwrap().to_string();
    let out = tmp.path().join("x.maxc");
    let refused = |m: &str, degree: &str, extra: &[&str], needle: &str| {
        let mut args = vec![
            "compile".to_string(),
            model(m),
            "--out".into(),
            out.to_str().unwrap().into(),
            "--quiet".into(),
            "--tensor-parallel-degree".into(),
            degree.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let o = maxc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(needle),
            "{m} {degree}: {err}"
        );
        assert!(!out.exists(), "no artifact is left");
    };
    // tiny-llama has 8 heads and 2 KV heads: 3 divides neither.
    refused("tiny-llama", "3", &[], "num_attention_heads");
    refused("tiny-mixtral", "2", &[], "mixture-of-experts");
    refused("tiny-llama", "0", &[], "tensor-parallel-degree");
    // A rank's role is run through rank 0's, which runs them all.
    let a = compile("tiny-llama", 2, tmp.path());
    let o = maxc(&[
        "run",
        a.to_str().unwrap(),
        "--role",
        "decoder@tp1",
        "--tokens",
        "1,2",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("open `decoder`"),
        "{err}"
    );
}
