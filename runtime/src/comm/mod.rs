//! Communicators: the collectives that tensor- and expert-parallel ranks run among themselves,
//! behind one interface, [`Communicator`], with an implementation per transport:
//! - [`LocalGroup`]: every rank a thread of this process, data moved by copies (what the tests
//!   and single-process runs use, with no MPI installed);
//! - `MpiComm` (cargo feature `mpi`): one rank per process, over the system's Open MPI, launched
//!   by `mpirun` on one host or many;
//! - [`NcclComm`]: one rank per GPU over NCCL (loaded at run time; making a group without a GPU
//!   or the library is an error saying which).
//!
//! Every implementation gives the same results, bit for bit: a sum is gathered and added in rank
//! order on every rank (MPI's own reductions may associate in another order, and differ by
//! rank), so that replicated state (the residual stream of a tensor-parallel model) stays equal
//! on every rank. A collective that waits longer than its group's timeout for a peer fails,
//! naming the collective and the ranks it waited for (a rank that died or hangs), rather than
//! hanging the job.

mod local;
#[cfg(feature = "mpi")]
mod mpi;
mod nccl;

pub use local::{LocalComm, LocalGroup};
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
pub use nccl::NcclComm;

use crate::error::{Result, RuntimeError};
use std::time::Duration;

/// This process's rank of a group a launcher started (`mpirun`), until an engine takes it.
static WORLD: std::sync::Mutex<Option<Box<dyn Communicator>>> = std::sync::Mutex::new(None);

/// Sets this process's rank of the group a launcher started: the engine of a tensor-parallel
/// artifact takes it (rank 0; the other ranks follow rank 0's steps with
/// [`crate::engine::follow`]).
pub fn set_world(comm: Box<dyn Communicator>) {
    *WORLD.lock().unwrap_or_else(|e| e.into_inner()) = Some(comm);
}

/// Takes the communicator [`set_world`] set, if any.
pub fn take_world() -> Option<Box<dyn Communicator>> {
    WORLD.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// How long a collective waits for its peers by default before it fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The collectives of one group of ranks. Each rank holds its own communicator and calls the
/// same collectives in the same order as every other rank; sizes must agree where the
/// collective says so.
pub trait Communicator: Send + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Every rank's `data` (the same length on each) summed element-wise into every rank's
    /// `data`, ranks added in rank order.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()>;
    /// Every rank's `send` (the same length on each) into `recv`, concatenated in rank order
    /// (`recv` holds `size() × send.len()` values).
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// `send` holds one segment per peer in peer order, `send_counts[p]` values for peer `p`;
    /// `recv` receives the segment each peer holds for this rank, in peer order, and
    /// `recv_counts[p]` how many values came from peer `p`. Returns the values received; more
    /// than `recv` holds is an error on the receiving rank, and moves nothing into `recv`.
    fn all_to_all_v(
        &mut self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &mut [usize],
    ) -> Result<usize>;
    /// `root`'s `data` into every rank's `data` (resized to the root's length).
    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()>;
    /// [`Communicator::broadcast`] for which a rank may wait without limit: how a following
    /// rank waits for its next step, however long the server stays idle (no timeout ends it;
    /// a root that dies still ends the job).
    fn broadcast_unbounded(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        self.broadcast(data, root)
    }
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
    /// Ends the group's collectives after a rank failed on its own (`why`): the peers waiting
    /// in one fail at once, naming this rank, rather than after the timeout. Under MPI this
    /// ends the job.
    fn abort(&mut self, why: &str);
}

/// `data` := every rank's part of `all` (`data.len()` values each, in rank order) added
/// element-wise in rank order: how every implementation finishes a sum from a gather, so that
/// every rank, and every transport, gets the same bits.
pub(crate) fn sum_in_rank_order(all: &[f32], data: &mut [f32]) {
    let len = data.len();
    if len == 0 {
        return;
    }
    data.copy_from_slice(&all[..len]);
    for part in all[len..].chunks_exact(len) {
        for (d, v) in data.iter_mut().zip(part) {
            *d += v;
        }
    }
}

/// An error of collective `op` on `rank`.
pub(crate) fn error(rank: usize, op: &str, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Collective(format!("rank {rank}: {op}: {message}"))
}

/// An all-gather's receive buffer holds every rank's `send` values.
pub(crate) fn check_gather(rank: usize, size: usize, send: usize, recv: usize) -> Result<()> {
    if recv == size * send {
        return Ok(());
    }
    Err(error(
        rank,
        "all_gather",
        format!("a receive buffer of {recv} values for {size} ranks of {send}"),
    ))
}

