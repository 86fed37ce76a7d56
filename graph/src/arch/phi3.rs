//! `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini): the Llama decoder with fused projections,
//! `self_attn.qkv_proj` (q, k and v rows in turn) and `mlp.gate_up_proj` (gate, then up rows),
//! partial rotary (`partial_rotary_factor`) and longrope.
//!
//! A GGUF file (`general.architecture` `phi3`) keeps the fused weights as the checkpoint has
//! them (`attn_qkv`, `ffn_up`): they are renamed to the fused Hugging Face names first.
//!
//! The fused weights are split into the Llama names in weight preparation: the graph then is
//! the Llama family's, three matmuls reading one activation where one would do. Split, each
//! weight keeps its own format and its matmul its own plan; fusing matmuls that share an input
//! is the compiler's to do for every family alike, not this architecture's.

use super::config::ConfigReader;
use super::decoder::DecoderConfig;
use super::llama::{read_llama, LlamaFamilyHooks};
use super::{Architecture, ModelSpec};
use crate::deployment::DeploymentHooks;
use crate::weights::StateDict;
use crate::{DeploymentConfig, GraphRole, Result};
use std::sync::Arc;

/// The Phi-3 architecture.
pub struct Phi3;

impl Architecture for Phi3 {
    fn name(&self) -> &'static str {
        "Phi3ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Phi-3 decoder: Llama layout with fused qkv and gate/up projections, partial rotary, longrope"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = read_llama(cfg)?;
        config.layer_windows = super::decoder::read_layer_windows(cfg, config.num_layers, true)?;
        Ok(Box::new(Phi3Model { config }))
    }
}

/// A Phi-3 model: one decoder role.
#[derive(Clone, Debug)]
pub struct Phi3Model {
    /// The decoder's config.
    pub config: DecoderConfig,
}

impl ModelSpec for Phi3Model {
    fn architecture(&self) -> &'static str {
        "Phi3ForCausalLM"
    }
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder]
    }
    fn deployment(&self) -> DeploymentConfig {
        let c = &self.config;
        DeploymentConfig::with_hooks(Arc::new(Phi3Hooks {
            llama: LlamaFamilyHooks::new(c),
            q_rows: c.num_heads * c.head_dim,
            kv_rows: c.num_kv_heads * c.head_dim,
            ffn: c.intermediate_size,
        }))
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
}

/// Phi-3's weight preparation: GGUF names mapped to Hugging Face's, the fused projections split
/// by rows, then the Llama family's.
#[derive(Debug)]
struct Phi3Hooks {
    llama: LlamaFamilyHooks,
    q_rows: usize,
    kv_rows: usize,
    ffn: usize,
}

impl DeploymentHooks for Phi3Hooks {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        let weights = if super::gguf::is_gguf_layout(&weights) {
            let (heads, kv_heads) = (self.llama.num_heads, self.llama.num_kv_heads);
            super::gguf::gguf_to_hf(weights, heads, kv_heads, super::gguf::GgufLayout::PHI3)?
        } else {
            weights
        };
        let (q, kv, f) = (self.q_rows, self.kv_rows, self.ffn);
        let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)];
        let gate_up = [("gate_proj", f), ("up_proj", f)];
        let mut out = StateDict::new();
        for (key, w) in weights {
            let (prefix, parts): (_, &[(&str, usize)]) =
                if let Some(p) = key.strip_suffix("self_attn.qkv_proj.weight") {
                    (format!("{p}self_attn."), &qkv)
                } else if let Some(p) = key.strip_suffix("mlp.gate_up_proj.weight") {
                    (format!("{p}mlp."), &gate_up)
                } else {
                    out.insert(key, w);
                    continue;
                };
            let total: usize = parts.iter().map(|p| p.1).sum();
            if w.shape.first() != Some(&total) {
                return Err(crate::Error::WeightDtype {
                    key,
                    message: format!(
                        "has shape {:?}; expected {total} rows ({})",
                        w.shape,
                        parts
                            .iter()
                            .map(|(n, r)| format!("{n} {r}"))
                            .collect::<Vec<_>>()
                            .join(" + ")
                    ),
                });
            }
            let mut at = 0;
            for &(name, rows) in parts {
                out.insert(
                    format!("{prefix}{name}.weight"),
                    w.rows(at..at + rows, &key)?,
                );
                at += rows;
            }
        }
        self.llama.prepare_weights(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::weights::{StateDict, WeightTensor};
    use crate::GraphRole;
    use std::path::Path;

    #[test]
    fn fused_projections_split_by_rows_and_a_wrong_row_count_names_the_weight() {
        let cfg = serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "hidden_size": 8, "intermediate_size": 6,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 10, "partial_rotary_factor": 0.5
        });
        let spec = Registry::builtin()
            .parse_config(Path::new("config.json"), &cfg)
            .unwrap();
        assert_eq!(
            spec.decoder(GraphRole::Decoder).unwrap().rotary_dim,
            Some(2)
        );
        let rows = |n: usize| {
            WeightTensor::from_f32(
                vec![n, 8],
                &(0..n * 8).map(|i| i as f32).collect::<Vec<_>>(),
            )
        };
        let mut w = StateDict::new();
        // q 2 heads × 4, k and v 1 × 4: 16 rows; gate and up 6 each.
        w.insert("model.layers.0.self_attn.qkv_proj.weight", rows(16));
        w.insert("model.layers.0.mlp.gate_up_proj.weight", rows(12));
        let out = spec.deployment().prepare_weights(w).unwrap();
        let first = |k: &str| out.get(k).unwrap().to_f32(k).unwrap()[0];
        assert_eq!(first("model.layers.0.self_attn.q_proj.weight"), 0.0);
        assert_eq!(first("model.layers.0.self_attn.k_proj.weight"), 64.0);
        assert_eq!(first("model.layers.0.self_attn.v_proj.weight"), 96.0);
        assert_eq!(first("model.layers.0.mlp.up_proj.weight"), 48.0);
        let mut bad = StateDict::new();
        bad.insert("model.layers.0.self_attn.qkv_proj.weight", rows(15));
        let err = spec
            .deployment()
            .prepare_weights(bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("qkv_proj") && err.contains("16 rows"), "{err}");
    }

    /// microsoft/Phi-4-mini-instruct's config.json (its factor lists shortened to their
    /// length: 48 per list, one per rotated pair): it parses, its 262144 window over a 131072
    /// context is full attention, and 96 of each head's 128 dims rotate.
    #[test]
    fn the_phi4_mini_config_parses() {
        let short: Vec<f64> = (0..48).map(|i| 1.0 + i as f64 / 100.0).collect();
        let long: Vec<f64> = (0..48).map(|i| 1.0 + i as f64).collect();
        let cfg = serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "attention_bias": false,
            "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999,
            "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072,
            "initializer_range": 0.02, "intermediate_size": 8192, "interpolate_factor": 1,
            "lm_head_bias": false, "max_position_embeddings": 131072, "mlp_bias": false,
            "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "original_max_position_embeddings": 4096,
            "pad_token_id": 199999, "partial_rotary_factor": 0.75, "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"long_factor": long, "short_factor": short, "type": "longrope"},
            "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16", "transformers_version": "4.45.0", "use_cache": true,
            "vocab_size": 200064
        });
        let spec = Registry::builtin()
            .parse_config(Path::new("config.json"), &cfg)
            .unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert!(c.layer_windows.is_empty());
        assert_eq!(c.rotary_dim, Some(96));
        assert!(matches!(
            &c.rope.scaling,
            crate::arch::rope::RopeScaling::Longrope { long_factor, .. } if long_factor.len() == 48
        ));
    }
}
