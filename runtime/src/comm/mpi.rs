//! One rank per process over the system's Open MPI (the `mpi` crate; cargo feature `mpi`),
//! launched by `mpirun -np N` on one host or across hosts (`--host`).
//!
//! A rank that dies ends the job: Open MPI's errors are fatal, and `mpirun` names the rank.
//! A rank whose peers never arrive would wait forever inside MPI, so a watchdog thread ends
//! the process (exit status 75) once a collective has waited past the timeout, saying which
//! rank and collective; `mpirun` then ends the others.

use super::{check_all_to_all, check_gather, check_root, error, Communicator, DEFAULT_TIMEOUT};
use crate::error::{Result, RuntimeError};
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::Communicator as _;
use ::mpi::traits::*;
use ::mpi::{Count, Threading};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// This process's rank of `MPI_COMM_WORLD`.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    watch: Arc<Watch>,
    // Finalizes MPI when the communicator goes (declared last: dropped after `world`).
    _universe: Universe,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

// SAFETY: MPI is initialized with at least MPI_THREAD_SERIALIZED (checked in `init`), so any
// one thread at a time may call it; `&mut self` on every collective makes the calls one at a
// time.
unsafe impl Send for MpiComm {}

/// What the watchdog reads: since when (milliseconds after `start`, 0: none) the rank has been
/// in which collective.
struct Watch {
    start: Instant,
    since_ms: AtomicU64,
    op: Mutex<&'static str>,
    timeout: Duration,
    rank: usize,
}

/// Marks the rank as inside a collective while it lives.
struct Inside<'a>(&'a Watch);

impl Watch {
    fn enter(&self, op: &'static str) -> Inside<'_> {
        *self.op.lock().unwrap_or_else(|e| e.into_inner()) = op;
        let ms = self.start.elapsed().as_millis() as u64 + 1;
        self.since_ms.store(ms, Ordering::Release);
        Inside(self)
    }
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.since_ms.store(0, Ordering::Release);
    }
}

/// Ends the process when the rank has been inside one collective longer than the timeout;
/// returns when the communicator is gone.
fn watchdog(watch: Weak<Watch>) {
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let Some(w) = watch.upgrade() else { return };
        let since = w.since_ms.load(Ordering::Acquire);
        if since == 0 {
            continue;
        }
        let waited = (w.start.elapsed().as_millis() as u64 + 1).saturating_sub(since);
        if waited > w.timeout.as_millis() as u64 {
            let op = *w.op.lock().unwrap_or_else(|e| e.into_inner());
            eprintln!(
                "maxc: rank {}: {op} has waited {:.1} s for its peers (a rank died or hangs); \
                 ending this rank so that mpirun ends the job",
                w.rank,
                waited as f64 / 1e3
            );
            std::process::exit(75);
        }
    }
}

impl MpiComm {
    /// Whether this process was started by `mpirun` (Open MPI or another PMIx launcher).
    pub fn launched() -> bool {
        ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }

