//! The batch-processor runtime and the bound of every symbolic dim (`max_dims`), so that buffers
//! are planned once at their largest size.

use crate::ir::names;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Batch-processing limits of a deployment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchProcessorRuntime {
    /// Sequences per step, per data-parallel replica.
    pub max_batch_size: usize,
    /// Longest context (prompt plus generated tokens).
    pub max_seq_len: usize,
    /// Token budget of one step, per replica.
    pub max_batch_input_tokens: usize,
    /// Long prompts are split into chunks that fit the budget.
    pub enable_chunked_prefill: bool,
    /// Data-parallel replicas.
    pub data_parallel_degree: usize,
    /// Draft tokens the decoder verifies in one step (speculative decoding): each step returns
    /// up to this many plus one logit rows per sequence. 0: no speculation.
    #[serde(default)]
    pub num_speculative_tokens: usize,
    /// Logit rows one step may return (the `logit_rows` bound): each sequence's next-token
    /// and draft rows, and the prompt rows being scored (`echo` with `logprobs`). `None`:
    /// [`DEFAULT_SCORING_ROWS`] or the per-sequence rows, whichever is more, within the token
    /// budget ([`BatchProcessorRuntime::max_logit_rows`]).
    #[serde(default)]
    pub max_logit_rows: Option<usize>,
}

/// The default bound on logit rows, for scoring: a prompt is scored in chunks of this many
/// rows (its logits buffer is this many vocabulary rows of f32).
pub const DEFAULT_SCORING_ROWS: usize = 64;

impl Default for BatchProcessorRuntime {
    fn default() -> Self {
        BatchProcessorRuntime {
            max_batch_size: 8,
            max_seq_len: 512,
            max_batch_input_tokens: 512,
            enable_chunked_prefill: true,
            data_parallel_degree: 1,
            num_speculative_tokens: 0,
            max_logit_rows: None,
        }
    }
}

