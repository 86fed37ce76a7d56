//! Running the HTTP tests (`cli/tests/serve/*.py`, pytest, the `openai` client and httpx from
//! PyPI through `scripts/install-py-test-deps.sh`) from a cargo test.

use maxc_golden::fixtures;
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn script(name: &str) -> String {
    let out = Command::new("bash")
        .arg(format!("scripts/{name}"))
        .current_dir(root())
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "scripts/{name} failed (it needs python3 with pip and PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The path of what `scripts/NAME` fetches (and prints), from the repository's root.
pub fn fetched(name: &str) -> String {
    root().join(script(name)).to_str().unwrap().to_string()
}

/// Runs pytest over `cli/tests/serve` with `args` (a `-k` selection, say) and `env` beside
/// the binary, fixtures and SmolLM2 GGUF it always gets; fails the test with pytest's output
/// unless every selected test passed.
pub fn pytest(args: &[&str], env: &[(&str, &str)]) {
    let py = script("install-py-test-deps.sh");
    let gguf = fetched("fetch-smollm2.sh");
    let out = Command::new("python3")
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "cli/tests/serve",
        ])
        .args(args)
        .current_dir(root())
        .env("PYTHONPATH", &py)
        .env("MAXC_BIN", env!("CARGO_BIN_EXE_maxc"))
        .env("MAXC_FIXTURES", fixtures())
        .env("MAXC_SMOLLM2", gguf)
        .envs(env.iter().copied())
        .output()
        .expect("python3 runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "the HTTP tests failed:\n{text}");
}
