//! Tensor-parallel ranks as processes under `mpirun` on loopback (cargo feature `mpi`; Open
//! MPI from `scripts/install-mpi.sh`): rank 0 runs the command and broadcasts each step's
//! inputs, the other ranks follow; the logits are the in-process ranks' (within 1e-5) and
//! degree 1's (within 1e-4), and greedy tokens are degree 1's. A rank count that is not the
//! artifact's degree is refused.

mod tp;

use tp::{compile, greedy, logits, maxc, worst};

#[test]
fn ranks_as_processes_give_the_in_process_ranks_logits_and_degree_1s_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let one = compile("tiny-llama", 1, tmp.path());
    let want = logits(None, &one, "one");
    let tokens = greedy(None, &one);
    for degree in [2, 4] {
        let a = compile("tiny-llama", degree, tmp.path());
        let local = logits(None, &a, &format!("local{degree}"));
        let mpi = logits(Some(degree), &a, &format!("mpi{degree}"));
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
    let a = compile("tiny-llama", 2, tmp.path());
    let o = maxc(Some(3), &["run", a.to_str().unwrap(), "--tokens", "1,2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("compiled for tensor-parallel degree 2") && err.contains("mpirun -np 2"),
        "{err}"
    );
}
