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
        Ok(Box::new(LlamaModel::read(cfg)?))
    }
}

/// A Llama model: one decoder role.
#[derive(Clone, Debug)]
pub struct LlamaModel {
    /// The decoder's config.
    pub config: DecoderConfig,
}

impl LlamaModel {
    /// Reads a Llama config.json object.
    pub fn read(cfg: &ConfigReader<'_>) -> Result<Self> {
        let mut config = DecoderConfig::read(cfg)?;
        let attention_bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
        config.biases = Biases {
            qkv: attention_bias,
            o: attention_bias,
            mlp: cfg.opt_bool("mlp_bias")?.unwrap_or(false),
        };
        Ok(LlamaModel { config })
    }
}

impl ModelSpec for LlamaModel {
    fn architecture(&self) -> &'static str {
        "LlamaForCausalLM"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        DeploymentConfig::with_hooks(Arc::new(LlamaFamilyHooks {
            tie_word_embeddings: self.config.tie_word_embeddings,
        }))
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
}

/// Weight preparation of the Llama family: drops the rotary `inv_freq` buffers that older
/// checkpoints saved (the graph computes them from the config), and, where embeddings are tied,
/// a saved copy of `lm_head.weight` (the graph reads the embedding).
#[derive(Debug)]
pub struct LlamaFamilyHooks {
    /// The model ties its LM head to the embedding.
    pub tie_word_embeddings: bool,
}

impl DeploymentHooks for LlamaFamilyHooks {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        Ok(weights
            .into_iter()
            .filter(|(k, _)| !k.ends_with("rotary_emb.inv_freq"))
            .filter(|(k, _)| !(self.tie_word_embeddings && k == "lm_head.weight"))
            .collect())
    }
}
