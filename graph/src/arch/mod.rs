//! Model architectures: each parses its config.json, names its graph roles, gives its deployment
//! config and builds each role's graph. [`crate::Registry`] holds them by name.

pub mod config;
pub mod decoder;
pub mod deepseek;
pub mod deepseek_gguf;
pub mod ep_init;
pub mod gemma3;
pub mod gguf;
pub mod llama;
pub mod llama_with_draft;
pub mod mistral;
pub mod mixtral;
mod mla;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod rope;

use crate::{DType, DeploymentConfig, Graph, GraphRole, Result};
use config::ConfigReader;
use decoder::DecoderConfig;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a role's graph is built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildOptions {
    /// The dtype float weights are stored and bound in.
    pub param_dtype: DType,
    /// Tokens per KV cache page.
    pub page_size: usize,
    /// The graph takes `batch_context_lengths` (from the deployment config).
    pub takes_batch_context_lengths: bool,
    /// The float dtype the checkpoint stores its weights in (before conversion); rotary
    /// frequencies follow it as transformers does ([`rope::RopeConfig::inv_freq`]).
    pub checkpoint_dtype: DType,
    /// The deployment (the `ep_init` graph's sizes come from it).
    pub runtime: crate::ModuleRuntime,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            param_dtype: DType::F32,
            page_size: 128,
            takes_batch_context_lengths: false,
            checkpoint_dtype: DType::F32,
            runtime: crate::ModuleRuntime::default(),
        }
    }
}

/// A registered architecture: its name and how to read its config.
pub trait Architecture: Send + Sync {
    /// The Hugging Face `architectures` entry, e.g. `LlamaForCausalLM`.
    fn name(&self) -> &'static str;
    /// One line for `maxc models`.
    fn description(&self) -> &'static str;
    /// The graph roles a model of this architecture has.
    fn roles(&self) -> &'static [GraphRole];
    /// Parses config.json into a model spec.
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>>;
}

/// One model: its parsed config, roles, deployment config and graph builders.
pub trait ModelSpec: fmt::Debug + Send + Sync {
    /// The architecture's name.
    fn architecture(&self) -> &'static str;
    /// The graph roles this model has, in build order.
    fn roles(&self) -> Vec<GraphRole>;
    /// The deployment config, before the runtime completes it.
    fn deployment(&self) -> DeploymentConfig;
    /// The decoder config of `role`.
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig>;
    /// Tokens the checkpoint's draft proposes per step, where it has a draft.
    fn num_draft_tokens(&self) -> Option<usize> {
        None
    }
    /// Builds `role`'s graph.
    fn build(&self, role: GraphRole, opts: &BuildOptions) -> Result<Graph> {
        match self.decoder(role) {
            Some(cfg) => decoder::build_decoder(cfg, role, opts),
            None => Err(crate::Error::Graph {
                node: "<graph>".into(),
                op: "-".into(),
                message: format!("{} has no {role} role", self.architecture()),
            }),
        }
    }
    /// The resolved config of every role, for listings and manifests.
    fn resolved_config(&self) -> serde_json::Value {
        let roles: serde_json::Map<String, serde_json::Value> = self
            .roles()
            .into_iter()
            .filter_map(|r| {
                self.decoder(r).map(|c| {
                    (
                        r.name().to_string(),
                        serde_json::to_value(c).unwrap_or_default(),
                    )
                })
            })
            .collect();
        serde_json::Value::Object(roles)
    }
}
