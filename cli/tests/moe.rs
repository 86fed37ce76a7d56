//! Mixture of experts deployed with expert parallelism, through `maxc compile`: a degree that
//! does not divide the experts is refused and leaves no artifact; the artifact records the
//! deployment (experts, top-k, degree, experts per rank, max tokens per rank, exchange
//! buffers) and holds the EP init program, shown by `inspect` and changed, between degrees,
//! only where the degree matters.

use maxc_golden::fixtures;
use std::path::Path;
use std::process::{Command, Output};

fn maxc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .expect("maxc runs")
}

fn compile(out: &Path, degree: usize) -> Output {
    let m = fixtures().join("tiny-mixtral");
    maxc(&[
        "compile",
        m.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--max-seq-len",
        "64",
        "--page-size",
        "16",
        "--max-batch-input-tokens",
        "64",
        "--expert-parallel-degree",
        &degree.to_string(),
    ])
}

#[test]
fn a_degree_that_does_not_divide_the_experts_leaves_no_artifact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.maxc");
    let o = compile(&out, 3);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("expert_parallel_degree") && err.contains("3") && err.contains("4 experts"),
        "{err}"
    );
    assert!(!out.exists(), "no artifact is left");
    // An artifact already there stays as it was.
    assert!(compile(&out, 2).status.success());
    let before = std::fs::read(out.join("manifest.json")).unwrap();
    let o = maxc(&[
        "compile",
        fixtures().join("tiny-mixtral").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--force",
        "--expert-parallel-degree",
        "3",
    ]);
    assert!(!o.status.success());
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), before);
}