impl BatchProcessorRuntime {
    /// Checks that every limit is at least one; the error names the setting.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("max_batch_size", self.max_batch_size),
            ("max_seq_len", self.max_seq_len),
            ("max_batch_input_tokens", self.max_batch_input_tokens),
            ("data_parallel_degree", self.data_parallel_degree),
        ] {
            if value == 0 {
                return Err(Error::Setting {
                    field: field.into(),
                    value: value.to_string(),
                    message: "must be at least 1".into(),
                });
            }
        }
        if let Some(n) = self.max_logit_rows {
            let least = self.least_logit_rows();
            let most = self.max_batch_active_tokens().max(least);
            if n < least || n > most {
                return Err(Error::Setting {
                    field: "max_logit_rows".into(),
                    value: n.to_string(),
                    message: format!(
                        "must be at least {least} (max_batch_size × data_parallel_degree × \
                         (num_speculative_tokens + 1): every sequence's next-token and draft \
                         rows) and at most {most} (the token rows of a step)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// `max_batch_size * data_parallel_degree`.
    pub fn max_global_batch_size(&self) -> usize {
        self.max_batch_size * self.data_parallel_degree
    }

    /// Tokens in one step over all replicas. Per replica the budget is `max_batch_input_tokens`,
    /// plus `max_seq_len` when chunked prefill is off (one full-length sequence may land on a full
    /// budget); it never exceeds `max_batch_size * max_seq_len` nor falls below `max_batch_size`.
    pub fn max_batch_active_tokens(&self) -> usize {
        let soft = if self.enable_chunked_prefill {
            0
        } else {
            self.max_seq_len
        };
        let per_replica = (self.max_batch_input_tokens + soft)
            .min(self.max_batch_size * self.max_seq_len)
            .max(self.max_batch_size);
        per_replica * self.data_parallel_degree
    }

    /// The logit rows every step must be able to return: `num_speculative_tokens + 1` for
    /// every sequence of every replica.
    pub fn least_logit_rows(&self) -> usize {
        self.max_global_batch_size() * (self.num_speculative_tokens + 1)
    }

    /// Logit rows one step returns at most: `max_logit_rows` where set, else the larger of
    /// [`BatchProcessorRuntime::least_logit_rows`] and [`DEFAULT_SCORING_ROWS`] (at most the
    /// step's token rows), so that every artifact can score prompts.
    pub fn max_logit_rows(&self) -> usize {
        self.max_logit_rows.unwrap_or_else(|| {
            self.least_logit_rows()
                .max(DEFAULT_SCORING_ROWS.min(self.max_batch_active_tokens()))
        })
    }
}

/// Paged KV cache settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheParams {
    /// Tokens per page.
    pub page_size: usize,
    /// The cache's size in pages of every layer (`page_size` tokens' keys and values in each
    /// decoder layer); a cache of several page groups has this many pages per group, each of
    /// one group's layers, so its memory is the same. `None` means enough for every context at
    /// full length in every group ([`KvCacheParams::total_pages`]).
    pub num_pages: Option<usize>,
    /// What the cache stores each key and value as.
    #[serde(default)]
    pub dtype: maxc_schema::KvDtype,
}

impl Default for KvCacheParams {
    fn default() -> Self {
        KvCacheParams {
            page_size: 128,
            num_pages: None,
            dtype: maxc_schema::KvDtype::F32,
        }
    }
}

impl KvCacheParams {
    /// Pages per context at `max_seq_len`.
    pub fn max_pages_per_context(&self, batch: &BatchProcessorRuntime) -> usize {
        batch.max_seq_len.div_ceil(self.page_size)
    }

    /// Pages one context holds at most in a page group with sliding window `window` (`None`:
    /// full attention): every page at `max_seq_len`, or in a sliding group the pages a step
    /// reads and writes, from the one holding its first row's window start to its last row,
    /// at most `ceil((window - 1 + max_batch_active_tokens) / page_size) + 1`.
    pub fn max_pages_in_group(
        &self,
        batch: &BatchProcessorRuntime,
        window: Option<usize>,
    ) -> usize {
        let all = self.max_pages_per_context(batch);
        match window {
            None => all,
            Some(w) => all.min(
                (w.saturating_sub(1) + batch.max_batch_active_tokens()).div_ceil(self.page_size)
                    + 1,
            ),
        }
    }

    /// Pages in the cache, whose page groups have the sliding windows `windows` (`None`: full
    /// attention; no entry: one full-attention group): `num_pages` per group where set, else
    /// enough for every context at full length in every group.
    pub fn total_pages(&self, batch: &BatchProcessorRuntime, windows: &[Option<usize>]) -> usize {
        let groups = windows.len().max(1);
        if let Some(n) = self.num_pages {
            return n.saturating_mul(groups);
        }
        let per_context: usize = if windows.is_empty() {
            self.max_pages_per_context(batch)
        } else {
            windows
                .iter()
                .map(|&w| self.max_pages_in_group(batch, w))
                .sum()
        };
        batch.max_global_batch_size() * per_context
    }
}

/// The deployment: what [`crate::DeploymentConfig::apply_runtime`] completes a config with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRuntime {
    /// Batch-processing limits.
    pub batch: BatchProcessorRuntime,
    /// KV cache settings.
    pub kv: KvCacheParams,
    /// Expert-parallel ranks the experts of a mixture-of-experts model are spread over (1: every
    /// expert on one rank).
    #[serde(default = "one")]
    pub expert_parallel_degree: usize,
    /// Tensor-parallel ranks a decoder's heads and MLP width are split over (Megatron's
    /// layout; 1: one rank holds the whole model).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tensor_parallel_degree: usize,
    /// How multi-head latent attention (DeepSeek) is computed; other models ignore it.
    #[serde(default, skip_serializing_if = "MlaAttention::is_absorbed")]
    pub mla_attention: MlaAttention,
}

/// How a multi-head latent attention model's attention is computed. Both forms read and write
/// the same latent cache and compute the same function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlaAttention {
    /// The key up-projection folded into the query and the value up-projection applied after
    /// attention: attention runs in the latent space, per cached token `C + R` values a head
    /// (DeepSeek's decode form).
    #[default]
    Absorbed,
    /// Each step decompresses its sequences' cached latents into per-head keys and values,
    /// then plain attention: cheaper per query row, dearer per cached token.
    Decompressed,
}

impl MlaAttention {
    fn is_absorbed(&self) -> bool {
        *self == MlaAttention::Absorbed
    }
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Default for ModuleRuntime {
    fn default() -> Self {
        ModuleRuntime {
            batch: BatchProcessorRuntime::default(),
            kv: KvCacheParams::default(),
            expert_parallel_degree: 1,
            tensor_parallel_degree: 1,
            mla_attention: MlaAttention::Absorbed,
        }
    }
}

impl ModuleRuntime {
    /// Checks every setting; the error names the setting.
    pub fn validate(&self) -> Result<()> {
        self.batch.validate()?;
        if self.tensor_parallel_degree == 0 {
            return Err(Error::Setting {
                field: "tensor_parallel_degree".into(),
                value: "0".into(),
                message: "must be at least 1".into(),
            });
        }
        if self.expert_parallel_degree == 0 {
            return Err(Error::Setting {
                field: "expert_parallel_degree".into(),
                value: "0".into(),
                message: "must be at least 1".into(),
            });
        }
        if self.kv.page_size == 0 {
            return Err(Error::Setting {
                field: "page_size".into(),
                value: "0".into(),
                message: "must be at least 1".into(),
            });
        }
        if self.kv.num_pages == Some(0) {
            return Err(Error::Setting {
                field: "kv_cache_pages".into(),
                value: "0".into(),
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// The dims this runtime bounds, sorted.
    pub const KNOWN_DIMS: [&'static str; 6] = [
        names::BATCH_SIZE,
        names::INPUT_ROW_OFFSETS_LEN,
        names::LOGIT_ROWS,
        names::MAX_NUM_PAGES,
        names::TOTAL_NUM_PAGES,
        names::TOTAL_SEQ_LEN,
    ];

    /// The largest size of each named per-step dim, for a KV cache whose page groups have the
    /// sliding windows `kv_windows` (see [`KvCacheParams::total_pages`]). A dim it does not
    /// bound is an error naming the dim and the dims it knows.
    pub fn max_dims<'a>(
        &self,
        dims: impl IntoIterator<Item = &'a str>,
        kv_windows: &[Option<usize>],
    ) -> Result<BTreeMap<String, usize>> {
        self.validate()?;
        let b = &self.batch;
        let mut out = BTreeMap::new();
        for dim in dims {
            let bound = match dim {
                names::BATCH_SIZE => b.max_global_batch_size(),
                names::TOTAL_SEQ_LEN => b.max_batch_active_tokens(),
                names::INPUT_ROW_OFFSETS_LEN => b.max_global_batch_size() + 1,
                names::LOGIT_ROWS => b.max_logit_rows(),
                names::MAX_NUM_PAGES => self.kv.max_pages_per_context(b),
                names::TOTAL_NUM_PAGES => self.kv.total_pages(b, kv_windows),
                other => {
                    return Err(Error::Dim {
                        dim: other.into(),
                        message: format!(
                            "not bounded by the batch-processor runtime; known dims: {}",
                            Self::KNOWN_DIMS.join(", ")
                        ),
                    })
                }
            };
            out.insert(dim.to_string(), bound);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt(bs: usize, len: usize, budget: usize, chunked: bool, dp: usize) -> ModuleRuntime {
        ModuleRuntime {
            batch: BatchProcessorRuntime {
                max_batch_size: bs,
                max_seq_len: len,
                max_batch_input_tokens: budget,
                enable_chunked_prefill: chunked,
                data_parallel_degree: dp,
                num_speculative_tokens: 0,
                max_logit_rows: None,
            },
            kv: KvCacheParams {
                page_size: 16,
                num_pages: None,
                dtype: Default::default(),
            },
            ..ModuleRuntime::default()
        }
    }

    #[test]
    fn chunked_prefill_off_is_capped_by_full_contexts() {
        // 8192 + 128 exceeds 2 * 128: every context full is the cap.
        assert_eq!(
            rt(2, 128, 8192, false, 1).batch.max_batch_active_tokens(),
            256
        );
    }

    #[test]
    fn chunked_prefill_off_adds_one_sequence_to_the_budget() {
        assert_eq!(
            rt(8, 4096, 2048, false, 1).batch.max_batch_active_tokens(),
            2048 + 4096
        );
        assert_eq!(
            rt(8, 4096, 2048, true, 1).batch.max_batch_active_tokens(),
            2048
        );
    }

    #[test]
    fn data_parallel_replicas_add_up() {
        let r = rt(8, 8192, 2048, true, 4);
        assert_eq!(r.batch.max_batch_active_tokens(), 8192);
        assert_eq!(r.batch.max_global_batch_size(), 32);
        let dims = r
            .max_dims(["batch_size", "input_row_offsets_len"], &[])
            .unwrap();
        assert_eq!(dims["batch_size"], 32);
        assert_eq!(dims["input_row_offsets_len"], 33);
    }

    #[test]
    fn logit_rows_grow_with_the_speculation_depth() {
        let mut r = rt(8, 512, 512, true, 2);
        let rows = |r: &ModuleRuntime| r.max_dims(["logit_rows"], &[]).unwrap()["logit_rows"];
        // Sixteen sequences' next-token rows, raised to the default scoring chunk.
        assert_eq!(rows(&r), DEFAULT_SCORING_ROWS);
        r.batch.num_speculative_tokens = 7;
        assert_eq!(rows(&r), 128);
        // The scoring chunk never exceeds a step's token rows.
        assert_eq!(rows(&rt(2, 512, 16, true, 1)), 16);
    }

    #[test]
    fn max_logit_rows_is_checked_against_what_a_step_needs_and_holds() {
        let mut r = rt(8, 512, 512, true, 1);
        r.batch.max_logit_rows = Some(512);
        assert_eq!(r.max_dims(["logit_rows"], &[]).unwrap()["logit_rows"], 512);
        for (n, want) in [(7, "at least 8"), (513, "at most 512")] {
            r.batch.max_logit_rows = Some(n);
            let e = r.max_dims(["logit_rows"], &[]).unwrap_err().to_string();
            assert!(e.contains("max_logit_rows") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn budget_below_batch_size_still_gives_one_token_per_context() {
        assert_eq!(
            rt(64, 1024, 16, true, 1).batch.max_batch_active_tokens(),
            64
        );
        assert_eq!(
            rt(64, 1024, 16, true, 2).batch.max_batch_active_tokens(),
            128
        );
    }

    #[test]
    fn full_length_sequences_below_the_budget_cap_it() {
        // 4 sequences of 100 tokens hold 400 tokens, below a budget of 8192.
        assert_eq!(
            rt(4, 100, 8192, true, 1).batch.max_batch_active_tokens(),
            400
        );
    }

    #[test]
    fn sliding_page_groups_bound_the_pages_their_windows_reach() {
        // 2 sequences of up to 1024 tokens, a step budget of 64, pages of 16.
        let r = rt(2, 1024, 64, true, 1);
        let windows = [None, Some(100), Some(100)];
        // A full group holds 64 pages per context; a window of 100 with chunks of up to 64
        // rows reaches ceil((99 + 64) / 16) + 1 = 12.
        assert_eq!(r.kv.max_pages_in_group(&r.batch, Some(100)), 12);
        let dims = r.max_dims(["total_num_pages"], &windows).unwrap();
        assert_eq!(dims["total_num_pages"], 2 * (64 + 12 + 12));
        // A window longer than the context is bounded by the context.
        assert_eq!(r.kv.max_pages_in_group(&r.batch, Some(5000)), 64);
        // A page count set by hand holds that many pages of every layer: one per group.
        let mut fixed = r.clone();
        fixed.kv.num_pages = Some(10);
        let dims = fixed.max_dims(["total_num_pages"], &windows).unwrap();
        assert_eq!(dims["total_num_pages"], 30);
    }

    #[test]
    fn page_dims() {
        let r = rt(3, 100, 64, true, 2);
        let dims = r.max_dims(ModuleRuntime::KNOWN_DIMS, &[]).unwrap();
        assert_eq!(dims["max_num_pages"], 7); // ceil(100 / 16)
        assert_eq!(dims["total_num_pages"], 6 * 7);
        let mut fixed = r.clone();
        fixed.kv.num_pages = Some(10);
        assert_eq!(
            fixed.max_dims(["total_num_pages"], &[]).unwrap()["total_num_pages"],
            10
        );
    }

    #[test]
    fn unknown_dim_names_the_dim_and_the_known_ones() {
        let err = rt(1, 8, 8, true, 1)
            .max_dims(["image_rows"], &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("image_rows") && err.contains("total_seq_len"),
            "{err}"
        );
    }

    #[test]
    fn zero_bounds_are_errors_naming_the_setting() {
        for (r, field) in [
            (rt(0, 8, 8, true, 1), "max_batch_size"),
            (rt(1, 0, 8, true, 1), "max_seq_len"),
            (rt(1, 8, 0, true, 1), "max_batch_input_tokens"),
            (rt(1, 8, 8, true, 0), "data_parallel_degree"),
        ] {
            let err = r.max_dims(["batch_size"], &[]).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        let mut r = rt(1, 8, 8, true, 1);
        r.kv.page_size = 0;
        assert!(r
            .max_dims(["max_num_pages"], &[])
            .unwrap_err()
            .to_string()
            .contains("page_size"));
    }
}
