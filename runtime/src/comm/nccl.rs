//! The communicator over NVIDIA's NCCL (cudarc's bindings, the library loaded at run time):
//! one rank per GPU, in this process ([`NcclComm::devices`], NCCL's `ncclCommInitAll`) or one per
//! process ([`NcclComm::from_rank`], the group's id passed from rank 0 by another channel, such
//! as an MPI broadcast).
//!
//! It answers the host-memory [`Communicator`] contract, staging each collective's values
//! through device buffers on the rank's stream, so that every check the other implementations
//! pass ([`super::self_check`]) runs on it unchanged; a sum is gathered and added in rank order
//! on the host, the same bits on every rank, as the others do. A CUDA executor's collectives
//! would run on its device buffers directly; that executor has no collective launches yet.
//!
//! Where there is no CUDA driver, no device or no NCCL library, making a group is an error that
//! says which (never a panic): that is what runs on machines without a GPU.

use super::{check_all_to_all, check_gather, check_root, error, Communicator};
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};
use std::sync::Arc;

/// One rank of an NCCL group, on its GPU's stream.
pub struct NcclComm {
    /// `None` once aborted.
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (NCCL forbids
// concurrent calls on one communicator, not moving it); `&mut self` on every collective
// serializes them, and the stream is `Send`.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("aborted", &self.comm.is_none())
            .finish()
    }
}

/// What NCCL needs here before a group can be made: the CUDA driver, `devices` GPUs, and the
/// NCCL library. Each missing piece is a `Target` error naming it.
pub fn available(devices: usize) -> Result<()> {
    crate::cuda::cuda_available()?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| RuntimeError::Target(format!("cannot count CUDA devices: {e}")))?;
    if (count as usize) < devices {
        return Err(RuntimeError::Target(format!(
            "an NCCL group of {devices} ranks needs {devices} GPUs (one per rank); the CUDA driver sees {count}"
        )));
    }
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(RuntimeError::Target(
            "the NCCL library (libnccl.so.2) is not found; install NCCL (the nvidia-nccl-cu12 wheel or the system's package) and put it on LD_LIBRARY_PATH".into(),
        ));
    }
    Ok(())
}

fn nccl(
    rank: usize,
    op: &str,
) -> impl FnOnce(cudarc::nccl::result::NcclError) -> RuntimeError + '_ {
    move |e| error(rank, op, format!("NCCL: {e:?}"))
}

fn cuda(rank: usize, op: &str) -> impl FnOnce(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| error(rank, op, format!("CUDA: {e}"))
}

