//! Tensor-parallel ranks as processes under `mpirun` on loopback (cargo feature `mpi`; Open
//! MPI from `scripts/install-mpi.sh`): rank 0 runs the command and broadcasts each step's
//! inputs, the other ranks follow; the logits are the in-process ranks' (within 1e-5) and
//! degree 1's (within 1e-4), and greedy tokens are degree 1's. A rank count that is not the
//! artifact's degree is refused.

use maxc_golden::fixtures;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PROMPT: &str = "1,5,9,200,31,7,77,3,12,40";

fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// `maxc args..`, under `mpirun -np ranks` where given.
fn maxc(ranks: Option<usize>, args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_maxc");
    let mut cmd = match ranks {
        None => Command::new(exe),
        Some(n) => {
            let mut c = Command::new("mpirun");
            c.args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                &n.to_string(),
                exe,
            ]);
            c
        }
    };
    cmd.args(args)
        .output()
        .expect("mpirun runs: scripts/install-mpi.sh installs Open MPI")
}

fn compile(degree: usize, dir: &Path) -> PathBuf {
    let out = dir.join(format!("tp{degree}.maxc"));
    ok(maxc(
        None,
        &[
            "compile",
            fixtures().join("tiny-llama").to_str().unwrap(),
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
        ],
    ));
    out
}

fn logits(ranks: Option<usize>, artifact: &Path, file: &Path) -> Vec<f32> {
    ok(maxc(
        ranks,
        &[
            "run",
            artifact.to_str().unwrap(),
            "--tokens",
            PROMPT,
            "--dump-logits",
            file.to_str().unwrap(),
        ],
    ));
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn greedy(ranks: Option<usize>, artifact: &Path) -> serde_json::Value {
    let o = ok(maxc(
        ranks,
        &[
            "generate",
            artifact.to_str().unwrap(),
            "--tokens",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ],
    ));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["generated"].clone()
}

#[test]
fn ranks_as_processes_give_the_in_process_ranks_logits_and_degree_1s_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let one = compile(1, tmp.path());
    let want = logits(None, &one, &tmp.path().join("one.st"));
    let tokens = greedy(None, &one);
    for degree in [2, 4] {
        let a = compile(degree, tmp.path());
        let local = logits(None, &a, &tmp.path().join(format!("local{degree}.st")));
        let mpi = logits(
            Some(degree),
            &a,
            &tmp.path().join(format!("mpi{degree}.st")),
        );
        let worst = |a: &[f32], b: &[f32]| {
            assert_eq!(a.len(), b.len());
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        // The same programs and sums; each rank under mpirun has one core (its binding), so
        // only the kernels' thread split differs from the in-process ranks'.
        let (d_local, d_one) = (worst(&mpi, &local), worst(&mpi, &want));
        assert!(
            d_local <= 1e-5,
            "degree {degree}: against in-process ranks {d_local}"
        );
        assert!(d_one <= 1e-4, "degree {degree}: against degree 1 {d_one}");
        assert_eq!(greedy(Some(degree), &a), tokens, "degree {degree}");
    }
}

#[test]
fn a_rank_count_other_than_the_artifacts_degree_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = compile(2, tmp.path());
    let o = maxc(Some(3), &["run", a.to_str().unwrap(), "--tokens", "1,2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("compiled for tensor-parallel degree 2") && err.contains("mpirun -np 2"),
        "{err}"
    );
}
