//! Every rank a thread of this process: each collective is one round in which every rank
//! deposits its part under a lock, the last to arrive publishes the round, and each rank then
//! reads what it needs from every part (so every rank computes a sum in the same order).

use super::{check_all_to_all, check_gather, check_root, error, Communicator, DEFAULT_TIMEOUT};
use crate::error::Result;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A group of ranks in this process: [`LocalGroup::ranks`] gives one communicator per rank,
/// each to be moved to the thread that runs that rank.
#[derive(Debug)]
pub struct LocalGroup;

impl LocalGroup {
    /// `size` ranks whose collectives wait [`DEFAULT_TIMEOUT`] for their peers.
    pub fn ranks(size: usize) -> Vec<LocalComm> {
        Self::ranks_with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// `size` ranks whose collectives wait `timeout` for their peers before they fail.
    pub fn ranks_with_timeout(size: usize, timeout: Duration) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                round: 0,
                parts: (0..size).map(|_| None).collect(),
                done: None,
                left: vec![false; size],
                broken: None,
            }),
            ready: Condvar::new(),
        });
        (0..size)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

/// One rank of a [`LocalGroup`]. Dropping it (a rank that ends or panics) fails the
/// collectives its peers wait in, or will call, at once.
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Debug)]
struct State {
    /// Rounds completed.
    round: u64,
    /// This round's parts, by rank.
    parts: Vec<Option<Part>>,
    /// The last completed round's parts, in rank order.
    done: Option<Arc<Vec<Part>>>,
    /// Ranks whose communicator was dropped.
    left: Vec<bool>,
    /// Why the group can run no more collectives.
    broken: Option<String>,
}

