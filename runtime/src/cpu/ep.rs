//! Expert parallelism on the CPU: `degree` ranks in one process, each holding
//! `experts / degree` consecutive experts, exchanging token slots through the buffers that the
//! artifact's `ep_init` program allocated and initialised once, at load, on each rank (see
//! `runtime/docs/expert-parallelism.md`).
//!
//! The exchange is one interface, [`Exchange`]: the ranks this process holds, and an
//! all-to-all of each buffer group. [`InProcessExchange`] holds every rank and moves slots with
//! copies; a GPU implementation (NCCL's grouped send/receive, or NVSHMEM puts into the peers'
//! symmetric buffers) holds one rank per process and moves the same segments (the plan is in
//! the doc). [`moe_layer`] is written against the interface alone.
//!
//! A step's token rows are split evenly over the ranks (rank `r` owns a contiguous share). Per
//! MoE layer: each rank packs its tokens' slots into `dispatch_send`, grouped by destination
//! rank (counts in `dispatch_counts`); **dispatch** moves each segment into its destination's
//! `dispatch_recv`; each rank runs its received slots grouped by expert (every expert's
//! weights read once) into `combine_send`; **combine** moves the results back, in the
//! sender's order, into its `combine_recv`; each rank adds its tokens' results weighted, in
//! expert order (the same sums in the same order as one rank). A count above
//! `max_tokens_per_rank` fails the step before anything is written past a buffer.

use crate::artifact::Artifact;
use crate::error::{Result, RuntimeError};
use crate::schema::ep_init as names;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The `ep_init` program's outputs: name to (address, bytes) in the memory of the executor
/// that ran it.
pub type InitOutputs = BTreeMap<String, (*mut u8, usize)>;

/// The deployment the artifact records (`ep.degree`, `ep.max_tokens_per_rank`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpPlan {
    /// Ranks.
    pub degree: usize,
    /// Experts per rank.
    pub experts_per_rank: usize,
    /// Slots one rank may receive in a step (the worst case).
    pub max_tokens_per_rank: usize,
    /// Hidden size (a slot's width).
    pub hidden: usize,
    /// Shared experts, replicated on every rank (`moe.num_shared_experts`; 0 without).
    pub shared_experts: usize,
}

impl EpPlan {
    /// The plan of an artifact's records; `None` without expert parallelism (degree 1 or no
    /// records). A record of the wrong type is an error naming it.
    pub fn from_records(records: &BTreeMap<String, serde_json::Value>) -> Result<Option<Self>> {
        let Some(d) = records.get("ep.degree") else {
            return Ok(None);
        };
        // Experts spread over tensor-parallel ranks join in their all-reduce: no exchange.
        if records.get("ep.over").and_then(serde_json::Value::as_str)
            == Some("tensor-parallel ranks")
        {
            return Ok(None);
        }
        let num = |k: &str| -> Result<usize> {
            records
                .get(k)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    RuntimeError::Input(format!(
                        "the artifact's export record `{k}` is missing or not a whole number"
                    ))
                })
        };
        let degree = d.as_u64().map(|v| v as usize).ok_or_else(|| {
            RuntimeError::Input(
                "the artifact's export record `ep.degree` is not a whole number".into(),
            )
        })?;
        if degree <= 1 {
            return Ok(None);
        }
        Ok(Some(EpPlan {
            degree,
            experts_per_rank: num("ep.experts_per_rank")?,
            max_tokens_per_rank: num("ep.max_tokens_per_rank")?,
            hidden: num("moe.hidden_size")?,
            shared_experts: match records.get("moe.num_shared_experts") {
                None => 0,
                Some(_) => num("moe.num_shared_experts")?,
            },
        }))
    }

    /// f32 values of one slot: the hidden state, its token row and expert (u32 bits), its
    /// routing weight.
    pub fn slot_floats(&self) -> usize {
        self.hidden + 3
    }
}

/// One of the two buffer groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// Token slots to the ranks of their experts.
    Dispatch,
    /// Expert outputs back to the slots' ranks.
    Combine,
}

/// Where a rank's exchange memory comes from.
#[allow(dead_code)] // each variant is held for the memory it owns, never read
enum Memory {
    /// The arena of the executor that ran the `ep_init` program for this rank.
    Program(Box<dyn std::any::Any + Send>),
    /// Host memory of the same layout (unit tests of the exchange without an artifact).
    #[cfg(test)]
    Host(Vec<Vec<u32>>),
}

