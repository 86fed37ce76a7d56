//! The scheduler: continuous batching of requests over one executor, with no HTTP in sight.
//!
//! A step runs in three phases, as vLLM's v1 scheduler does. [`Scheduler::step`] calls them in
//! order and records what they did (a [`StepStats`]) in the metrics:
//! - `schedule` (`schedule.rs`): cancels requests whose clients left, composes the step and
//!   allocates its pages in the KV cache the scheduler owns. Every step holds, per
//!   data-parallel replica, at most `max_batch_size` contexts and `max_batch_input_tokens` new
//!   tokens: decode rows first, then the prefill chunks of admitted requests, then new requests
//!   admitted first come, first served. With chunked prefill a prompt runs in budget-sized
//!   chunks; without it a prompt runs whole, and one prompt may land on a full budget (the
//!   artifact's bound allows it). The replicas' rows are staged into one ragged step. When
//!   pages run short, unreferenced cached pages are evicted first, then the youngest request
//!   of the step is preempted: its pages are freed and it goes back to the head of the queue
//!   with the tokens it generated, to be recomputed (its client sees no difference). With
//!   speculative decoding the draft proposes here. What it hands on fits.
//! - the executor runs the step;
//! - `update` (`update.rs`): commits the step's pages, samples (or verifies drafts), applies
//!   stop rules, drops rejected drafts, puts full pages into the prefix cache and retires
//!   finished requests.
//!
//! Where the executor's threads share their CPUs with other processes, decode steps run in a
//! loop that any of those threads advances (`codrive.rs`, [`Scheduler::run_loop`]): the same
//! phases, taken in turn by whichever thread has a CPU.
//!
//! [`generate`] runs one prompt to its end on the same path (`maxc generate`).

mod active;
mod codrive;
mod generate;
mod handle;
mod plan;
pub mod request;
mod schedule;
mod spans;
pub mod speculative;
mod state;
pub mod stats;
mod update;

pub use codrive::loop_steps;
pub use generate::{generate, GenerateOptions};
pub use handle::SchedulerHandle;
pub use request::{Event, EventSender, FinishReason, Fork, Pooling, Request, TokenLogprob, Usage};
pub use speculative::{Speculation, SpeculationOptions, SpeculationStats};
pub use state::{Scheduler, SchedulerConfig, StepReport};
pub use stats::StepStats;
