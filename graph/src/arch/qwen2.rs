//! `Qwen2ForCausalLM`: the Llama decoder with biases on the q, k and v projections, and
//! sliding windows from `use_sliding_window` / `max_window_layers` (or `layer_types`).

use super::config::ConfigReader;
use super::decoder::{read_layer_windows, Biases, DecoderConfig};
use super::llama::DecoderModel;
use super::{Architecture, ModelSpec};
use crate::{GraphRole, Result};

/// The Qwen2 architecture.
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Qwen2 decoder: Llama layout with q/k/v projection biases, sliding windows where configured"
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
        config.layer_windows = read_layer_windows(cfg, config.num_layers, false)?;
        Ok(Box::new(DecoderModel::unpermuted(self.name(), config)))
    }
}
