//! maxc's serving layers over the runtime: the scheduler (continuous batching, the prefix
//! cache, preemption, speculative decoding; no HTTP), the OpenAI-compatible HTTP server,
//! MAX's serve metrics, traces, the serve config file, and text: the tokenizer and the chat
//! template. The runtime below it runs steps; nothing here computes a kernel.

pub mod chat;
pub mod config;
pub mod constraint;
pub mod metrics;
pub mod reasoning;
pub mod scheduler;
pub mod server;
pub mod tokenizer;
pub mod tools;
pub mod trace;
