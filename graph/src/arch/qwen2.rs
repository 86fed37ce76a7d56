//! `Qwen2ForCausalLM`: the Llama decoder with biases on the q, k and v projections.

use super::config::ConfigReader;
use super::decoder::{Biases, DecoderConfig};
use super::llama::LlamaFamilyHooks;
use super::{Architecture, ModelSpec};
use crate::{DeploymentConfig, GraphRole, Result};
use std::sync::Arc;

/// The Qwen2 architecture.
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Qwen2 decoder: Llama layout with q/k/v projection biases"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = DecoderConfig::read(cfg)?;
        config.biases = Biases {
            qkv: true,
            o: false,
            mlp: false,
        };
        config.layer_windows = super::decoder::read_layer_windows(cfg, config.num_layers, false)?;
        Ok(Box::new(Qwen2Model { config }))
    }
}

/// A Qwen2 model: one decoder role.
#[derive(Clone, Debug)]
pub struct Qwen2Model {
    /// The decoder's config.
    pub config: DecoderConfig,
}

impl ModelSpec for Qwen2Model {
    fn architecture(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        DeploymentConfig::with_hooks(Arc::new(LlamaFamilyHooks::unpermuted(&self.config)))
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
}
