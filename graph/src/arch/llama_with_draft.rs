//! `LlamaWithDraftForCausalLM`: one checkpoint holding two Llama decoders, the target under
//! `language_model.` (role `Decoder`, config `text_config`) and a speculative-decoding draft under
//! `draft_model.` (role `Draft`, config `draft_config`).

use super::config::ConfigReader;
use super::decoder::DecoderConfig;
use super::llama::read_llama;
use super::{Architecture, ModelSpec};
use crate::{DeploymentConfig, GraphRole, Result};
use std::collections::BTreeMap;

/// The Llama-with-draft architecture.
pub struct LlamaWithDraft;

impl Architecture for LlamaWithDraft {
    fn name(&self) -> &'static str {
        "LlamaWithDraftForCausalLM"
    }
    fn description(&self) -> &'static str {
        "a Llama target (`language_model.`) and a Llama draft (`draft_model.`) in one checkpoint"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder, GraphRole::Draft]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let target = read_llama(&cfg.require_child("text_config")?)?;
        let draft = read_llama(&cfg.require_child("draft_config")?)?;
        if draft.vocab_size != target.vocab_size {
            return Err(cfg.error(
                "draft_config.vocab_size",
                format!(
                    "is {}; the draft must share the target's vocabulary ({})",
                    draft.vocab_size, target.vocab_size
                ),
            ));
        }
        let num_draft_tokens = cfg.opt_usize("num_draft_tokens")?.unwrap_or(1);
        Ok(Box::new(LlamaWithDraftModel {
            target,
            draft,
            num_draft_tokens,
        }))
    }
}

/// A target decoder with its draft.
#[derive(Clone, Debug)]
pub struct LlamaWithDraftModel {
    /// The target (role `Decoder`).
    pub target: DecoderConfig,
    /// The draft (role `Draft`).
    pub draft: DecoderConfig,
    /// Tokens the draft proposes per step.
    pub num_draft_tokens: usize,
}

impl ModelSpec for LlamaWithDraftModel {
    fn architecture(&self) -> &'static str {
        "LlamaWithDraftForCausalLM"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder, GraphRole::Draft]
    }
    fn deployment(&self) -> DeploymentConfig {
        let mut d = DeploymentConfig::default();
        d.weight_prefixes = BTreeMap::from([
            (GraphRole::Decoder, "language_model.".to_string()),
            (GraphRole::Draft, "draft_model.".to_string()),
        ]);
        d
    }
    fn num_draft_tokens(&self) -> Option<usize> {
        Some(self.num_draft_tokens)
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        match role {
            GraphRole::Decoder => Some(&self.target),
            GraphRole::Draft => Some(&self.draft),
            GraphRole::EpInit => None,
        }
    }
}