#[test]
fn the_artifact_records_the_expert_parallel_deployment() {
    let tmp = tempfile::tempdir().unwrap();
    let (a2, a4) = (tmp.path().join("ep2.maxc"), tmp.path().join("ep4.maxc"));
    assert!(compile(&a2, 2).status.success());
    assert!(compile(&a4, 4).status.success());
    let o = maxc(&["inspect", a2.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rec = &r["export_records"];
    assert_eq!(rec["ep.degree"], 2);
    assert_eq!(rec["ep.experts_per_rank"], 2);
    assert_eq!(rec["moe.num_experts"], 4);
    assert_eq!(rec["moe.top_k"], 2);
    // 64 active tokens, each with both slots on one rank at worst.
    assert_eq!(rec["ep.max_tokens_per_rank"], 128);
    let o = maxc(&["inspect", a2.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("ep.max_tokens_per_rank") && text.contains("128"),
        "{text}"
    );
    // The EP init program is in the artifact, and `inspect` shows its role.
    assert!(a2.join("ep_init/program.bin").is_file() && a2.join("ep_init/cpu.bin").is_file());
    assert!(text.contains("role ep_init"), "{text}");
    // Degree 1 has no exchange to set up: no EP init program.
    let a1 = tmp.path().join("ep1.maxc");
    assert!(compile(&a1, 1).status.success());
    assert!(!a1.join("ep_init").exists());
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a1.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        m["roles"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["decoder"]
    );
    // Degree 4: one expert per rank, so one slot per token at worst. Only the records, the EP
    // init program (its buffers' shapes and arena) and its role's bounds change; the decoder
    // is the same program.
    let o = maxc(&["diff", a2.to_str().unwrap(), a4.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let d = String::from_utf8_lossy(&o.stdout);
    assert!(
        d.contains("\"ep.degree\": 4") && d.contains("\"ep.max_tokens_per_rank\": 64"),
        "{d}"
    );
    assert!(
        d.contains("+  b2    dispatch_recv") && d.contains("f32[64, 259]"),
        "the receive buffer shrinks to the new bound: {d}"
    );
    let files = d
        .lines()
        .find_map(|l| l.split_once("file(s) differ: ").map(|(_, f)| f))
        .expect("a list of the files that differ");
    assert!(
        files
            .split(", ")
            .all(|f| f.starts_with("ep_init/") || f == "manifest.json"),
        "only the EP init program and the manifest differ: {files}"
    );
    assert!(!d.contains("decoder/"), "the decoder is unchanged: {d}");
    // In the manifest: the records and the ep_init role entry's sizes.
    let manifest_diff = &d[d.find("+++ b/manifest.json").expect("a manifest diff")..];
    let changed: Vec<&str> = manifest_diff
        .lines()
        .filter(|l| (l.starts_with('+') || l.starts_with('-')) && !l.starts_with("+++"))
        .collect();
    assert!(
        changed
            .iter()
            .all(|l| l.contains("ep.") || l.contains("_bytes") || l.contains("\"kernels\"")),
        "only the records and the ep_init role's sizes change in the manifest: {changed:#?}"
    );
}

#[test]
fn an_expert_parallel_artifact_runs_only_at_its_degree() {
    let tmp = tempfile::tempdir().unwrap();
    let a2 = tmp.path().join("ep2.maxc");
    assert!(compile(&a2, 2).status.success());
    let gen = |degree: &str| {
        maxc(&[
            "generate",
            a2.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--expert-parallel-degree",
            degree,
        ])
    };
    let o = gen("4");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("expert-parallel degree 2") && err.contains("at 4"),
        "{err}"
    );
    let o = gen("2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Without the flag it runs at the artifact's degree.
    let o = maxc(&["run", a2.to_str().unwrap(), "--tokens", "1,2,3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// tiny-deepseek-v3 at degree 2: the records say its one shared expert is replicated on every
/// rank (outside the exchange, which counts the 8 routed experts only) and name its router,
/// and the EP init program gives every rank the shared expert.
#[test]
fn deepseek_records_replicated_shared_experts_and_its_router() {
    use maxc_runtime::cpu::CpuExecutor;
    use maxc_runtime::schema::ep_init;
    use maxc_runtime::Artifact;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds.maxc");
    let m = fixtures().join("tiny-deepseek-v3");
    let o = maxc(&[
        "compile",
        m.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--max-seq-len",
        "64",
        "--page-size",
        "16",
        "--max-batch-input-tokens",
        "64",
        "--expert-parallel-degree",
        "2",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let rec = &manifest["export_records"];
    assert_eq!(rec["moe.num_experts"], 8, "{rec}");
    assert_eq!(rec["ep.experts_per_rank"], 4, "{rec}");
    assert_eq!(rec["moe.num_shared_experts"], 1, "{rec}");
    assert_eq!(rec["moe.shared_intermediate_size"], 128, "{rec}");
    assert_eq!(rec["ep.shared_experts"], "replicated", "{rec}");
    assert_eq!(rec["moe.router"]["scoring"], "sigmoid", "{rec}");
    assert_eq!(rec["moe.router"]["n_group"], 4, "{rec}");
    assert_eq!(rec["moe.router"]["topk_group"], 2, "{rec}");
    assert_eq!(rec["moe.router"]["routed_scaling_factor"], 2.5, "{rec}");
    let artifact = Arc::new(Artifact::open(&out).unwrap());
    for rank in 0..2 {
        let mut exec =
            CpuExecutor::new(artifact.clone(), ep_init::ROLE, Default::default()).unwrap();
        let outs = exec.run_once(&[(ep_init::RANK_INPUT, vec![rank])]).unwrap();
        let ints = |name: &str| -> Vec<i32> {
            let (ptr, bytes) = outs[name];
            // SAFETY: the executor's output buffer of `bytes` bytes, alive with `exec`.
            unsafe { std::slice::from_raw_parts(ptr.cast::<i32>(), bytes / 4) }.to_vec()
        };
        assert_eq!(ints(ep_init::SHARED_EXPERTS), [0], "rank {rank}");
        let per = 4 * rank;
        assert_eq!(
            ints(ep_init::LOCAL_EXPERTS),
            [per, per + 1, per + 2, per + 3],
            "rank {rank}"
        );
    }
}