/// One rank's exchange state: the `ep_init` program's outputs.
pub struct RankState {
    rank: usize,
    _memory: Memory,
    /// Address and elements (4-byte) of each output, in [`names::OUTPUTS`] order.
    bufs: [(*mut u8, usize); 7],
    send_slots: usize,
}

// SAFETY: the pointers point into memory this state owns (`_memory`), which nothing else
// references; `&mut self` serializes access.
unsafe impl Send for RankState {}

impl std::fmt::Debug for RankState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankState")
            .field("rank", &self.rank)
            .field("send_slots", &self.send_slots)
            .finish_non_exhaustive()
    }
}

/// A rank's buffers, borrowed at once (they never overlap).
pub struct RankBuffers<'a> {
    /// `[send_slots, hidden + 3]`: the rank's slots, grouped by destination.
    pub dispatch_send: &'a mut [f32],
    /// `[max_tokens_per_rank, hidden + 3]`: the slots it received, grouped by source.
    pub dispatch_recv: &'a mut [f32],
    /// `[2, degree]`: slots sent to each peer, then received from each.
    pub dispatch_counts: &'a mut [i32],
    /// `[max_tokens_per_rank, hidden]`: expert outputs of the received slots.
    pub combine_send: &'a mut [f32],
    /// `[send_slots, hidden]`: expert outputs of its own slots, in its send order.
    pub combine_recv: &'a mut [f32],
    /// `[2, degree]`: results sent to each peer, then received from each.
    pub combine_counts: &'a mut [i32],
    /// The experts the rank holds.
    pub local_experts: &'a [i32],
}

/// One buffer group of a rank: what it sends, what it receives, and the counts.
pub struct GroupBuffers<'a> {
    /// The rows it sends, grouped by peer.
    pub send: &'a mut [f32],
    /// The rows it received, grouped by source.
    pub recv: &'a mut [f32],
    /// `[2, degree]`: rows sent to each peer, then received from each.
    pub counts: &'a mut [i32],
}

impl<'a> RankBuffers<'a> {
    /// The buffers of `group`.
    pub fn group(self, group: Group) -> GroupBuffers<'a> {
        match group {
            Group::Dispatch => GroupBuffers {
                send: self.dispatch_send,
                recv: self.dispatch_recv,
                counts: self.dispatch_counts,
            },
            Group::Combine => GroupBuffers {
                send: self.combine_send,
                recv: self.combine_recv,
                counts: self.combine_counts,
            },
        }
    }
}

impl RankState {
    /// Rank `rank`'s state from the `ep_init` program's outputs `outs` (address and bytes by
    /// name), checked against `plan`; `memory` owns them.
    fn new(plan: &EpPlan, rank: usize, memory: Memory, outs: &InitOutputs) -> Result<Self> {
        let (d, width, recv) = (plan.degree, plan.slot_floats(), plan.max_tokens_per_rank);
        let mut bufs = [(std::ptr::null_mut(), 0); 7];
        for (i, name) in names::OUTPUTS.iter().enumerate() {
            let &(ptr, bytes) = outs.get(*name).ok_or_else(|| {
                RuntimeError::Input(format!("the ep_init program has no output `{name}`"))
            })?;
            bufs[i] = (ptr, bytes / 4);
        }
        let elems =
            |name: &str| bufs[names::OUTPUTS.iter().position(|n| *n == name).unwrap_or(0)].1;
        let send_slots = elems(names::DISPATCH_SEND) / width;
        let want = [
            (names::DISPATCH_SEND, send_slots * width),
            (names::DISPATCH_RECV, recv * width),
            (names::DISPATCH_COUNTS, 2 * d),
            (names::COMBINE_SEND, recv * plan.hidden),
            (names::COMBINE_RECV, send_slots * plan.hidden),
            (names::COMBINE_COUNTS, 2 * d),
            (names::LOCAL_EXPERTS, plan.experts_per_rank),
        ];
        for (name, n) in want {
            if elems(name) != n || (name == names::DISPATCH_SEND && send_slots == 0) {
                return Err(RuntimeError::Input(format!(
                    "the ep_init program's `{name}` holds {} values; the records (degree {d}, {} experts per rank, max_tokens_per_rank {recv}, hidden {}) need {n}",
                    elems(name),
                    plan.experts_per_rank,
                    plan.hidden
                )));
            }
        }
        // Shared experts are replicated: every rank holds all of them.
        match (outs.get(names::SHARED_EXPERTS), plan.shared_experts) {
            (None, 0) => {}
            (Some(&(ptr, bytes)), n) if bytes == 4 * n => {
                // SAFETY: the output holds `bytes / 4` i32 values.
                let held = unsafe { std::slice::from_raw_parts(ptr.cast::<i32>(), n) };
                if !held.iter().enumerate().all(|(i, &e)| e == i as i32) {
                    return Err(RuntimeError::Input(format!(
                        "the ep_init program's `{}` on rank {rank} is {held:?}; shared experts are replicated, expected 0..{n}",
                        names::SHARED_EXPERTS
                    )));
                }
            }
            (got, n) => {
                return Err(RuntimeError::Input(format!(
                "the ep_init program's `{}` holds {} values; the records say {n} shared experts",
                names::SHARED_EXPERTS,
                got.map_or(0, |g| g.1 / 4)
            )))
            }
        }
        Ok(RankState {
            rank,
            _memory: memory,
            bufs,
            send_slots,
        })
    }

