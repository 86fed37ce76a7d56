//! The expert-parallel init graph (`GraphRole::EpInit`): what one rank allocates and
//! initialises once, at load, for the exchange of a mixture-of-experts model's token slots.
//!
//! Its input is the rank's index (`ep_rank`, i32 `[1]`); its outputs are the rank's exchange
//! state at the bounds (names in [`maxc_schema::ep_init`]): the dispatch group
//! (`dispatch_send`, `dispatch_recv`, `dispatch_counts`) and the combine group
//! (`combine_send`, `combine_recv`, `combine_counts`), two groups so that dispatch and combine
//! never share a buffer in flight, each zeroed, and `local_experts`, the experts the rank
//! holds. Every size comes from the deployment: `max_batch_active_tokens` (`T`), `top_k`, the
//! degree `N` and the experts `E`:
//!
//! | output | shape |
//! |---|---|
//! | `dispatch_send` | `[T × top_k, hidden + 3]` f32 |
//! | `dispatch_recv` | `[max_tokens_per_rank, hidden + 3]` f32 |
//! | `combine_send` | `[max_tokens_per_rank, hidden]` f32 |
//! | `combine_recv` | `[T × top_k, hidden]` f32 |
//! | `dispatch_counts`, `combine_counts` | `[2, N]` i32 (sent to, received from each peer) |
//! | `local_experts` | `[E / N]` i32 |
//! | `shared_experts` (with shared experts only) | `[S]` i32: `0..S`, every rank |
//!
//! with `max_tokens_per_rank = T × min(top_k, E / N)`: every active token's slots routed to
//! one rank, a token's experts being distinct.

use crate::ir::{Dim, GraphBuilder, Op, TensorType};
use crate::{DType, Graph, GraphRole, ModuleRuntime, Result};
use maxc_schema::ep_init as names;

/// The exchange of one expert-parallel deployment: its sizes, from the model and the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpExchange {
    /// Ranks.
    pub degree: usize,
    /// Experts of each MoE layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Model width (a slot's hidden state).
    pub hidden: usize,
    /// Active tokens in one step, all replicas together (`max_batch_active_tokens`).
    pub max_active_tokens: usize,
    /// Shared experts, replicated on every rank (DeepSeek's; 0 for Mixtral's).
    pub shared_experts: usize,
}

impl EpExchange {
    /// The exchange of a model with `num_experts` experts, `top_k` of them per token, of width
    /// `hidden`, deployed as `runtime` says.
    pub fn new(num_experts: usize, top_k: usize, hidden: usize, runtime: &ModuleRuntime) -> Self {
        EpExchange {
            degree: runtime.expert_parallel_degree.max(1),
            num_experts,
            top_k,
            hidden,
            max_active_tokens: runtime.batch.max_batch_active_tokens(),
            shared_experts: 0,
        }
    }

    /// The exchange of a model that also has `n` shared experts.
    pub fn with_shared(self, n: usize) -> Self {
        EpExchange {
            shared_experts: n,
            ..self
        }
    }

    /// Experts each rank holds.
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.degree
    }

    /// Slots one rank sends in a layer at most: every slot of every active token.
    pub fn send_slots(&self) -> usize {
        self.max_active_tokens * self.top_k
    }

    /// Slots one rank may receive in a layer: the worst case (see the module docs).
    pub fn max_tokens_per_rank(&self) -> usize {
        self.max_active_tokens * self.top_k.min(self.experts_per_rank())
    }

    /// f32 values of one dispatched slot: the hidden state, its token row, its expert and its
    /// routing weight.
    pub fn slot_floats(&self) -> usize {
        self.hidden + 3
    }

    /// The `ep_init` graph.
    pub fn graph(&self) -> Result<Graph> {
        let mut g = GraphBuilder::new(GraphRole::EpInit);
        let rank = g.input(
            names::RANK_INPUT,
            TensorType::new(DType::I32, [Dim::Fixed(1)]),
        )?;
        let (send, recv, width) = (
            self.send_slots(),
            self.max_tokens_per_rank(),
            self.slot_floats(),
        );
        let buffers: [(&str, DType, [usize; 2]); 6] = [
            (names::DISPATCH_SEND, DType::F32, [send, width]),
            (names::DISPATCH_RECV, DType::F32, [recv, width]),
            (names::DISPATCH_COUNTS, DType::I32, [2, self.degree]),
            (names::COMBINE_SEND, DType::F32, [recv, self.hidden]),
            (names::COMBINE_RECV, DType::F32, [send, self.hidden]),
            (names::COMBINE_COUNTS, DType::I32, [2, self.degree]),
        ];
        for (name, dtype, shape) in buffers {
            let shape = shape.iter().map(|&n| Dim::Fixed(n)).collect();
            let id = g.op(name, Op::Zeros { dtype, shape }, &[])?;
            g.output(name, id);
        }
        let local = g.op(
            names::LOCAL_EXPERTS,
            Op::RankExperts {
                experts_per_rank: self.experts_per_rank(),
            },
            &[rank],
        )?;
        g.output(names::LOCAL_EXPERTS, local);
        if self.shared_experts > 0 {
            // Every rank holds all of them: the experts of "rank 0" at `n` per rank.
            let zero = g.op(
                "shared_experts.rank",
                Op::Zeros {
                    dtype: DType::I32,
                    shape: vec![Dim::Fixed(1)],
                },
                &[],
            )?;
            let shared = g.op(
                names::SHARED_EXPERTS,
                Op::RankExperts {
                    experts_per_rank: self.shared_experts,
                },
                &[zero],
            )?;
            g.output(names::SHARED_EXPERTS, shared);
        }
        g.finish()
    }
}