/// A broadcast's root is a rank of the group.
pub(crate) fn check_root(rank: usize, size: usize, root: usize) -> Result<()> {
    if root < size {
        return Ok(());
    }
    Err(error(
        rank,
        "broadcast",
        format!("root {root} is not a rank of {size}"),
    ))
}

/// Checks the arguments every implementation checks the same way before it moves anything:
/// one count per peer, counts that fit `send`.
pub(crate) fn check_all_to_all(
    rank: usize,
    size: usize,
    send: &[f32],
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<()> {
    if send_counts.len() != size || recv_counts.len() != size {
        return Err(error(
            rank,
            "all_to_all_v",
            format!(
                "{} send counts and {} receive counts; expected one per rank ({size})",
                send_counts.len(),
                recv_counts.len()
            ),
        ));
    }
    let total: usize = send_counts.iter().sum();
    if total > send.len() {
        return Err(error(
            rank,
            "all_to_all_v",
            format!(
                "the send counts add up to {total} values, above the {} given",
                send.len()
            ),
        ));
    }
    Ok(())
}

/// Runs every collective on `comm` with values that depend on the rank and checks each
/// result against its closed form: the same check for every implementation (the local
/// group's tests, and `mpirun` of the runtime's `comm_check` example over MPI). Returns a
/// line saying what passed.
pub fn self_check(comm: &mut dyn Communicator) -> Result<String> {
    let (r, n) = (comm.rank(), comm.size());
    let fail = |what: String| Err(error(r, "self_check", what));
    // Values whose sums are exact in f32, so any order would agree: the check is of the data
    // movement.
    let value = |rank: usize, i: usize| (rank * 1000 + i) as f32;
    for len in [1usize, 7, 4096] {
        let mut data: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        comm.all_reduce_sum(&mut data)?;
        for (i, &v) in data.iter().enumerate() {
            let want: f32 = (0..n).map(|q| value(q, i)).sum();
            if v != want {
                return fail(format!(
                    "all_reduce_sum[{i}] of {len} is {v}, expected {want}"
                ));
            }
        }
        let send: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        let mut recv = vec![f32::NAN; n * len];
        comm.all_gather(&send, &mut recv)?;
        for q in 0..n {
            for i in 0..len {
                if recv[q * len + i] != value(q, i) {
                    return fail(format!(
                        "all_gather: rank {q}'s value {i} of {len} is wrong"
                    ));
                }
            }
        }
    }
    // Rank s sends (s + p) % 3 values to peer p: some segments empty.
    let count = |s: usize, p: usize| (s + p) % 3;
    let send_counts: Vec<usize> = (0..n).map(|p| count(r, p)).collect();
    let send: Vec<f32> = (0..n)
        .flat_map(|p| (0..count(r, p)).map(move |i| (r * 100 + p * 10 + i) as f32))
        .collect();
    let mut recv = vec![f32::NAN; 2 * n];
    let mut recv_counts = vec![usize::MAX; n];
    let got = comm.all_to_all_v(&send, &send_counts, &mut recv, &mut recv_counts)?;
    let want: Vec<f32> = (0..n)
        .flat_map(|s| (0..count(s, r)).map(move |i| (s * 100 + r * 10 + i) as f32))
        .collect();
    if recv_counts != (0..n).map(|s| count(s, r)).collect::<Vec<_>>() || recv[..got] != want[..] {
        return fail(format!(
            "all_to_all_v received {:?} in counts {recv_counts:?}, expected {want:?}",
            &recv[..got]
        ));
    }
    let root = n - 1;
    let mut bytes = if r == root {
        b"step inputs".to_vec()
    } else {
        vec![0; 3]
    };
    comm.broadcast(&mut bytes, root)?;
    if bytes != b"step inputs" {
        return fail(format!("broadcast from rank {root} gave {bytes:?}"));
    }
    // An empty broadcast (how a step loop is told to stop).
    let mut empty = if r == 0 { Vec::new() } else { vec![1, 2] };
    comm.broadcast(&mut empty, 0)?;
    if !empty.is_empty() {
        return fail(format!("an empty broadcast gave {empty:?}"));
    }
    comm.barrier()?;
    Ok(format!(
        "rank {r} of {n}: all_reduce_sum, all_gather, all_to_all_v, broadcast and barrier agree"
    ))
}