    /// The rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Slots the rank can send in one layer.
    pub fn send_slots(&self) -> usize {
        self.send_slots
    }

    /// Every buffer, borrowed at once.
    pub fn buffers(&mut self) -> RankBuffers<'_> {
        let [cc, cr, cs, dc, dr, ds, le] = self.bufs;
        // SAFETY: each pointer addresses its own output of `len` 4-byte values, aligned (arena
        // offsets are 64-byte aligned), owned by `_memory`; outputs never share bytes (the
        // program's validation), and `&mut self` makes these the only borrows.
        unsafe {
            RankBuffers {
                dispatch_send: std::slice::from_raw_parts_mut(ds.0.cast(), ds.1),
                dispatch_recv: std::slice::from_raw_parts_mut(dr.0.cast(), dr.1),
                dispatch_counts: std::slice::from_raw_parts_mut(dc.0.cast(), dc.1),
                combine_send: std::slice::from_raw_parts_mut(cs.0.cast(), cs.1),
                combine_recv: std::slice::from_raw_parts_mut(cr.0.cast(), cr.1),
                combine_counts: std::slice::from_raw_parts_mut(cc.0.cast(), cc.1),
                local_experts: std::slice::from_raw_parts(le.0.cast(), le.1),
            }
        }
    }

    /// The same buffers in host memory, laid out as the `ep_init` program lays them out.
    #[cfg(test)]
    fn host(plan: &EpPlan, rank: usize, send_slots: usize) -> Self {
        let (d, w, recv) = (plan.degree, plan.slot_floats(), plan.max_tokens_per_rank);
        let sizes = [
            2 * d,
            send_slots * plan.hidden,
            recv * plan.hidden,
            2 * d,
            recv * w,
            send_slots * w,
            plan.experts_per_rank,
        ];
        let mut vecs: Vec<Vec<u32>> = sizes.iter().map(|&n| vec![0u32; n]).collect();
        for (i, e) in vecs[6].iter_mut().enumerate() {
            *e = (rank * plan.experts_per_rank + i) as u32;
        }
        let outs: BTreeMap<String, (*mut u8, usize)> = names::OUTPUTS
            .iter()
            .zip(vecs.iter_mut())
            .map(|(n, v)| (n.to_string(), (v.as_mut_ptr().cast::<u8>(), v.len() * 4)))
            .collect();
        // Moving the Vecs into `Memory` keeps their heap buffers where they are.
        RankState::new(plan, rank, Memory::Host(vecs), &outs).expect("host layout")
    }
}

/// The exchange between expert-parallel ranks: the ranks this process holds, and an
/// all-to-all of a buffer group.
pub trait Exchange: Send + std::fmt::Debug {
    /// The deployment.
    fn plan(&self) -> &EpPlan;
    /// The ranks this process holds (every rank in process; one per process across GPUs).
    fn local_ranks(&mut self) -> &mut [RankState];
    /// Moves every rank's send segments of `group` (sizes in row 0 of the group's counts, in
    /// peer order) to its peers' receive buffers, concatenated in source order, and records
    /// each rank's received counts (row 1). A receive above its buffer's bound is an error and
    /// moves nothing.
    fn all_to_all(&mut self, group: Group) -> Result<()>;
    /// After the combine, each local rank has written its own share of the step's rows of
    /// `out` (`rows × hidden`; rank `r`'s share is [`owned_rows`]); this makes every row whole
    /// in every process. Holding every rank, there is nothing to move.
    fn gather_rows(&mut self, _out: &mut [f32], _rows: usize, _hidden: usize) -> Result<()> {
        Ok(())
    }
}

