//! `Gemma3ForCausalLM`: Gemma 3's text decoder. Layers alternate sliding-window and full
//! attention (`layer_types`, or every `sliding_window_pattern`-th layer full), each kind with
//! its own rotary base (`rope_parameters` keyed by layer type in transformers 5;
//! `rope_theta` and `rope_local_base_freq` in 4); RMSNorms multiply by `1 + w`, before and
//! after attention and the MLP; q and k have per-head norms; the MLP is GeGLU (tanh GELU);
//! embeddings are scaled by `sqrt(hidden_size)` and tied to the LM head; scores are scaled by
//! `query_pre_attn_scalar^-1/2`.
//!
//! `Gemma3ForConditionalGeneration` checkpoints (Gemma 3 4B and up: text and vision) are
//! compiled as their language model: its config is `text_config` completed with transformers'
//! `Gemma3TextConfig` defaults (those checkpoints write only what differs), its weights sit under
//! `language_model.` (the role prefix), and the vision tower and projector are left out.

use super::config::ConfigReader;
use super::decoder::{read_layer_windows, Biases, DecoderConfig, GemmaStyle};
use super::llama::DecoderModel;
use super::rope::RopeConfig;
use super::{Architecture, ModelSpec};
use crate::deployment::DeploymentHooks;
use crate::weights::StateDict;
use crate::DeploymentConfig;
use crate::{GraphRole, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

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

/// Gemma 3 with vision: its language model.
pub struct Gemma3ConditionalGeneration;

/// The prefix of the language model's weights in `Gemma3ForConditionalGeneration` checkpoints
/// (transformers 4's layout; transformers 5 writes `model.language_model.`, renamed to it).
const LANGUAGE_MODEL: &str = "language_model.";

/// transformers' `Gemma3TextConfig` defaults, for the fields a `text_config` leaves out.
fn text_config_defaults() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "attention_bias": false,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6
    })
}

impl Architecture for Gemma3ConditionalGeneration {
    fn name(&self) -> &'static str {
        "Gemma3ForConditionalGeneration"
    }
    fn description(&self) -> &'static str {
        "Gemma 3 with vision (4B and up): its language model (`text_config`, weights under `language_model.`); the vision tower is left out"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let text = cfg.require_child("text_config")?;
        let mut completed = text_config_defaults();
        if let Some(fields) = completed.as_object_mut() {
            for (k, v) in text.fields() {
                if !v.is_null() {
                    fields.insert(k.clone(), v.clone());
                }
            }
            // A config that names its layer types does not also take the default pattern.
            if text.get("layer_types").is_some() {
                fields.remove("sliding_window_pattern");
            }
            // transformers 5 keys the rotary bases by layer type: the defaults' 4 fields go.
            if text.get("rope_parameters").is_some() {
                fields.remove("rope_theta");
                fields.remove("rope_local_base_freq");
            }
        }
        let reader = ConfigReader::nested(cfg.file(), "text_config", &completed)?;
        let config = read_gemma3(&reader)?;
        Ok(Box::new(Gemma3VisionModel {
            language: DecoderModel::unpermuted(self.name(), config),
        }))
    }
}

/// A `Gemma3ForConditionalGeneration` checkpoint's language model.
#[derive(Clone, Debug)]
pub struct Gemma3VisionModel {
    language: DecoderModel,
}

impl ModelSpec for Gemma3VisionModel {
    fn architecture(&self) -> &'static str {
        "Gemma3ForConditionalGeneration"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        let mut d = DeploymentConfig::with_hooks(Arc::new(LanguageModelWeights {
            tie_word_embeddings: self.language.config.tie_word_embeddings,
        }));
        d.weight_prefixes = BTreeMap::from([(GraphRole::Decoder, LANGUAGE_MODEL.to_string())]);
        d
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        self.language.decoder(role)
    }
}

/// The language model's weights of a Gemma 3 vision checkpoint, all under `language_model.`.
#[derive(Debug)]
struct LanguageModelWeights {
    tie_word_embeddings: bool,
}

impl DeploymentHooks for LanguageModelWeights {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        let vision = ["vision_tower.", "multi_modal_projector."];
        let mut out = StateDict::new();
        for (key, w) in weights {
            let inner = key.strip_prefix("model.").unwrap_or(&key);
            if vision.iter().any(|v| inner.starts_with(v)) {
                continue;
            }
            // transformers 5: `model.language_model.X` is transformers 4's
            // `language_model.model.X`, and `lm_head.weight` its `language_model.lm_head.weight`.
            let key = if let Some(rest) = key.strip_prefix("model.language_model.") {
                format!("{LANGUAGE_MODEL}model.{rest}")
            } else if key == "lm_head.weight" {
                format!("{LANGUAGE_MODEL}lm_head.weight")
            } else {
                key
            };
            let tied_head = format!("{LANGUAGE_MODEL}lm_head.weight");
            if (self.tie_word_embeddings && key == tied_head)
                || key.ends_with("rotary_emb.inv_freq")
            {
                continue;
            }
            out.insert(key, w);
        }
        Ok(out)
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

    /// Gemma 3 4B's config.json as Google ships it: `text_config` writes only what differs
    /// from `Gemma3TextConfig`'s defaults.
    #[test]
    fn a_vision_checkpoint_is_its_language_model_with_the_text_defaults() {
        let cfg = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "mm_tokens_per_image": 256, "image_token_index": 262144,
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                "model_type": "gemma3_text", "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "patch_size": 14}
        });
        let spec = parse(&cfg).unwrap();
        assert_eq!(spec.architecture(), "Gemma3ForConditionalGeneration");
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!((c.hidden_size, c.num_layers), (2560, 34));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (8, 4, 256));
        assert_eq!(c.vocab_size, 262208);
        // Every sixth layer full, the others sliding over 1024 positions.
        let windows: Vec<_> = (0..34)
            .map(|l| ((l + 1) % 6 != 0).then_some(1024))
            .collect();
        assert_eq!(c.layer_windows, windows);
        let g = c.gemma.as_ref().unwrap();
        assert_eq!((c.rope.theta, g.local_rope.theta), (1e6, 1e4));
        assert_eq!(
            c.rope.scaling,
            crate::arch::rope::RopeScaling::Linear { factor: 8.0 }
        );
        assert_eq!(
            g.local_rope.scaling,
            crate::arch::rope::RopeScaling::Default
        );
        assert_eq!(g.attention_scale, 1.0 / 16.0);
        let d = spec.deployment();
        assert_eq!(
            d.weight_prefixes
                .get(&GraphRole::Decoder)
                .map(String::as_str),
            Some("language_model.")
        );
        // An error inside names the section.
        let mut bad = cfg.clone();
        bad["text_config"]["num_hidden_layers"] = "many".into();
        let err = parse(&bad).unwrap_err().to_string();
        assert!(err.contains("text_config.num_hidden_layers"), "{err}");
        let mut missing = cfg;
        missing.as_object_mut().unwrap().remove("text_config");
        let err = parse(&missing).unwrap_err().to_string();
        assert!(
            err.contains("text_config") && err.contains("missing"),
            "{err}"
        );
    }
}
