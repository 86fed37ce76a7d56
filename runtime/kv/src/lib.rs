//! The paged KV cache's bookkeeping, with no executor and no memory of its own: which pages
//! each sequence's tokens live in ([`PageTable`], transactional and reference-counted), and
//! which full pages are kept for reuse by the tokens before them ([`PrefixCache`]). The
//! scheduler owns one of each per role; the executors only read the step inputs they build.

pub mod cache;
pub mod pages;
pub mod prefix;

pub use cache::KvCache;
pub use pages::{PageError, PageTable, PreparedStep, FREED};
pub use prefix::PrefixCache;
