//! A malformed program is a clean error, never undefined behaviour: random byte mutations of a
//! compiled `decoder/program.bin` (its checksum updated, as a buggy exporter or a version skew
//! would leave it) each end in a clean error or a completed run of `maxc run`, never a crash, a
//! panic or a hang.

use maxc_golden::fixtures;
use maxc_schema::Manifest;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Mutations tried (the issue asks for at least 200).
const MUTATIONS: usize = 240;
/// A run taking longer than this counts as a hang.
const HANG: Duration = Duration::from_secs(60);

fn maxc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_maxc"))
}

/// xorshift64*: a fixed, seedable stream, so a failing mutation can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn reseal(artifact: &Path, file: &str, bytes: &[u8]) {
    std::fs::write(artifact.join(file), bytes).unwrap();
    let mpath = artifact.join("manifest.json");
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let e = m.files.get_mut(file).unwrap();
    e.bytes = bytes.len() as u64;
    e.sha256 = maxc_schema::sha256_hex(bytes);
    std::fs::write(&mpath, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Completed,
    CleanError,
    Panic,
    Crash,
    Hang,
}

/// Runs `maxc run` on the artifact and classifies how it ended.
fn run(artifact: &Path) -> (Outcome, String) {
    let mut child = maxc()
        .args([
            "run",
            artifact.to_str().unwrap(),
            "--tokens",
            "1,5,9,200,3,7,11",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("maxc runs");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let outcome = match status {
        None => Outcome::Hang,
        Some(_) if err.contains("panicked") => Outcome::Panic,
        Some(s) if s.success() => Outcome::Completed,
        Some(s) if s.code() == Some(1) && err.starts_with("error: ") => Outcome::CleanError,
        Some(s) if s.code().is_none() || s.code() == Some(101) => Outcome::Crash,
        Some(_) => Outcome::Crash,
    };
    (outcome, err)
}

#[test]
fn mutated_programs_give_clean_errors_or_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let artifact = tmp.path().join("m.maxc");
    let model = fixtures().join("tiny-llama");
    let o = maxc()
        .args(["compile", model.to_str().unwrap(), "--out"])
        .arg(&artifact)
        .args([
            "--quiet",
            "--max-seq-len",
            "64",
            "--page-size",
            "16",
            "--dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(run(&artifact).0, Outcome::Completed);

    let file = "decoder/program.bin";
    let original = std::fs::read(artifact.join(file)).unwrap();
    let manifest = std::fs::read(artifact.join("manifest.json")).unwrap();
    let mut rng = Rng(0x6d61_7863_2d6d_7574);
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    let mut bad = Vec::new();
    for i in 0..MUTATIONS {
        let mut bytes = original.clone();
        let what = match rng.below(4) {
            // One bit flipped.
            0 => {
                let at = rng.below(bytes.len());
                bytes[at] ^= 1 << rng.below(8);
                format!("bit at {at}")
            }
            // One byte replaced.
            1 => {
                let at = rng.below(bytes.len());
                bytes[at] = rng.next() as u8;
                format!("byte at {at}")
            }
            // A run of up to 8 bytes replaced.
            2 => {
                let at = rng.below(bytes.len());
                let n = 1 + rng.below(8);
                for b in bytes.iter_mut().skip(at).take(n) {
                    *b = rng.next() as u8;
                }
                format!("{n} bytes at {at}")
            }
            // A byte set to a large varint prefix (bincode's u64 marker).
            _ => {
                let at = rng.below(bytes.len());
                bytes[at] = 253;
                format!("varint marker at {at}")
            }
        };
        reseal(&artifact, file, &bytes);
        let (outcome, err) = run(&artifact);
        *counts.entry(format!("{outcome:?}")).or_default() += 1;
        if matches!(outcome, Outcome::Panic | Outcome::Crash | Outcome::Hang) {
            bad.push(format!("mutation {i} ({what}): {outcome:?}: {err}"));
        }
        std::fs::write(artifact.join("manifest.json"), &manifest).unwrap();
    }
    println!("{MUTATIONS} mutations of {file}: {counts:?}");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert_eq!(counts.values().sum::<usize>(), MUTATIONS);
    assert!(
        counts.get("CleanError").copied().unwrap_or(0) > MUTATIONS / 2,
        "most mutations should be refused: {counts:?}"
    );
}
