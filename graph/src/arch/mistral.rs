//! `MistralForCausalLM`: the Llama decoder with sliding-window attention on every layer where
//! `sliding_window` is set (Mistral 7B v0.1; later Mistral configs set it to null).

use super::config::ConfigReader;
use super::decoder::read_layer_windows;
use super::llama::{read_llama, DecoderModel};
use super::{Architecture, ModelSpec};
use crate::{GraphRole, Result};

/// The Mistral architecture.
pub struct Mistral;

impl Architecture for Mistral {
    fn name(&self) -> &'static str {
        "MistralForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Mistral decoder: Llama layout, sliding-window attention where sliding_window is set"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = read_llama(cfg)?;
        config.layer_windows = read_layer_windows(cfg, config.num_layers, true)?;
        Ok(Box::new(DecoderModel::new(self.name(), config)))
    }
}

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::GraphRole;
    use std::path::Path;

    fn parse(cfg: &serde_json::Value) -> crate::Result<Box<dyn crate::arch::ModelSpec>> {
        Registry::builtin().parse_config(Path::new("m/config.json"), cfg)
    }

    fn config() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "sliding_window": 16, "max_position_embeddings": 64
        })
    }

    #[test]
    fn every_layer_slides_where_a_window_is_set() {
        let spec = parse(&config()).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(c.layer_windows, vec![Some(16), Some(16)]);
        let mut cfg = config();
        cfg["sliding_window"] = serde_json::Value::Null;
        let spec = parse(&cfg).unwrap();
        assert!(spec
            .decoder(GraphRole::Decoder)
            .unwrap()
            .layer_windows
            .is_empty());
    }

    #[test]
    fn a_window_as_long_as_the_context_is_full_attention() {
        for w in [64, 128] {
            let mut cfg = config();
            cfg["sliding_window"] = w.into();
            let spec = parse(&cfg).unwrap();
            let c = spec.decoder(GraphRole::Decoder).unwrap();
            assert!(c.layer_windows.is_empty(), "window {w}");
        }
        let mut cfg = config();
        cfg["sliding_window"] = 63.into();
        let spec = parse(&cfg).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(c.layer_windows, vec![Some(63), Some(63)]);
    }

    /// Qwen/Qwen2.5-7B-Instruct's config.json: `sliding_window` 131072 over a 32768 context,
    /// `use_sliding_window` false. No layer slides.
    #[test]
    fn the_qwen2_5_config_parses_without_windows() {
        let cfg = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
            "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
            "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
            "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 152064
        });
        let spec = parse(&cfg).unwrap();
        assert!(spec
            .decoder(GraphRole::Decoder)
            .unwrap()
            .layer_windows
            .is_empty());
    }
}