impl NcclComm {
    /// A group of `n` ranks in this process, rank `i` on GPU `i`.
    pub fn devices(n: usize) -> Result<Vec<NcclComm>> {
        available(n)?;
        let streams = (0..n)
            .map(|i| {
                CudaContext::new(i)
                    .map(|c| c.default_stream())
                    .map_err(cuda(i, "init"))
            })
            .collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(nccl(0, "init"))?;
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| NcclComm {
                comm: Some(comm),
                stream,
                rank,
                size: n,
            })
            .collect())
    }

    /// A new group's id, made on rank 0 and passed to the others ([`NcclComm::from_rank`]).
    pub fn unique_id() -> Result<[u8; 128]> {
        available(1)?;
        let id = Id::new().map_err(nccl(0, "id"))?;
        Ok(id.internal().map(|c| c as u8))
    }

    /// Rank `rank` of `size` processes on GPU `device`, the group named by rank 0's `id`.
    pub fn from_rank(device: usize, rank: usize, size: usize, id: [u8; 128]) -> Result<Self> {
        available(device + 1)?;
        let stream = CudaContext::new(device)
            .map(|c| c.default_stream())
            .map_err(cuda(rank, "init"))?;
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, size, id).map_err(nccl(rank, "init"))?;
        Ok(NcclComm {
            comm: Some(comm),
            stream,
            rank,
            size,
        })
    }

    fn comm(&self, op: &str) -> Result<&Comm> {
        self.comm
            .as_ref()
            .ok_or_else(|| error(self.rank, op, "the group was aborted"))
    }

    fn upload<T: cudarc::driver::DeviceRepr>(&self, op: &str, v: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(cuda(self.rank, op))
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        op: &str,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(cuda(self.rank, op))
    }

    fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        op: &str,
        d: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        self.stream.clone_dtoh(d).map_err(cuda(self.rank, op))
    }

    /// Every rank's `values` (the same count on each), concatenated in rank order.
    fn gather<T>(&self, op: &str, values: &[T]) -> Result<Vec<T>>
    where
        T: cudarc::driver::DeviceRepr
            + cudarc::driver::ValidAsZeroBits
            + cudarc::nccl::NcclType
            + Default
            + Clone,
    {
        let send = self.upload(op, values)?;
        let mut recv = self.zeros::<T>(op, values.len() * self.size)?;
        self.comm(op)?
            .all_gather(&send, &mut recv)
            .map_err(nccl(self.rank, op))?;
        let mut all = self.download(op, &recv)?;
        all.truncate(values.len() * self.size);
        Ok(all)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        let all = self.gather("all_reduce_sum", data)?;
        super::sum_in_rank_order(&all, data);
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_gather(self.rank, self.size, send.len(), recv.len())?;
        let all = self.gather("all_gather", send)?;
        recv.copy_from_slice(&all);
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &mut [usize],
    ) -> Result<usize> {
        let (rank, size) = (self.rank, self.size);
        check_all_to_all(rank, size, send, send_counts, recv_counts)?;
        // Every rank learns every count, so a receive past a buffer fails on every rank alike,
        // before anything moves.
        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let all = self.gather("all_to_all_v", &counts)?;
        let into = |p: usize, r: usize| all[p * size + r] as usize;
        for r in 0..size {
            let total: usize = (0..size).map(|p| into(p, r)).sum();
            let cap = if r == rank { recv.len() } else { usize::MAX };
            if total > cap {
                return Err(error(
                    rank,
                    "all_to_all_v",
                    format!("{total} values arrive, above the {cap} the receive buffer holds"),
                ));
            }
        }
        let op = "all_to_all_v";
        let d_send = self.upload(op, &send[..send_counts.iter().sum::<usize>()])?;
        let received: usize = (0..size).map(|p| into(p, rank)).sum();
        let mut d_recv = self.zeros::<f32>(op, received)?;
        let comm = self.comm(op)?;
        cudarc::nccl::group_start().map_err(nccl(rank, op))?;
        let (mut s_at, mut r_at) = (0, 0);
        for (p, &s) in send_counts.iter().enumerate() {
            let r = into(p, rank);
            if s > 0 {
                comm.send(&d_send.slice(s_at..s_at + s), p as i32)
                    .map_err(nccl(rank, op))?;
            }
            if r > 0 {
                comm.recv(&mut d_recv.slice_mut(r_at..r_at + r), p as i32)
                    .map_err(nccl(rank, op))?;
            }
            s_at += s;
            r_at += r;
        }
        cudarc::nccl::group_end().map_err(nccl(rank, op))?;
        let got = self.download(op, &d_recv)?;
        recv[..received].copy_from_slice(&got[..received]);
        for (p, c) in recv_counts.iter_mut().enumerate() {
            *c = into(p, rank);
        }
        Ok(received)
    }

    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self.rank, self.size, root)?;
        let op = "broadcast";
        // The length first, then the bytes.
        let mut len = self.upload(op, &[data.len() as u64])?;
        self.comm(op)?
            .broadcast_in_place(&mut len, root as i32)
            .map_err(nccl(self.rank, op))?;
        let n = self.download(op, &len)?[0] as usize;
        let mut bytes = if self.rank == root {
            self.upload(op, data.as_slice())?
        } else {
            self.zeros::<u8>(op, n)?
        };
        if n > 0 {
            self.comm(op)?
                .broadcast_in_place(&mut bytes, root as i32)
                .map_err(nccl(self.rank, op))?;
        }
        let mut got = self.download(op, &bytes)?;
        got.truncate(n);
        *data = got;
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.gather("barrier", &[0u8]).map(|_| ())
    }

    fn abort(&mut self, why: &str) {
        tracing::error!("rank {}: aborting its NCCL group: {why}", self.rank);
        // Dropping the communicator aborts it (`ncclCommAbort`): peers waiting fail.
        self.comm = None;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_gpu_making_a_group_is_an_error_naming_what_is_missing() {
        match super::NcclComm::devices(1) {
            // Where a GPU and NCCL are here, the group runs the common check.
            Ok(mut comms) => {
                let line = crate::comm::self_check(&mut comms[0]).expect("NCCL self check");
                assert!(line.contains("agree"), "{line}");
                eprintln!("NCCL on GPU 0: {line}");
            }
            Err(e) => {
                let e = e.to_string();
                eprintln!("no NCCL group here: {e}");
                assert!(
                    e.contains("CUDA") || e.contains("NCCL") || e.contains("GPU"),
                    "{e}"
                );
            }
        }
    }
}
