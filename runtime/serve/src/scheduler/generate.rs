//! One prompt run to its end through the scheduler: `maxc generate`'s decode loop, the same
//! one that serves requests.

use super::request::{Event, Request};
use super::state::Scheduler;
use maxc_runtime::sampling::SamplingParams;
use maxc_runtime::{Result, RuntimeError};

/// Options of [`generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Stop at an end-of-sequence token (the manifest's `eos_token_ids`).
    pub stop_at_eos: bool,
}

/// Generates up to `opts.max_new_tokens` tokens after `prompt` on `scheduler` (with the
/// requests it already holds), stopping early at the end of sequence (where asked) or when
/// prompt and output fill the context; calls `on_token` with each token as it is chosen.
pub fn generate(
    scheduler: &mut Scheduler,
    prompt: &[i64],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(i64) + Send,
) -> Result<Vec<i64>> {
    let room = scheduler.info().max_seq_len.saturating_sub(prompt.len());
    let mut req = Request::greedy(prompt.to_vec(), opts.max_new_tokens.min(room));
    req.sampling = opts.sampling.clone();
    req.ignore_eos = !opts.stop_at_eos;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    scheduler.submit(req, tx);
    let mut out = Vec::new();
    // The request's events so far: `Some` once it has ended (how).
    let mut events = |out: &mut Vec<i64>| -> Option<Result<()>> {
        while let Ok(event) = rx.try_recv() {
            match event {
                Event::Token { id, .. } => {
                    out.push(id);
                    on_token(id);
                }
                Event::Error(e) => return Some(Err(RuntimeError::Input(e))),
                Event::Finished { .. } => return Some(Ok(())),
                Event::Admitted { .. } | Event::PromptLogprobs(_) | Event::Embedding(_) => {}
            }
        }
        None
    };
    loop {
        if let Some(end) = events(&mut out) {
            return end.map(|()| out);
        }
        if !scheduler.has_work() {
            return Ok(out);
        }
        if scheduler.loops() {
            // Decode steps go on on whichever of the executor's threads has a CPU.
            let mut ended = None;
            scheduler.run_loop(&mut |_| {
                ended = events(&mut out);
                ended.is_none()
            });
            if let Some(end) = ended {
                return end.map(|()| out);
            }
            continue;
        }
        scheduler.step();
    }
}
