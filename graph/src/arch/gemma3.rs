//! `Gemma3ForCausalLM`: Gemma 3's text decoder. Layers alternate sliding-window and full
//! attention (`layer_types`, or every `sliding_window_pattern`-th layer full), each kind with
//! its own rotary base (`rope_parameters` keyed by layer type in transformers 5;
//! `rope_theta` and `rope_local_base_freq` in 4); RMSNorms multiply by `1 + w`, before and
//! after attention and the MLP; q and k have per-head norms; the MLP is GeGLU (tanh GELU);
//! embeddings are scaled by `sqrt(hidden_size)` and tied to the LM head; scores are scaled by
//! `query_pre_attn_scalar^-1/2`.

use super::config::ConfigReader;
use super::decoder::{read_layer_windows, Biases, DecoderConfig, GemmaStyle};
use super::llama::DecoderModel;
use super::rope::RopeConfig;
use super::{Architecture, ModelSpec};
use crate::{GraphRole, Result};

/// The Gemma 3 (text) architecture.
pub struct Gemma3;

impl Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        "Gemma3ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Gemma 3 text decoder: sliding and full layers with their own rotary bases, (1 + w) sandwich norms, q/k norms, GeGLU, scaled tied embeddings"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        Ok(Box::new(DecoderModel::unpermuted(
            self.name(),
            read_gemma3(cfg)?,
        )))
    }
}

/// Reads a Gemma 3 text config.
pub fn read_gemma3(cfg: &ConfigReader<'_>) -> Result<DecoderConfig> {
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(v) = cfg.opt_f64(key)? {
            return Err(cfg.error(
                key,
                format!("is {v}; logit soft-capping is not supported yet, expected null"),
            ));
        }
    }
    if let Some(act) = cfg.opt_str("hidden_activation")? {
        if act != "gelu_pytorch_tanh" {
            return Err(cfg.error(
                "hidden_activation",
                format!("`{act}` is not supported; expected gelu_pytorch_tanh"),
            ));
        }
    }
    let mut config = DecoderConfig::read(cfg)?;
    let bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
    config.biases = Biases {
        qkv: bias,
        o: bias,
        mlp: false,
    };
    config.qk_norm = true;
    config.tie_word_embeddings = cfg.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    // Rotary bases: per layer type (transformers 5), or global and local (4).
    let params = cfg.child("rope_parameters")?;
    let keyed = match &params {
        Some(p) => p
            .child("full_attention")?
            .zip(p.child("sliding_attention")?),
        None => None,
    };
    let (global, local) = match keyed {
        Some((full, sliding)) => (
            RopeConfig::read_from(cfg, Some(full), None)?,
            RopeConfig::read_from(cfg, Some(sliding), None)?,
        ),
        None => {
            let global = RopeConfig::read(cfg)?;
            let local = RopeConfig {
                theta: cfg.opt_f64("rope_local_base_freq")?.unwrap_or(10000.0),
                scaling: super::rope::RopeScaling::Default,
            };
            (global, local)
        }
    };
    config.rope = global;
    config.layer_windows = if cfg.get("layer_types").is_some() {
        read_layer_windows(cfg, config.num_layers, false)?
    } else {
        // transformers 4: every `sliding_window_pattern`-th layer is full, the others slide.
        let pattern = match cfg.opt_usize("sliding_window_pattern")? {
            Some(p) => Some(p),
            None => cfg.opt_usize("_sliding_window_pattern")?,
        }
        .unwrap_or(6);
        let window = cfg.positive("sliding_window")?;
        (0..config.num_layers)
            .map(|l| (!(l + 1).is_multiple_of(pattern.max(1))).then_some(window))
            .collect()
    };
    let scalar = cfg
        .opt_f64("query_pre_attn_scalar")?
        .unwrap_or(config.head_dim as f64);
    if scalar <= 0.0 {
        return Err(cfg.error(
            "query_pre_attn_scalar",
            format!("is {scalar}; expected a positive number"),
        ));
    }
    let from_gguf = cfg
        .opt_bool(super::gguf::NORMS_INCLUDE_ONE)?
        .unwrap_or(false);
    config.gemma = Some(GemmaStyle {
        unit_offset_norms: !from_gguf,
        scaled_embeddings: true,
        sandwich_norms: true,
        gelu_tanh: true,
        attention_scale: scalar.powf(-0.5) as f32,
        local_rope: local,
    });
    Ok(config)
}

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::GraphRole;
    use std::path::Path;

    /// A transformers 4 config: `rope_local_base_freq`, `sliding_window_pattern`.
    fn tf4() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "vocab_size": 100, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"
        })
    }

    fn parse(cfg: &serde_json::Value) -> crate::Result<Box<dyn crate::arch::ModelSpec>> {
        Registry::builtin().parse_config(Path::new("m/config.json"), cfg)
    }

    #[test]
    fn transformers_4_layers_alternate_with_their_own_rotary_bases() {
        let spec = parse(&tf4()).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(c.layer_windows, vec![Some(8), None, Some(8), None]);
        let g = c.gemma.as_ref().unwrap();
        assert_eq!((c.rope.theta, g.local_rope.theta), (1e6, 1e4));
        assert_eq!(g.attention_scale, 1.0 / 16.0);
        assert!(c.tie_word_embeddings);
        let graph = spec.build(GraphRole::Decoder, &Default::default()).unwrap();
        let params = graph.params();
        for key in [
            "model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.3.self_attn.k_norm.weight",
        ] {
            assert!(params.contains_key(key), "{key}");
        }
    }

    #[test]
    fn soft_capping_and_other_activations_name_the_key() {
        let mut cfg = tf4();
        cfg["final_logit_softcapping"] = 30.0.into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("final_logit_softcapping") && err.contains("30"),
            "{err}"
        );
        let mut cfg = tf4();
        cfg["hidden_activation"] = "relu".into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("hidden_activation") && err.contains("gelu_pytorch_tanh"),
            "{err}"
        );
    }
}