/// What one rank brings to a round.
#[derive(Debug, Default)]
struct Part {
    op: &'static str,
    values: Vec<f32>,
    counts: Vec<usize>,
    bytes: Vec<u8>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left the state whole: every change
        // under it is a single assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LocalComm {
    /// Deposits `part` and returns every rank's part of the round, once all have arrived.
    fn round(&self, part: Part) -> Result<Arc<Vec<Part>>> {
        let (rank, op) = (self.rank, part.op);
        let shared = &self.shared;
        let mut st = shared.lock();
        if let Some(why) = &st.broken {
            return Err(error(rank, op, why));
        }
        let mine = st.round;
        st.parts[rank] = Some(part);
        if st.parts.iter().all(Option::is_some) {
            let parts: Vec<Part> = st.parts.iter_mut().filter_map(Option::take).collect();
            if let Some(q) = parts.iter().position(|p| p.op != op) {
                let why = format!(
                    "rank {q} called {} where rank {rank} called {op}: the ranks' programs disagree",
                    parts[q].op
                );
                st.broken = Some(why.clone());
                shared.ready.notify_all();
                return Err(error(rank, op, why));
            }
            let parts = Arc::new(parts);
            st.done = Some(parts.clone());
            st.round += 1;
            shared.ready.notify_all();
            return Ok(parts);
        }
        let deadline = Instant::now() + shared.timeout;
        loop {
            if st.round > mine {
                // Round `mine + 1` needs this rank's part, so `done` is still round `mine`.
                return Ok(st.done.clone().expect("a completed round"));
            }
            if let Some(why) = &st.broken {
                return Err(error(rank, op, why));
            }
            let missing: Vec<usize> = (0..shared.size)
                .filter(|&q| st.parts[q].is_none())
                .collect();
            if let Some(&q) = missing.iter().find(|&&q| st.left[q]) {
                let why = format!("rank {q} left the group before joining {op}");
                st.broken = Some(why.clone());
                shared.ready.notify_all();
                return Err(error(rank, op, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!(
                    "waited {:.1} s for rank(s) {missing:?} (died or hung)",
                    shared.timeout.as_secs_f64()
                );
                st.broken = Some(format!("rank {rank} gave up on {op}: {why}"));
                shared.ready.notify_all();
                return Err(error(rank, op, why));
            }
            st = shared
                .ready
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Every part's values have `len` values, else an error naming the first that does not.
    fn same_len(&self, op: &str, parts: &[Part], len: usize) -> Result<()> {
        match parts.iter().position(|p| p.values.len() != len) {
            None => Ok(()),
            Some(q) => Err(error(
                self.rank,
                op,
                format!(
                    "rank {q} gave {} values where rank {} gave {len}",
                    parts[q].values.len(),
                    self.rank
                ),
            )),
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.left[self.rank] = true;
        self.shared.ready.notify_all();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        let parts = self.round(Part {
            op: OP,
            values: data.to_vec(),
            ..Part::default()
        })?;
        self.same_len(OP, &parts, data.len())?;
        for (i, d) in data.iter_mut().enumerate() {
            *d = parts[1..]
                .iter()
                .fold(parts[0].values[i], |s, p| s + p.values[i]);
        }
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        const OP: &str = "all_gather";
        check_gather(self.rank, self.size(), send.len(), recv.len())?;
        let parts = self.round(Part {
            op: OP,
            values: send.to_vec(),
            ..Part::default()
        })?;
        self.same_len(OP, &parts, send.len())?;
        for (chunk, p) in recv.chunks_exact_mut(send.len().max(1)).zip(parts.iter()) {
            chunk.copy_from_slice(&p.values);
        }
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &mut [usize],
    ) -> Result<usize> {
        const OP: &str = "all_to_all_v";
        let (rank, size) = (self.rank, self.size());
        check_all_to_all(rank, size, send, send_counts, recv_counts)?;
        let total: usize = send_counts.iter().sum();
        let parts = self.round(Part {
            op: OP,
            values: send[..total].to_vec(),
            counts: send_counts.to_vec(),
            ..Part::default()
        })?;
        let incoming: usize = parts.iter().map(|p| p.counts[rank]).sum();
        if incoming > recv.len() {
            return Err(error(
                rank,
                OP,
                format!(
                    "would receive {incoming} values, above its buffer's {}",
                    recv.len()
                ),
            ));
        }
        let mut at = 0;
        for (q, p) in parts.iter().enumerate() {
            let offset: usize = p.counts[..rank].iter().sum();
            let n = p.counts[rank];
            recv[at..at + n].copy_from_slice(&p.values[offset..offset + n]);
            recv_counts[q] = n;
            at += n;
        }
        Ok(at)
    }

    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        check_root(self.rank, self.size(), root)?;
        let parts = self.round(Part {
            op: OP,
            bytes: if self.rank == root {
                data.clone()
            } else {
                Vec::new()
            },
            ..Part::default()
        })?;
        if self.rank != root {
            data.clone_from(&parts[root].bytes);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.round(Part {
            op: "barrier",
            ..Part::default()
        })
        .map(drop)
    }

    fn abort(&mut self, why: &str) {
        let mut st = self.shared.lock();
        if st.broken.is_none() {
            st.broken = Some(format!("rank {} failed: {why}", self.rank));
        }
        self.shared.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::self_check;
    use crate::error::RuntimeError;

    /// Runs `f` on every rank of a group of `size`, each on its own thread.
    fn on_ranks<T: Send + 'static>(
        comms: Vec<LocalComm>,
        f: impl Fn(&mut LocalComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let f = f.clone();
                std::thread::spawn(move || f(&mut c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_collective_gives_its_closed_form_on_groups_of_one_to_four() {
        for size in 1..=4 {
            for line in on_ranks(LocalGroup::ranks(size), |c| self_check(c)) {
                let line = line.unwrap();
                assert!(line.ends_with("agree"), "{line}");
            }
        }
    }

    #[test]
    fn a_sum_is_the_same_bits_on_every_rank() {
        // Values whose sum depends on the order of the additions.
        let sums = on_ranks(LocalGroup::ranks(3), |c| {
            let mut v = [[1e8f32, 1.0, -1e8][c.rank()]];
            c.all_reduce_sum(&mut v).unwrap();
            v[0].to_bits()
        });
        // ((1e8 + 1) - 1e8) in f32, rank order: 1e8 + 1 rounds to 1e8.
        assert_eq!(sums, vec![0.0f32.to_bits(); 3]);
    }

    #[test]
    fn a_rank_that_never_comes_is_named_after_the_timeout() {
        let mut comms = LocalGroup::ranks_with_timeout(3, Duration::from_millis(200));
        let late = comms.pop().unwrap();
        let errs = on_ranks(comms, |c| c.barrier().unwrap_err().to_string());
        assert!(
            errs.iter()
                .any(|e| e.contains("waited 0.2 s for rank(s) [2]")),
            "{errs:?}"
        );
        assert!(errs.iter().all(|e| e.contains("barrier")), "{errs:?}");
        drop(late);
    }

    #[test]
    fn a_rank_that_leaves_fails_its_peers_at_once() {
        let mut comms = LocalGroup::ranks_with_timeout(2, Duration::from_secs(60));
        let gone = comms.pop().unwrap();
        let t = Instant::now();
        let waiter = std::thread::spawn(move || {
            let mut c = comms.pop().unwrap();
            c.all_reduce_sum(&mut [1.0]).unwrap_err()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(gone);
        let e = waiter.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(
            matches!(&e, RuntimeError::Collective(m) if m.contains("rank 1 left the group before joining all_reduce_sum")),
            "{e}"
        );
    }

    #[test]
    fn an_aborting_rank_fails_its_waiting_peers_at_once_naming_itself() {
        let t = Instant::now();
        let errs = on_ranks(
            LocalGroup::ranks_with_timeout(3, Duration::from_secs(60)),
            |c| {
                if c.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(50));
                    c.abort("out of memory");
                    return String::new();
                }
                c.barrier().unwrap_err().to_string()
            },
        );
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(
            errs[..2]
                .iter()
                .all(|e| e.contains("rank 2 failed: out of memory")),
            "{errs:?}"
        );
    }

    #[test]
    fn ranks_that_call_different_collectives_or_sizes_are_told_which() {
        let errs = on_ranks(LocalGroup::ranks(2), |c| {
            if c.rank() == 0 {
                c.barrier().unwrap_err().to_string()
            } else {
                c.all_reduce_sum(&mut [1.0]).unwrap_err().to_string()
            }
        });
        assert!(errs[0].contains("programs disagree"), "{errs:?}");
        let errs = on_ranks(LocalGroup::ranks(2), |c| {
            let mut v = vec![1.0; 2 + c.rank()];
            c.all_reduce_sum(&mut v).unwrap_err().to_string()
        });
        assert!(
            errs[0].contains("rank 1 gave 3 values where rank 0 gave 2"),
            "{errs:?}"
        );
    }

    #[test]
    fn an_all_to_all_above_the_receive_buffer_moves_nothing() {
        let errs = on_ranks(LocalGroup::ranks(2), |c| {
            let send = [1.0f32; 4];
            let mut recv = [7.0f32; 3];
            let mut counts = [0usize; 2];
            let e = c
                .all_to_all_v(&send, &[2, 2], &mut recv, &mut counts)
                .unwrap_err()
                .to_string();
            assert_eq!(recv, [7.0; 3]);
            e
        });
        assert!(
            errs[0].contains("would receive 4 values, above its buffer's 3"),
            "{errs:?}"
        );
        let e = LocalGroup::ranks(1)[0]
            .all_to_all_v(&[1.0], &[2], &mut [0.0; 2], &mut [0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("add up to 2 values, above the 1 given"), "{e}");
    }
}
