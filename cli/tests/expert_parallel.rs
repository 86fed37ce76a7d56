//! Expert-parallel ranks as separate executors, as processes under `mpirun` hold them (one
//! rank each, exchanging over a communicator: here the in-process one, each rank on a thread of
//! its own, its own opened artifact): every rank's logits are the in-process exchange's (one
//! executor holding every rank), and each rank stages only its own experts' weights.

mod tp;

use maxc_runtime::artifact::{Artifact, WeightMemory};
use maxc_runtime::comm::LocalGroup;
use maxc_runtime::cpu::CpuExecutor;
use std::sync::Arc;

/// The prompt's first step: every token of [`tp::PROMPT`] on page 0, logits of every row.
fn prompt_step() -> maxc_runtime::StepInputs {
    let tokens: Vec<i64> = tp::PROMPT.split(',').map(|t| t.parse().unwrap()).collect();
    let n = tokens.len();
    maxc_runtime::StepInputs {
        tokens,
        input_row_offsets: vec![0, n as i32],
        cache_lengths: vec![0],
        kv_lookup_table: vec![0; 4],
        pages_per_seq: 4,
        kv_groups: 1,
        logit_indices: (0..n as i32).collect(),
    }
}

#[test]
fn ranks_in_separate_executors_give_the_in_process_exchanges_logits_and_stage_their_own_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let step = prompt_step();
    let staged = maxc_runtime::hugemem::available();
    if !staged {
        eprintln!("the staging checks are skipped: no transparent huge pages here");
    }
    for degree in [2usize, 4] {
        let a = tp::compile_at("tiny-mixtral", "expert", degree, tmp.path());
        let one = Arc::new(Artifact::open_verified(&a, None, WeightMemory::Mapped).unwrap());
        let want = CpuExecutor::new(one, "decoder", Default::default())
            .unwrap()
            .execute(&step)
            .unwrap();
        let memory = if staged {
            WeightMemory::Staged
        } else {
            WeightMemory::Mapped
        };
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalGroup::ranks(degree)
                .into_iter()
                .map(|comm| {
                    let (a, step) = (&a, &step);
                    s.spawn(move || {
                        let artifact = Arc::new(Artifact::open_verified(a, None, memory).unwrap());
                        let mut exec = CpuExecutor::in_group(
                            Arc::clone(&artifact),
                            "decoder",
                            Default::default(),
                            Box::new(comm),
                        )
                        .unwrap();
                        (exec.execute(step).unwrap(), artifact)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (got, artifact)) in results.iter().enumerate() {
            let d = tp::worst(&got.data, &want.data);
            assert!(d <= 1e-6, "degree {degree}, rank {rank}: max |diff| {d}");
            if !staged {
                continue;
            }
            artifact.stage_weights();
            artifact.wait_for_staged_weights();
            let copy = artifact.staged_weights().expect("staged");
            let file = artifact.weights_bytes();
            let per = 4 / degree;
            for e in 0..4 {
                let key = format!("decoder/model.layers.1.block_sparse_moe.experts.{e}.w2.weight");
                let (_, b) = artifact.weight(&key).unwrap();
                let r = artifact.weights_range(b.as_ptr(), b.len()).unwrap();
                if e / per == rank {
                    assert_eq!(copy[r.clone()], file[r], "rank {rank} holds {key}");
                } else {
                    assert!(
                        copy[r].iter().all(|&b| b == 0),
                        "rank {rank} staged {key}, another rank's expert"
                    );
                }
            }
        }
        // A group whose size is not the degree is refused, naming both.
        let comm = LocalGroup::ranks(degree + 1).into_iter().next().unwrap();
        let artifact = Arc::new(Artifact::open_verified(&a, None, WeightMemory::Mapped).unwrap());
        let e = CpuExecutor::in_group(artifact, "decoder", Default::default(), Box::new(comm))
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains(&format!("expert-parallel degree {degree}"))
                && e.contains(&format!("of {}", degree + 1)),
            "{e}"
        );
    }
}
