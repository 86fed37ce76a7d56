//! `MixtralForCausalLM`: the Llama decoder with a sparse MoE MLP (softmax router, top-k,
//! renormalized; SwiGLU experts). Graph only: its expert-parallel deployment hooks come later.

use super::config::ConfigReader;
use super::decoder::{DecoderConfig, MoeConfig};
use super::llama::LlamaFamilyHooks;
use super::{Architecture, ModelSpec};
use crate::{DeploymentConfig, GraphRole, Result};
use std::sync::Arc;

/// The Mixtral architecture.
pub struct Mixtral;

impl Architecture for Mixtral {
    fn name(&self) -> &'static str {
        "MixtralForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Mixtral decoder: Llama attention, sparse MoE MLP with top-k routing"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = DecoderConfig::read(cfg)?;
        let num_experts = cfg.positive("num_local_experts")?;
        let top_k = cfg.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(cfg.error(
                "num_experts_per_tok",
                format!("is {top_k}; expected at most num_local_experts ({num_experts})"),
            ));
        }
        config.moe = Some(MoeConfig { num_experts, top_k });
        Ok(Box::new(MixtralModel { config }))
    }
}

/// A Mixtral model: one decoder role.
#[derive(Clone, Debug)]
pub struct MixtralModel {
    /// The decoder's config (with `moe` set).
    pub config: DecoderConfig,
}

impl ModelSpec for MixtralModel {
    fn architecture(&self) -> &'static str {
        "MixtralForCausalLM"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        DeploymentConfig::with_hooks(Arc::new(LlamaFamilyHooks::new(&self.config)))
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
}