/// The rows of a step's `rows` that rank `rank` of `degree` owns: dispatches and combines.
pub fn owned_rows(rank: usize, degree: usize, rows: usize) -> std::ops::Range<usize> {
    rank * rows / degree..(rank + 1) * rows / degree
}

/// Rank `rank`'s exchange state: `run_init` runs the artifact's `ep_init` program once with
/// the rank's index as `ep_rank`, returning the executor that ran it (whose memory the outputs
/// live in) with its outputs. The experts it gives the rank are checked against the plan.
pub fn rank_state(
    artifact: &Arc<Artifact>,
    plan: &EpPlan,
    rank: usize,
    run_init: &mut dyn FnMut(usize) -> Result<(Box<dyn std::any::Any + Send>, InitOutputs)>,
) -> Result<RankState> {
    if !artifact.programs.contains_key(names::ROLE) {
        return Err(RuntimeError::artifact(
            &artifact.dir,
            format!(
                "the export records say expert-parallel degree {}, but the artifact has no {} program to set up the exchange; recompile it",
                plan.degree,
                names::ROLE
            ),
        ));
    }
    let (memory, outs) = run_init(rank)?;
    let mut state = RankState::new(plan, rank, Memory::Program(memory), &outs)?;
    let want: Vec<i32> = (0..plan.experts_per_rank)
        .map(|i| (rank * plan.experts_per_rank + i) as i32)
        .collect();
    let got = state.buffers().local_experts;
    if got != want.as_slice() {
        return Err(RuntimeError::artifact(
            &artifact.dir,
            format!("the ep_init program gives rank {rank} experts {got:?}, expected {want:?}"),
        ));
    }
    Ok(state)
}

/// One rank per process: the rank's segments move through the group's communicator
/// (`all_to_all_v`, then an all-gather of the combined rows), its peers being the other
/// processes (`mpirun`), each running the same program on the same broadcast step.
#[derive(Debug)]
pub struct CommExchange<'a> {
    plan: EpPlan,
    rank: &'a mut RankState,
    comm: &'a mut dyn crate::comm::Communicator,
}

impl<'a> CommExchange<'a> {
    /// Rank `rank.rank()` of `plan`, exchanging over `comm`, whose ranks must be the plan's.
    pub fn new(
        plan: EpPlan,
        rank: &'a mut RankState,
        comm: &'a mut dyn crate::comm::Communicator,
    ) -> Result<Self> {
        if comm.size() != plan.degree || comm.rank() != rank.rank {
            return Err(RuntimeError::Input(format!(
                "expert parallelism: rank {} of degree {} cannot exchange as rank {} of a group of {}",
                rank.rank,
                plan.degree,
                comm.rank(),
                comm.size()
            )));
        }
        Ok(CommExchange { plan, rank, comm })
    }
}

impl Exchange for CommExchange<'_> {
    fn plan(&self) -> &EpPlan {
        &self.plan
    }

    fn local_ranks(&mut self) -> &mut [RankState] {
        std::slice::from_mut(self.rank)
    }

    fn all_to_all(&mut self, group: Group) -> Result<()> {
        let d = self.plan.degree;
        let width = match group {
            Group::Dispatch => self.plan.slot_floats(),
            Group::Combine => self.plan.hidden,
        };
        let g = self.rank.buffers().group(group);
        let send_counts: Vec<usize> = g.counts[..d]
            .iter()
            .map(|&c| c.max(0) as usize * width)
            .collect();
        let mut recv_counts = vec![0usize; d];
        self.comm
            .all_to_all_v(g.send, &send_counts, g.recv, &mut recv_counts)?;
        for (c, n) in g.counts[d..2 * d].iter_mut().zip(&recv_counts) {
            *c = (n / width) as i32;
        }
        Ok(())
    }

    fn gather_rows(&mut self, out: &mut [f32], rows: usize, hidden: usize) -> Result<()> {
        let d = self.plan.degree;
        // Every share padded to the largest, so that the gather's pieces are equal.
        let share = rows.div_ceil(d) * hidden;
        let own = owned_rows(self.rank.rank, d, rows);
        let mut send = vec![0.0f32; share];
        send[..own.len() * hidden].copy_from_slice(&out[own.start * hidden..own.end * hidden]);
        let mut all = vec![0.0f32; d * share];
        self.comm.all_gather(&send, &mut all)?;
        for r in 0..d {
            let rs = owned_rows(r, d, rows);
            out[rs.start * hidden..rs.end * hidden]
                .copy_from_slice(&all[r * share..r * share + rs.len() * hidden]);
        }
        Ok(())
    }
}

