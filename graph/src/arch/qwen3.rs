//! `Qwen3ForCausalLM`: the Llama decoder with an explicit `head_dim` and per-head RMSNorms of
//! q and k before rotary (`self_attn.q_norm`, `self_attn.k_norm`).

use super::config::ConfigReader;
use super::decoder::{Biases, DecoderConfig};
use super::llama::LlamaFamilyHooks;
use super::{Architecture, ModelSpec};
use crate::{DeploymentConfig, GraphRole, Result};
use std::sync::Arc;

/// The Qwen3 architecture.
pub struct Qwen3;

impl Architecture for Qwen3 {
    fn name(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Qwen3 decoder: Llama layout, explicit head_dim, per-head RMSNorm of q and k before rotary"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        Ok(Box::new(Qwen3Model {
            config: read_qwen3(cfg)?,
        }))
    }
}

/// Reads what every Qwen3 config has (the MoE variant adds its experts): q/k norms,
/// `attention_bias` on q, k, v and o, and full attention on every layer.
pub fn read_qwen3(cfg: &ConfigReader<'_>) -> Result<DecoderConfig> {
    let mut config = DecoderConfig::read(cfg)?;
    let bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
    config.biases = Biases {
        qkv: bias,
        o: bias,
        mlp: false,
    };
    config.qk_norm = true;
    full_attention_only(cfg, config.num_layers)?;
    Ok(config)
}

/// Refuses sliding-window layers (`use_sliding_window`, a `sliding_attention` entry of
/// `layer_types`), which this decoder does not build yet; checks `layer_types` has a known
/// entry per layer.
pub fn full_attention_only(cfg: &ConfigReader<'_>, num_layers: usize) -> Result<()> {
    if cfg.opt_bool("use_sliding_window")? == Some(true) {
        return Err(cfg.error(
            "use_sliding_window",
            "sliding-window attention is not supported yet; expected false",
        ));
    }
    let Some(types) = cfg.get("layer_types") else {
        return Ok(());
    };
    let types = types
        .as_array()
        .ok_or_else(|| cfg.error("layer_types", format!("expected a list, found {types}")))?;
    if types.len() != num_layers {
        return Err(cfg.error(
            "layer_types",
            format!(
                "has {} entries; expected one per layer (num_hidden_layers {num_layers})",
                types.len()
            ),
        ));
    }
    for (i, t) in types.iter().enumerate() {
        match t.as_str() {
            Some("full_attention") => {}
            Some("sliding_attention") => {
                return Err(cfg.error(
                    &format!("layer_types[{i}]"),
                    "`sliding_attention` is not supported yet; expected full_attention",
                ))
            }
            _ => {
                return Err(cfg.error(
                    &format!("layer_types[{i}]"),
                    format!(
                        "{t} is not a layer type; expected full_attention or sliding_attention"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// A Qwen3 model: one decoder role.
#[derive(Clone, Debug)]
pub struct Qwen3Model {
    /// The decoder's config.
    pub config: DecoderConfig,
}

impl ModelSpec for Qwen3Model {
    fn architecture(&self) -> &'static str {
        "Qwen3ForCausalLM"
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

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::GraphRole;
    use std::path::Path;

    fn config() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 100, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "layer_types": ["full_attention", "full_attention"], "use_sliding_window": false
        })
    }

    fn parse(cfg: &serde_json::Value) -> crate::Result<Box<dyn crate::arch::ModelSpec>> {
        Registry::builtin().parse_config(Path::new("m/config.json"), cfg)
    }

    #[test]
    fn head_dim_is_the_configs_and_q_k_are_normed() {
        let spec = parse(&config()).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!((c.head_dim, c.qk_norm, c.biases.qkv), (32, true, false));
        let g = spec.build(GraphRole::Decoder, &Default::default()).unwrap();
        let params = g.params();
        for key in [
            "model.layers.1.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
        ] {
            assert!(params.contains_key(key), "{key}");
        }
    }

    #[test]
    fn sliding_layers_and_unknown_layer_types_name_the_entry() {
        let mut cfg = config();
        cfg["layer_types"][1] = "sliding_attention".into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("layer_types[1]") && err.contains("sliding_attention"),
            "{err}"
        );
        cfg["layer_types"][1] = "chunked_attention".into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("layer_types[1]") && err.contains("full_attention"),
            "{err}"
        );
        cfg["layer_types"] = serde_json::json!(["full_attention"]);
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(err.contains("one per layer"), "{err}");
    }
}
