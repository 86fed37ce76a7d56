//! Tensor parallelism through `maxc compile --tensor-parallel-degree N` and the CPU's
//! in-process ranks: every fixture but latent attention's at degrees 2 and 4 gives degree 1's logits at every
//! prompt position (within 1e-4) and its greedy tokens; replicated weights are stored once;
//! what cannot be split yet, or run, is refused naming why.

mod tp;

use maxc_golden::fixtures;
use tp::{compile, greedy, logits, ok, worst};

/// `maxc args..` in this process's group (no launcher).
fn maxc(args: &[&str]) -> std::process::Output {
    tp::maxc(None, args)
}

#[test]
fn every_fixture_at_degrees_2_and_4_gives_degree_1s_logits_and_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    for model in tp::MODELS {
        let one = compile(model, 1, tmp.path());
        let (want, tokens) = (logits(None, &one, model), greedy(None, &one));
        for degree in [2, 4] {
            let a = compile(model, degree, tmp.path());
            let d = worst(&logits(None, &a, &format!("{model}-{degree}")), &want);
            assert!(d <= 1e-4, "{model} at degree {degree}: max |diff| {d}");
            assert_eq!(greedy(None, &a), tokens, "{model} at degree {degree}");
        }
    }
}

#[test]
fn experts_spread_whole_over_the_ranks_give_degree_1s_logits_and_each_rank_holds_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    for model in ["tiny-mixtral", "tiny-qwen3-moe"] {
        let one = compile(model, 1, tmp.path());
        let (want, tokens) = (logits(None, &one, model), greedy(None, &one));
        for degree in [2, 4] {
            let a = tp::compile_spread(model, degree, tmp.path());
            let d = worst(&logits(None, &a, &format!("{model}-spread{degree}")), &want);
            assert!(d <= 1e-4, "{model} spread over {degree}: max |diff| {d}");
            assert_eq!(greedy(None, &a), tokens, "{model} spread over {degree}");
            let o = ok(maxc(&["inspect", a.to_str().unwrap(), "--json"]));
            let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(r["export_records"]["tp.experts"], "spread");
            assert_eq!(r["export_records"]["ep.degree"], degree);
            // Each rank stores its own experts whole, numbered from 0, and no other's.
            let bytes = std::fs::read(a.join("weights.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let names = st.names();
            let per = 4 / degree;
            let of_rank = |r: usize| {
                let role = if r == 0 {
                    "decoder".to_string()
                } else {
                    format!("decoder@tp{r}")
                };
                names
                    .iter()
                    .filter(|n| n.starts_with(&format!("{role}/model.layers.0.")))
                    .filter(|n| n.contains(".experts."))
                    .count()
            };
            if model == "tiny-mixtral" {
                for r in 0..degree {
                    assert_eq!(of_rank(r), 3 * per, "rank {r} at {degree}: {names:?}");
                }
            }
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
    // The vocabulary projection is split by rows too (the logits all-gathered).
    for role in ["decoder", "decoder@tp1"] {
        assert_eq!(
            st.tensor(&format!("{role}/lm_head.weight"))
                .unwrap()
                .shape(),
            [512, 256]
        );
    }
    for shared in ["model.embed_tokens.weight", "model.norm.weight"] {
        assert!(names.contains(&format!("decoder/{shared}")));
        assert!(
            !names.contains(&format!("decoder@tp1/{shared}")),
            "{shared} is stored twice"
        );
    }
    // `dump` writes each rank's plan, its all-reduce and all-gather launches in it.
    let d = tmp.path().join("dump");
    ok(maxc(&["dump", a.to_str().unwrap(), d.to_str().unwrap()]));
    for role in ["decoder", "decoder@tp1"] {
        let plan = std::fs::read_to_string(d.join(role).join("plan.txt")).unwrap();
        assert!(plan.contains("all_reduce"), "{role}");
        assert!(plan.contains("all_gather"), "{role}");
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
    // tiny-deepseek-v3 has 4 heads.
    refused("tiny-deepseek-v3", "8", &[], "num_attention_heads");
    refused(
        "tiny-mixtral",
        "2",
        &["--expert-parallel-degree", "4"],
        "other combinations are not supported",
    );
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

#[test]
fn a_process_running_one_rank_stages_only_that_ranks_weights() {
    use maxc_runtime::artifact::{Artifact, WeightMemory};
    use maxc_runtime::cpu::CpuExecutor;
    use std::sync::Arc;
    if !maxc_runtime::hugemem::available() {
        eprintln!("skipped: no transparent huge pages here");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let a = compile("tiny-llama", 2, tmp.path());
    let artifact = Arc::new(Artifact::open_verified(&a, None, WeightMemory::Staged).unwrap());
    // Rank 1 alone, as a process under mpirun holds it (its all-reduces are refused without
    // a communicator, after the weights it read were noted).
    let mut exec =
        CpuExecutor::new(Arc::clone(&artifact), "decoder@tp1", Default::default()).unwrap();
    assert!(exec.execute(&first_step(2)).is_err());
    artifact.stage_weights();
    artifact.wait_for_staged_weights();
    let copy = artifact.staged_weights().expect("staged");
    let file = artifact.weights_bytes();
    let bytes_of = |key: &str| {
        let (_, b) = artifact.weight(key).unwrap();
        artifact.weights_range(b.as_ptr(), b.len()).unwrap()
    };
    // Rank 1's own share and the replicated weights (under rank 0's name) are copied, but for
    // those it repacks (read in their repacked copy: its own too) ...
    let program = exec.program();
    let repacking: std::collections::BTreeSet<&str> = exec
        .repacking()
        .iter()
        .filter_map(|&b| match &program.buffers[b as usize].storage {
            maxc_schema::Storage::Param { key } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    for key in [
        "decoder@tp1/model.layers.0.self_attn.q_proj.weight",
        "decoder@tp1/model.layers.3.mlp.down_proj.weight",
        "decoder@tp1/lm_head.weight",
        "decoder/model.embed_tokens.weight",
    ] {
        let r = bytes_of(key);
        assert!(
            copy[r.clone()] == file[r] || repacking.contains(key),
            "{key} is neither staged nor repacked"
        );
    }
    // ... rank 0's share is not (the copy's pages there are never touched).
    for key in [
        "decoder/model.layers.0.self_attn.q_proj.weight",
        "decoder/lm_head.weight",
    ] {
        let r = bytes_of(key);
        assert!(copy[r].iter().all(|&b| b == 0), "{key} is staged");
    }
}

#[test]
fn a_refused_step_leaves_the_ranks_ready_for_the_next() {
    use maxc_runtime::engine::{Device, Engine};
    let tmp = tempfile::tempdir().unwrap();
    let a = compile("tiny-llama", 2, tmp.path());
    let mut engine = Engine::open_on(&a, "decoder", Device::Cpu).unwrap();
    assert_eq!(engine.tensor_parallel_degree(), 2);
    // A token outside the vocabulary: every rank refuses the step before any collective.
    let e = engine
        .execute(&first_step(1 << 40))
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocab"), "{e}");
    let ok = engine.execute(&first_step(7)).unwrap();
    assert!(ok.data.iter().all(|v| v.is_finite()));
}

/// One sequence's first step: tokens `[1, token]` on page 0, returning its last row's logits.
fn first_step(token: i64) -> maxc_runtime::StepInputs {
    let mut s = maxc_runtime::StepInputs {
        tokens: vec![1, token],
        input_row_offsets: vec![0, 2],
        cache_lengths: vec![0],
        kv_lookup_table: vec![0; 4],
        pages_per_seq: 4,
        kv_groups: 1,
        logit_indices: vec![],
    };
    s.last_rows(1);
    s
}
