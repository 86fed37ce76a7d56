//! `Qwen3ForCausalLM`: the Llama decoder with an explicit `head_dim` and per-head RMSNorms of
//! q and k before rotary (`self_attn.q_norm`, `self_attn.k_norm`); `Qwen3MoeForCausalLM`: the
//! same attention over sparse MoE MLPs (softmax router, top-k optionally renormalized, SwiGLU
//! experts `moe_intermediate_size` wide), deployed with expert parallelism as Mixtral is.

use super::config::ConfigReader;
use super::decoder::{Biases, DecoderConfig, MoeConfig, MoeNaming};
use super::llama::DecoderModel;
use super::mixtral::MixtralModel;
use super::{Architecture, ModelSpec};
use crate::{GraphRole, Result};

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
        Ok(Box::new(DecoderModel::unpermuted(
            self.name(),
            read_qwen3(cfg)?,
        )))
    }
}

/// The Qwen3-MoE architecture.
pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn name(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Qwen3-MoE decoder: Qwen3 attention, sparse MoE MLPs (top-k routing, dense layers where configured), expert parallelism"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder, GraphRole::EpInit]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = read_qwen3(cfg)?;
        // transformers 4 writes `num_experts`, 5 `num_local_experts`.
        let key = if cfg.get("num_local_experts").is_some() {
            "num_local_experts"
        } else {
            "num_experts"
        };
        let num_experts = cfg.positive(key)?;
        let top_k = cfg.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(cfg.error(
                "num_experts_per_tok",
                format!("is {top_k}; expected at most {key} ({num_experts})"),
            ));
        }
        let step = cfg.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(cfg.error("decoder_sparse_step", "is 0; expected a positive integer"));
        }
        let only = match cfg.get("mlp_only_layers") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|l| l.as_u64().map(|l| l as usize)).collect())
                .ok_or_else(|| {
                    cfg.error(
                        "mlp_only_layers",
                        format!("expected a list of layer indices, found {v}"),
                    )
                })?,
        };
        if let Some(&l) = only.iter().find(|&&l| l >= config.num_layers) {
            return Err(cfg.error(
                "mlp_only_layers",
                format!(
                    "names layer {l}; expected layers below num_hidden_layers ({})",
                    config.num_layers
                ),
            ));
        }
        let dense_layers = (0..config.num_layers)
            .filter(|l| only.contains(l) || !(l + 1).is_multiple_of(step))
            .collect();
        config.moe = Some(MoeConfig {
            expert_intermediate_size: Some(cfg.positive("moe_intermediate_size")?),
            dense_layers,
            renormalize: cfg.opt_bool("norm_topk_prob")?.unwrap_or(false),
            naming: MoeNaming::Qwen,
            ..MoeConfig::new(num_experts, top_k)
        });
        Ok(Box::new(MixtralModel {
            architecture: "Qwen3MoeForCausalLM",
            config,
            gguf_qk_permuted: false,
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
    config.layer_windows = super::decoder::read_layer_windows(cfg, config.num_layers, false)?;
    Ok(config)
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
    fn sliding_layers_take_the_window_and_unknown_layer_types_name_the_entry() {
        let mut cfg = config();
        cfg["layer_types"][1] = "sliding_attention".into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("sliding_window") && err.contains("layer_types[1]"),
            "{err}"
        );
        cfg["sliding_window"] = 8.into();
        let spec = parse(&cfg).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(c.layer_windows, vec![None, Some(8)]);
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

    #[test]
    fn moe_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let mut cfg = config();
        cfg["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
        cfg["num_hidden_layers"] = 4.into();
        cfg["layer_types"] = serde_json::Value::Null;
        cfg["num_experts"] = 4.into();
        cfg["num_experts_per_tok"] = 2.into();
        cfg["moe_intermediate_size"] = 16.into();
        cfg["norm_topk_prob"] = true.into();
        cfg["mlp_only_layers"] = serde_json::json!([0]);
        cfg["decoder_sparse_step"] = 2.into();
        let spec = parse(&cfg).unwrap();
        let moe = spec
            .decoder(GraphRole::Decoder)
            .unwrap()
            .moe
            .clone()
            .unwrap();
        // Layer 0 is listed; layer 2's (2 + 1) is not a multiple of the step.
        assert_eq!(moe.dense_layers, vec![0, 2]);
        assert_eq!(
            (moe.expert_intermediate_size, moe.renormalize),
            (Some(16), true)
        );
        let g = spec.build(GraphRole::Decoder, &Default::default()).unwrap();
        let params = g.params();
        assert!(params.contains_key("model.layers.3.mlp.experts.3.down_proj.weight"));
        assert!(params.contains_key("model.layers.2.mlp.gate_proj.weight"));
        cfg["mlp_only_layers"] = serde_json::json!([7]);
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("mlp_only_layers") && err.contains("layer 7"),
            "{err}"
        );
        cfg["mlp_only_layers"] = serde_json::json!([0]);
        cfg["num_experts_per_tok"] = 5.into();
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("num_experts_per_tok") && err.contains("num_experts (4)"),
            "{err}"
        );
    }
}