    /// Initializes MPI (once per process) and returns this process's rank of the world, whose
    /// collectives end the process after waiting `timeout` for their peers.
    pub fn init(timeout: Duration) -> Result<Self> {
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                RuntimeError::Collective("MPI is already initialized in this process".into())
            })?;
        if threading < Threading::Serialized {
            return Err(RuntimeError::Collective(format!(
                "this MPI gives thread support {threading:?}; maxc needs MPI_THREAD_SERIALIZED"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let watch = Arc::new(Watch {
            start: Instant::now(),
            since_ms: AtomicU64::new(0),
            op: Mutex::new(""),
            timeout,
            rank,
        });
        let weak = Arc::downgrade(&watch);
        std::thread::Builder::new()
            .name(format!("maxc-mpi-watchdog-{rank}"))
            .spawn(move || watchdog(weak))
            .map_err(|e| RuntimeError::Collective(format!("the MPI watchdog thread: {e}")))?;
        Ok(MpiComm {
            world,
            rank,
            size,
            watch,
            _universe: universe,
        })
    }

    /// [`MpiComm::init`] with [`DEFAULT_TIMEOUT`].
    pub fn init_default() -> Result<Self> {
        Self::init(DEFAULT_TIMEOUT)
    }

    /// The broadcast itself: the length, then the bytes.
    fn bcast(&self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self.rank, self.size, root)?;
        let at = self.world.process_at_rank(root as i32);
        let mut len = data.len() as u64;
        at.broadcast_into(&mut len);
        data.resize(len as usize, 0);
        // (An empty buffer's dangling pointer is an invalid argument to MPI_Bcast.)
        if len > 0 {
            at.broadcast_into(&mut data[..]);
        }
        Ok(())
    }

    fn counts(&self, op: &str, n: &[usize]) -> Result<Vec<Count>> {
        n.iter()
            .map(|&c| Count::try_from(c))
            .collect::<Result<_, _>>()
            .map_err(|_| error(self.rank, op, "a count above MPI's 2^31 - 1"))
    }
}

/// Offsets of consecutive segments of `counts`.
fn displacements(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        // Gathered and added in rank order on every rank: the same bits everywhere, and the
        // same as the local group's (MPI_Allreduce may associate differently by rank).
        let len = data.len();
        let mut all = vec![0f32; self.size * len];
        {
            let _in = self.watch.enter("all_reduce_sum");
            self.world.all_gather_into(&data[..], &mut all[..]);
        }
        super::sum_in_rank_order(&all, data);
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_gather(self.rank, self.size(), send.len(), recv.len())?;
        let _in = self.watch.enter("all_gather");
        self.world.all_gather_into(send, recv);
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
        check_all_to_all(self.rank, self.size, send, send_counts, recv_counts)?;
        let sc = self.counts(OP, send_counts)?;
        let mut rc = vec![0 as Count; self.size];
        let mut over = vec![0 as Count; self.size];
        {
            let _in = self.watch.enter(OP);
            self.world.all_to_all_into(&sc[..], &mut rc[..]);
            // Every rank learns whether any would overflow, so that all fail together rather
            // than some waiting in the exchange.
            let incoming: usize = rc.iter().map(|&c| c as usize).sum();
            let mine = Count::from(incoming > recv.len());
            self.world.all_gather_into(&mine, &mut over[..]);
        }
        if let Some(q) = over.iter().position(|&o| o != 0) {
            let m = if q == self.rank {
                format!(
                    "would receive {} values, above its buffer's {}",
                    rc.iter().map(|&c| c as usize).sum::<usize>(),
                    recv.len()
                )
            } else {
                format!("rank {q} would receive more than its buffer holds")
            };
            return Err(error(self.rank, OP, m));
        }
        let (sd, rd) = (displacements(&sc), displacements(&rc));
        let total: usize = send_counts.iter().sum();
        let incoming: usize = rc.iter().map(|&c| c as usize).sum();
        {
            let _in = self.watch.enter(OP);
            let s = Partition::new(&send[..total], &sc[..], &sd[..]);
            let mut r = PartitionMut::new(&mut recv[..incoming], &rc[..], &rd[..]);
            self.world.all_to_all_varcount_into(&s, &mut r);
        }
        for (out, &c) in recv_counts.iter_mut().zip(&rc) {
            *out = c as usize;
        }
        Ok(incoming)
    }

    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        let _in = self.watch.enter("broadcast");
        self.bcast(data, root)
    }

    fn broadcast_unbounded(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        // Not watched: an idle server's followers wait here for as long as it is idle.
        self.bcast(data, root)
    }

    fn barrier(&mut self) -> Result<()> {
        let _in = self.watch.enter("barrier");
        self.world.barrier();
        Ok(())
    }

    fn abort(&mut self, why: &str) {
        eprintln!("maxc: rank {} failed: {why}; ending the job", self.rank);
        self.world.abort(70)
    }
}
