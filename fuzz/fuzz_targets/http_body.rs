//! The server's strict parsing of completions and chat request bodies.
#![no_main]
use libfuzzer_sys::fuzz_target;
use maxc_serve::server::openai::{parse, ChatRequest, CompletionRequest};

fuzz_target!(|data: &[u8]| {
    let _ = parse::<CompletionRequest>(data);
    let _ = parse::<ChatRequest>(data);
});
