//! Mixture of experts deployed with expert parallelism, through `maxc compile`: a degree that
//! does not divide the experts is refused and leaves no artifact; the artifact records the
//! deployment (experts, top-k, degree, experts per rank, max tokens per rank, exchange
//! buffers), shown by `inspect` and changed, between degrees, only where the degree matters.

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
    // Degree 4: one expert per rank, so one slot per token at worst; only the records differ.
    let o = maxc(&["diff", a2.to_str().unwrap(), a4.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let d = String::from_utf8_lossy(&o.stdout);
    assert!(
        d.contains("\"ep.degree\": 4") && d.contains("\"ep.max_tokens_per_rank\": 64"),
        "{d}"
    );
    let changed: Vec<&str> = d
        .lines()
        .filter(|l| {
            (l.starts_with('+') || l.starts_with('-'))
                && !l.starts_with("+++")
                && !l.starts_with("---")
        })
        .collect();
    assert!(
        changed.iter().all(|l| l.contains("ep.")
            || l.contains("_bytes")
            || l.contains("sha256")
            || l.contains("size")),
        "only the records (and the manifest's own checksum lines) change: {changed:#?}"
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
