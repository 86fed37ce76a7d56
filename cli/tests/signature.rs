//! Signed artifacts end to end: `maxc keygen`, `maxc sign`, and `--require-signature` on `run`,
//! `generate` and `serve`, refusing unsigned, wrongly signed and altered artifacts with errors
//! that say which, before the artifact is loaded.

use maxc_golden::fixtures;
use std::path::Path;
use std::process::{Command, Output};

fn maxc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .expect("maxc runs")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn refused(out: &Output, wants: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected a refusal, got success");
    for w in wants {
        assert!(err.contains(w), "error lacks `{w}`: {err}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn signatures_are_required_checked_and_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("tiny.maxc");
    let model = fixtures().join("tiny-llama");
    ok(&maxc(&["compile", s(&model), "--out", s(&art), "--quiet"]));
    let prefix = tmp.path().join("release");
    ok(&maxc(&["keygen", "--out", s(&prefix)]));
    let (key, public) = (
        tmp.path().join("release.key"),
        tmp.path().join("release.pub"),
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o077,
            0,
            "the secret key is readable by others: {mode:o}"
        );
    }
    // keygen never replaces a key.
    refused(
        &maxc(&["keygen", "--out", s(&prefix)]),
        &["release.key", "exists"],
    );
    let run = |extra: &[&str]| {
        let mut args = vec!["run", s(&art), "--tokens", "1,2,3"];
        args.extend_from_slice(extra);
        maxc(&args)
    };

    // Unsigned: runs without the flag, refused with it.
    ok(&run(&[]));
    refused(
        &run(&["--require-signature", s(&public)]),
        &["manifest.sig", "not signed"],
    );

    // Signed: accepted by run and generate.
    ok(&maxc(&["sign", s(&art), "--key", s(&key)]));
    ok(&run(&["--require-signature", s(&public)]));
    ok(&maxc(&[
        "generate",
        s(&art),
        "--tokens",
        "1,2",
        "--max-new-tokens",
        "2",
        "--require-signature",
        s(&public),
    ]));

    // Another key's public half: refused, naming both keys.
    ok(&maxc(&["keygen", "--out", s(&tmp.path().join("other"))]));
    refused(
        &run(&["--require-signature", s(&tmp.path().join("other.pub"))]),
        &["signed by key", "not by the required key"],
    );

    // The manifest altered after signing (still valid JSON, every file's checksum intact).
    let manifest = art.join("manifest.json");
    let original = std::fs::read(&manifest).unwrap();
    let mut altered = original.clone();
    altered.push(b'\n');
    std::fs::write(&manifest, &altered).unwrap();
    ok(&run(&[]));
    refused(
        &run(&["--require-signature", s(&public)]),
        &["does not match the manifest", "changed after it was signed"],
    );
    std::fs::write(&manifest, &original).unwrap();
    ok(&run(&["--require-signature", s(&public)]));

    // A key file that is not a key, and serve refusing before it listens.
    let junk = tmp.path().join("junk.pub");
    std::fs::write(&junk, "hello\n").unwrap();
    refused(
        &run(&["--require-signature", s(&junk)]),
        &["junk.pub", "not a maxc public key"],
    );
    std::fs::remove_file(art.join("manifest.sig")).unwrap();
    refused(
        &maxc(&[
            "serve",
            s(&art),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--require-signature",
            s(&public),
        ]),
        &["not signed"],
    );
}