/// Every rank in this process; segments move by copies.
#[derive(Debug)]
pub struct InProcessExchange {
    plan: EpPlan,
    ranks: Vec<RankState>,
}

impl InProcessExchange {
    /// The exchange of `artifact`: `run_init(r)` runs its `ep_init` program once for rank `r`
    /// (the rank's index as `ep_rank`) and returns the executor that ran it (whose memory the
    /// outputs live in) with its outputs, which become that rank's state.
    pub fn from_artifact(
        artifact: &Arc<Artifact>,
        plan: EpPlan,
        run_init: &mut dyn FnMut(usize) -> Result<(Box<dyn std::any::Any + Send>, InitOutputs)>,
    ) -> Result<Self> {
        let ranks = (0..plan.degree)
            .map(|r| rank_state(artifact, &plan, r, run_init))
            .collect::<Result<Vec<_>>>()?;
        Ok(InProcessExchange { plan, ranks })
    }

    /// The exchange over host buffers of the `ep_init` layout, each rank sending up to
    /// `send_slots` slots.
    #[cfg(test)]
    fn host(plan: EpPlan, send_slots: usize) -> Self {
        let ranks = (0..plan.degree)
            .map(|r| RankState::host(&plan, r, send_slots))
            .collect();
        InProcessExchange { plan, ranks }
    }
}

impl Exchange for InProcessExchange {
    fn plan(&self) -> &EpPlan {
        &self.plan
    }

    fn local_ranks(&mut self) -> &mut [RankState] {
        &mut self.ranks
    }

    fn all_to_all(&mut self, group: Group) -> Result<()> {
        let d = self.plan.degree;
        let (width, capacity) = match group {
            Group::Dispatch => (self.plan.slot_floats(), self.plan.max_tokens_per_rank),
            Group::Combine => (self.plan.hidden, self.ranks[0].send_slots),
        };
        // sent[s][p]: rows rank s sends to peer p.
        let sent: Vec<Vec<usize>> = self
            .ranks
            .iter_mut()
            .map(|r| {
                let g = r.buffers().group(group);
                g.counts[..d].iter().map(|&c| c.max(0) as usize).collect()
            })
            .collect();
        for p in 0..d {
            let total: usize = sent.iter().map(|row| row[p]).sum();
            if total > capacity {
                return Err(RuntimeError::Input(format!(
                    "expert parallelism: rank {p} would receive {total} {group:?} rows, above its buffer's {capacity} (max_tokens_per_rank for dispatch)"
                )));
            }
        }
        // Peer p's receive buffer: every source's segment for p, in source order.
        let mut at = vec![0usize; d];
        for (s, row) in sent.iter().enumerate() {
            let mut offset = 0;
            for (p, &n) in row.iter().enumerate() {
                let rows = self.ranks[s].buffers().group(group).send
                    [offset * width..(offset + n) * width]
                    .to_vec();
                let g = self.ranks[p].buffers().group(group);
                g.recv[at[p] * width..(at[p] + n) * width].copy_from_slice(&rows);
                g.counts[d + s] = n as i32;
                at[p] += n;
                offset += n;
            }
        }
        Ok(())
    }
}

