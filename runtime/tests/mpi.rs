//! The MPI communicator under `mpirun` on loopback (cargo feature `mpi`; Open MPI from
//! `scripts/install-mpi.sh`): every collective checked at 1, 2, 3 and 4 ranks, and a rank that
//! hangs ends the job with an error naming it.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `comm_check` example, which `cargo test` builds beside this test.
fn comm_check() -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let bin = deps
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples/comm_check");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test -p maxc-runtime --features mpi` (which builds it)",
        bin.display()
    );
    bin
}

/// `mpirun -np n comm_check args..`, ended (and failed) after `limit`.
fn mpirun(n: usize, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut cmd = Command::new("mpirun");
    // Root in CI containers; more ranks than the 2 cores here.
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .arg(comm_check())
    .args(args)
    .envs(env.iter().copied())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("mpirun: {e}: run scripts/install-mpi.sh (Open MPI)"));
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            child.kill().ok();
            panic!("mpirun -np {n} {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn every_collective_agrees_with_its_closed_form_over_mpi() {
    for n in 1..=4 {
        let out = mpirun(n, &[], &[], Duration::from_secs(120));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{n} ranks: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        for r in 0..n {
            let line = format!("rank {r} of {n}: all_reduce_sum, all_gather, all_to_all_v, broadcast and barrier agree");
            assert!(
                stdout.contains(&line),
                "{n} ranks: no `{line}` in\n{stdout}"
            );
        }
    }
}

#[test]
fn a_rank_that_hangs_ends_the_job_naming_the_collective() {
    let t = Instant::now();
    let out = mpirun(
        3,
        &["hang"],
        &[("MAXC_COMM_TIMEOUT_S", "1")],
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("barrier has waited") && stderr.contains("a rank died or hangs"),
        "{stderr}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}
