//! The compiler's runtime-bound flags, shared by `compile` and `plan`.

use maxc_graph::arch::ModelSpec;
use maxc_graph::{BatchProcessorRuntime, GraphRole, KvCacheParams, MlaAttention, ModuleRuntime};

/// The longest default context.
pub const DEFAULT_MAX_SEQ_LEN: usize = 2048;

/// A positive integer flag value; zero and negatives are refused with the value shown.
pub fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!("expected a positive integer, got {n}")),
        Err(_) => Err(format!("expected a positive integer, got `{s}`")),
    }
}

/// The batch-processor runtime and KV cache flags.
#[derive(clap::Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// Sequences per step, per data-parallel replica.
    #[arg(long, default_value = "8", value_parser = positive, allow_negative_numbers = true)]
    pub max_batch_size: usize,
    /// Longest context (prompt plus generated tokens) [default: the model's
    /// max_position_embeddings, at most 2048, so that the default KV cache stays small].
    #[arg(long, value_parser = positive, allow_negative_numbers = true)]
    pub max_seq_len: Option<usize>,
    /// Token budget of one step, per replica.
    #[arg(long, default_value = "2048", value_parser = positive, allow_negative_numbers = true)]
    pub max_batch_input_tokens: usize,
    /// Run each prompt's prefill in one step instead of budget-sized chunks.
    #[arg(long)]
    pub no_chunked_prefill: bool,
    /// Data-parallel replicas.
    #[arg(long, default_value = "1", value_parser = positive, allow_negative_numbers = true)]
    pub data_parallel_degree: usize,
    /// Tokens per KV cache page.
    #[arg(long, default_value = "128", value_parser = positive, allow_negative_numbers = true)]
    pub page_size: usize,
    /// The KV cache's size in pages of every layer (page-size tokens' keys and values in each
    /// layer; a model whose layers form several page groups gets this many pages per group)
    /// [default: every context at max_seq_len, sliding-window layers only their windows].
    #[arg(long, value_parser = positive, allow_negative_numbers = true)]
    pub kv_cache_pages: Option<usize>,
    /// What the KV cache stores each key and value as: f32 (exact), f16 (half the bytes,
    /// llama.cpp's default: ten mantissa bits, magnitudes past 65504 infinite), bf16 (half
    /// the bytes, f32's range, eight mantissa bits) or q8_0 (8-bit integers with an f32 scale
    /// per 32 values, as llama.cpp's `-ctk/-ctv q8_0`; head_dim a multiple of 32); each
    /// rounded to nearest even. Recorded in the artifact: its kernels store and read that
    /// type.
    #[arg(long, default_value = "f32")]
    pub kv_cache_dtype: maxc_schema::KvDtype,
    /// Draft tokens the decoder verifies per step (speculative decoding); each step can
    /// return this many plus one logit rows per sequence [default: the checkpoint's
    /// num_draft_tokens where it has a draft, else 0].
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
    /// Logit rows one step may return: each sequence's next-token and draft rows, and the
    /// prompt rows being scored (`echo` with `logprobs`), so a prompt is scored in chunks of
    /// this many [default: the larger of 64 and max_batch_size × (num_speculative_tokens + 1),
    /// within the step budget; `compile --all-logits`: the step budget].
    #[arg(long, value_parser = positive, allow_negative_numbers = true)]
    pub max_logit_rows: Option<usize>,
    /// Expert-parallel ranks a mixture-of-experts model's experts are spread over; it must
    /// divide the expert count.
    #[arg(long, default_value = "1", value_parser = positive, allow_negative_numbers = true)]
    pub expert_parallel_degree: usize,
    /// Tensor-parallel ranks a decoder's attention heads and MLP width are split over
    /// (Megatron's layout; heads, KV heads and intermediate size must divide by it): the
    /// artifact holds every rank's program and weights (`decoder`, `decoder@tp1`, ...), and
    /// the CPU runs them as in-process ranks.
    #[arg(long, default_value = "1", value_parser = positive, allow_negative_numbers = true)]
    pub tensor_parallel_degree: usize,
    /// How a multi-head latent attention model (DeepSeek) computes attention over its latent
    /// cache: `absorbed` (the up-projections folded into the query and applied after
    /// attention: the decode form) or `decompressed` (each step expands the cached latents
    /// into per-head keys and values), for measuring one against the other.
    #[arg(long, value_enum, default_value = "absorbed")]
    pub mla_attention: MlaAttentionArg,
}

/// `--mla-attention`'s values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaAttentionArg {
    /// Attention in the latent space.
    Absorbed,
    /// Latents expanded into keys and values each step.
    Decompressed,
}

impl RuntimeArgs {
    /// The runtime for `spec` (its decoder's max_position_embeddings is the default length).
    pub fn runtime(&self, spec: &dyn ModelSpec) -> ModuleRuntime {
        let model_len = spec
            .decoder(GraphRole::Decoder)
            .and_then(|c| c.max_position_embeddings);
        ModuleRuntime {
            batch: BatchProcessorRuntime {
                max_batch_size: self.max_batch_size,
                max_seq_len: self.max_seq_len.unwrap_or_else(|| {
                    model_len
                        .unwrap_or(DEFAULT_MAX_SEQ_LEN)
                        .min(DEFAULT_MAX_SEQ_LEN)
                }),
                max_batch_input_tokens: self.max_batch_input_tokens,
                enable_chunked_prefill: !self.no_chunked_prefill,
                data_parallel_degree: self.data_parallel_degree,
                num_speculative_tokens: self
                    .num_speculative_tokens
                    .or_else(|| spec.num_draft_tokens())
                    .unwrap_or(0),
                max_logit_rows: self.max_logit_rows,
            },
            kv: KvCacheParams {
                page_size: self.page_size,
                num_pages: self.kv_cache_pages,
                dtype: self.kv_cache_dtype,
            },
            expert_parallel_degree: self.expert_parallel_degree,
            tensor_parallel_degree: self.tensor_parallel_degree,
            mla_attention: match self.mla_attention {
                MlaAttentionArg::Absorbed => MlaAttention::Absorbed,
                MlaAttentionArg::Decompressed => MlaAttention::Decompressed,
            },
        }
    }
}