/// One MoE layer over the exchange: SwiGLU experts (`experts[e] = (gate, up, down)`) weighted
/// by the dense `routing` (`rows × experts`). Returns the most slots any rank received.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer(
    ex: &mut dyn Exchange,
    x: &[f32],
    routing: &[f32],
    experts: &[(&[f32], &[f32], &[f32])],
    out: &mut [f32],
    rows: usize,
    hidden: usize,
    ffn: usize,
) -> Result<usize> {
    let plan = *ex.plan();
    let (d, per, w) = (plan.degree, plan.experts_per_rank, plan.slot_floats());
    let e_count = experts.len();
    if hidden != plan.hidden || per * d != e_count {
        return Err(RuntimeError::Input(format!(
            "expert parallelism: the kernel has {e_count} experts of width {hidden}; the records say {d} ranks × {per} experts of width {}",
            plan.hidden
        )));
    }
    // Pack: each rank's tokens' slots, grouped by destination rank, tokens in order and each
    // token's experts in order within a group.
    for rank in ex.local_ranks() {
        let r = rank.rank;
        let cap = rank.send_slots;
        let b = rank.buffers();
        let owned = owned_rows(r, d, rows);
        let mut count = vec![0usize; d];
        for t in owned.clone() {
            for e in 0..e_count {
                if routing[t * e_count + e] != 0.0 {
                    count[e / per] += 1;
                }
            }
        }
        let total: usize = count.iter().sum();
        if total > cap {
            return Err(RuntimeError::Input(format!(
                "expert parallelism: rank {r} has {total} slots to send, above its buffer's {cap}"
            )));
        }
        let mut next: Vec<usize> = count
            .iter()
            .scan(0, |acc, &c| {
                let start = *acc;
                *acc += c;
                Some(start)
            })
            .collect();
        for t in owned {
            for e in 0..e_count {
                let weight = routing[t * e_count + e];
                if weight == 0.0 {
                    continue;
                }
                let slot = &mut b.dispatch_send[next[e / per] * w..][..w];
                slot[..hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
                slot[hidden] = f32::from_bits(t as u32);
                slot[hidden + 1] = f32::from_bits(e as u32);
                slot[hidden + 2] = weight;
                next[e / per] += 1;
            }
        }
        for (c, n) in b.dispatch_counts[..d].iter_mut().zip(&count) {
            *c = *n as i32;
        }
    }
    ex.all_to_all(Group::Dispatch)?;
    // Each rank: its received slots grouped by expert, every expert's weights read once; the
    // results go back to each source, in its order.
    let mut peak = 0;
    for rank in ex.local_ranks() {
        let b = rank.buffers();
        let received: usize = b.dispatch_counts[d..2 * d]
            .iter()
            .map(|&c| c as usize)
            .sum();
        peak = peak.max(received);
        for &e in b.local_experts {
            let e = e as usize;
            let picked: Vec<usize> = (0..received)
                .filter(|&s| b.dispatch_recv[s * w + hidden + 1].to_bits() as usize == e)
                .collect();
            if picked.is_empty() {
                continue;
            }
            let m = picked.len();
            let mut xs = Vec::with_capacity(m * hidden);
            for &s in &picked {
                xs.extend_from_slice(&b.dispatch_recv[s * w..s * w + hidden]);
            }
            let (gate, up, down) = experts[e];
            let y = maxc_kernels::moe::swiglu_expert(&xs, gate, up, down, m, hidden, ffn);
            for (i, &s) in picked.iter().enumerate() {
                b.combine_send[s * hidden..(s + 1) * hidden]
                    .copy_from_slice(&y[i * hidden..(i + 1) * hidden]);
            }
        }
        let (sent_back, received_from) = b.combine_counts.split_at_mut(d);
        sent_back.copy_from_slice(&b.dispatch_counts[d..2 * d]);
        received_from.fill(0);
    }
    ex.all_to_all(Group::Combine)?;
    // Combine: each token adds its results weighted, in expert order (its slots' send order).
    out[..rows * hidden].fill(0.0);
    for rank in ex.local_ranks() {
        let b = rank.buffers();
        let sent: usize = b.dispatch_counts[..d].iter().map(|&c| c as usize).sum();
        let mut order: Vec<usize> = (0..sent).collect();
        // Send order is (destination, token, expert); a token's experts ascend with their
        // destination, so sorting by (token, expert) keeps one rank's order of sums.
        order.sort_by_key(|&i| {
            let slot = &b.dispatch_send[i * w..];
            (slot[hidden].to_bits(), slot[hidden + 1].to_bits())
        });
        for i in order {
            let slot = &b.dispatch_send[i * w..(i + 1) * w];
            let t = slot[hidden].to_bits() as usize;
            let weight = slot[hidden + 2];
            for (o, v) in out[t * hidden..(t + 1) * hidden]
                .iter_mut()
                .zip(&b.combine_recv[i * hidden..(i + 1) * hidden])
            {
                *o += weight * v;
            }
        }
    }
    ex.gather_rows(out, rows, hidden)?;
    Ok(peak)
}

#[cfg(test)]
mod tests {
    use super::{moe_layer, EpPlan, InProcessExchange};

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    struct Layer {
        weights: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    }

    impl Layer {
        fn new(experts: usize, hidden: usize, ffn: usize) -> Self {
            let weights = (0..experts as u64)
                .map(|e| {
                    (
                        values(ffn * hidden, 3 * e + 1),
                        values(ffn * hidden, 3 * e + 2),
                        values(hidden * ffn, 3 * e + 3),
                    )
                })
                .collect();
            Layer { weights }
        }
        fn refs(&self) -> Vec<(&[f32], &[f32], &[f32])> {
            self.weights
                .iter()
                .map(|(g, u, d)| (&g[..], &u[..], &d[..]))
                .collect()
        }
    }

    /// A crafted router that sends every token to experts 0 and 1: the worst case for the
    /// rank(s) holding them, which must receive exactly the bound and no more.
    #[test]
    fn a_router_sending_every_token_to_one_rank_fills_it_exactly_to_the_bound() {
        let (experts, hidden, ffn, rows, top_k) = (4, 8, 6, 5, 2);
        let layer = Layer::new(experts, hidden, ffn);
        let x = values(rows * hidden, 99);
        let mut routing = vec![0.0f32; rows * experts];
        for t in 0..rows {
            routing[t * experts] = 0.6;
            routing[t * experts + 1] = 0.4;
        }
        let mut want = vec![0.0; rows * hidden];
        maxc_kernels::moe::moe_experts(&x, &routing, &layer.refs(), &mut want, rows, hidden, ffn);
        for degree in [2usize, 4] {
            let per = experts / degree;
            // The records' bound at these settings (max_batch_active_tokens = rows).
            let bound = rows * top_k.min(per);
            let plan = EpPlan {
                degree,
                experts_per_rank: per,
                max_tokens_per_rank: bound,
                hidden,
                shared_experts: 0,
            };
            let mut ex = InProcessExchange::host(plan, rows * top_k);
            let mut got = vec![0.0; rows * hidden];
            let peak = moe_layer(
                &mut ex,
                &x,
                &routing,
                &layer.refs(),
                &mut got,
                rows,
                hidden,
                ffn,
            )
            .unwrap();
            assert_eq!(peak, bound, "degree {degree}: one rank at the bound");
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(d < 1e-5, "degree {degree}: max |diff| {d} against one rank");
            // One slot less room: the step fails cleanly instead of writing past the buffer.
            let mut small = InProcessExchange::host(
                EpPlan {
                    max_tokens_per_rank: bound - 1,
                    ..plan
                },
                rows * top_k,
            );
            let e = moe_layer(
                &mut small,
                &x,
                &routing,
                &layer.refs(),
                &mut got,
                rows,
                hidden,
                ffn,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("max_tokens_per_rank"), "{e}");
        }
    }

    #[test]
    fn spread_routing_matches_one_rank() {
        let (experts, hidden, ffn, rows) = (4, 16, 12, 9);
        let layer = Layer::new(experts, hidden, ffn);
        let x = values(rows * hidden, 7);
        let mut routing = vec![0.0f32; rows * experts];
        for t in 0..rows {
            routing[t * experts + t % experts] = 0.7;
            routing[t * experts + (t * 3 + 1) % experts] += 0.3;
        }
        let mut want = vec![0.0; rows * hidden];
        maxc_kernels::moe::moe_experts(&x, &routing, &layer.refs(), &mut want, rows, hidden, ffn);
        for degree in [1usize, 2, 4] {
            let mut ex = InProcessExchange::host(
                EpPlan {
                    degree,
                    experts_per_rank: experts / degree,
                    max_tokens_per_rank: rows * 2,
                    hidden,
                    shared_experts: 0,
                },
                rows * 2,
            );
            let mut got = vec![0.0; rows * hidden];
            moe_layer(
                &mut ex,
                &x,
                &routing,
                &layer.refs(),
                &mut got,
                rows,
                hidden,
                ffn,
            )
            .unwrap();
            assert_eq!(
                got, want,
                "degree {degree}: the same sums in the same order"
            );
        }
    }
}
