//! `LlamaForCausalLM`: pre-norm decoder, GQA attention with rotary embedding, SwiGLU MLP.
//! `attention_bias` gives q, k, v and o biases; `mlp_bias` gives gate, up and down biases.

use super::config::ConfigReader;
use super::decoder::{Biases, DecoderConfig};
use super::{Architecture, ModelSpec};
use crate::deployment::DeploymentHooks;
use crate::weights::StateDict;
use crate::{DeploymentConfig, GraphRole, Result};
use std::sync::Arc;

/// The Llama architecture.
pub struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "LlamaForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Llama decoder: GQA attention, rotary embedding (default, linear, llama3), SwiGLU MLP"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        Ok(Box::new(DecoderModel::new(
            "LlamaForCausalLM",
            read_llama(cfg)?,
        )))
    }
}

/// Reads a Llama config.json object: the decoder's fields, `attention_bias` (q, k, v and o)
/// and `mlp_bias`.
pub fn read_llama(cfg: &ConfigReader<'_>) -> Result<DecoderConfig> {
    let mut config = DecoderConfig::read(cfg)?;
    let attention_bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
    config.biases = Biases {
        qkv: attention_bias,
        o: attention_bias,
        mlp: cfg.opt_bool("mlp_bias")?.unwrap_or(false),
    };
    Ok(config)
}

/// A model of one decoder role (Llama, Mistral, Qwen2, Qwen3), with the Llama family's
/// deployment hooks.
#[derive(Clone, Debug)]
pub struct DecoderModel {
    /// The architecture's name.
    pub architecture: &'static str,
    /// The decoder's config.
    pub config: DecoderConfig,
    /// Whether its GGUF files have q and k permuted for llama.cpp's rotary layout.
    pub gguf_qk_permuted: bool,
}

impl DecoderModel {
    /// A model of `architecture` whose GGUF files are permuted as `llama` files are.
    pub fn new(architecture: &'static str, config: DecoderConfig) -> Self {
        DecoderModel {
            architecture,
            config,
            gguf_qk_permuted: true,
        }
    }

    /// A model whose GGUF files keep q and k as Hugging Face has them (Qwen).
    pub fn unpermuted(architecture: &'static str, config: DecoderConfig) -> Self {
        DecoderModel {
            gguf_qk_permuted: false,
            ..Self::new(architecture, config)
        }
    }
}

impl ModelSpec for DecoderModel {
    fn architecture(&self) -> &'static str {
        self.architecture
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        let hooks = LlamaFamilyHooks {
            gguf_qk_permuted: self.gguf_qk_permuted,
            ..LlamaFamilyHooks::new(&self.config)
        };
        DeploymentConfig::with_hooks(Arc::new(hooks))
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
}

/// Weight preparation of the Llama family: maps GGUF tensors to the Hugging Face layout (names,
/// q/k un-permutation), drops the rotary `inv_freq` buffers that older checkpoints saved (the
/// graph computes them from the config), and, where embeddings are tied, a saved copy of
/// `lm_head.weight` (the graph reads the embedding).
#[derive(Debug)]
pub struct LlamaFamilyHooks {
    /// The model ties its LM head to the embedding.
    pub tie_word_embeddings: bool,
    /// Query heads (for GGUF un-permutation).
    pub num_heads: usize,
    /// KV heads (for GGUF un-permutation).
    pub num_kv_heads: usize,
    /// Whether a GGUF file of this architecture has q and k permuted for llama.cpp's rotary
    /// layout (`llama` files; llama.cpp's converter leaves Qwen's and Gemma's as they are).
    pub gguf_qk_permuted: bool,
    /// Whether its GGUF files name their norms as Gemma's (`post_attention_norm`, `ffn_norm`
    /// before the MLP, `post_ffw_norm`).
    pub gguf_gemma_norms: bool,
}

impl LlamaFamilyHooks {
    /// The hooks of a model with `config`.
    pub fn new(config: &DecoderConfig) -> Self {
        LlamaFamilyHooks {
            tie_word_embeddings: config.tie_word_embeddings,
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
            gguf_qk_permuted: true,
            gguf_gemma_norms: config.gemma.is_some(),
        }
    }
}

impl DeploymentHooks for LlamaFamilyHooks {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        let weights = if super::gguf::is_gguf_layout(&weights) {
            let layout = super::gguf::GgufLayout {
                qk_permuted: self.gguf_qk_permuted,
                gemma_norms: self.gguf_gemma_norms,
                ..Default::default()
            };
            super::gguf::gguf_to_hf(weights, self.num_heads, self.num_kv_heads, layout)?
        } else {
            weights
        };
        Ok(weights
            .into_iter()
            .filter(|(k, _)| !k.ends_with("rotary_emb.inv_freq"))
            .filter(|(k, _)| !(self.tie_word_embeddings && k == "lm_head.weight"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::arch::BuildOptions;
    use crate::ir::Op;
    use crate::registry::Registry;
    use crate::GraphRole;
    use std::path::Path;

    /// A transformers 4 config: `torch_dtype`, top-level `rope_theta`, `rope_scaling` with
    /// `type`, no `head_dim`, tied embeddings.
    fn tf4() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6, "vocab_size": 100, "rope_theta": 500000.0, "torch_dtype": "float16",
            "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": true, "max_position_embeddings": 131072
        })
    }

    #[test]
    fn transformers_4_config_with_tied_embeddings() {
        let spec = Registry::builtin()
            .parse_config(Path::new("config.json"), &tf4())
            .unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.rope.theta),
            (16, 1, 500000.0)
        );
        assert_eq!(c.checkpoint_dtype, Some(crate::DType::F16));
        assert!(matches!(
            c.rope.scaling,
            crate::arch::rope::RopeScaling::Llama3 { .. }
        ));
        let g = spec
            .build(GraphRole::Decoder, &BuildOptions::default())
            .unwrap();
        let params = g.params();
        assert!(!params.contains_key("lm_head.weight"));
        // The LM head reads the embedding table.
        let head = g.find("lm_head").unwrap();
        let table = g.operands(head)[1];
        assert_eq!(g.node(table).name, "model.embed_tokens.weight");
        assert_eq!(g.node(table).op, Op::Param);
    }

    #[test]
    fn head_dim_null_is_derived() {
        let mut cfg = tf4();
        cfg["head_dim"] = serde_json::Value::Null;
        let spec = Registry::builtin()
            .parse_config(Path::new("config.json"), &cfg)
            .unwrap();
        assert_eq!(spec.decoder(GraphRole::Decoder).unwrap().head_dim, 16);
    }
}
