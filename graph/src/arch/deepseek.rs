//! `DeepseekV3ForCausalLM` and `DeepseekV2ForCausalLM` (DeepSeek-V2/V3/R1, Kimi K2 and their
//! kin): multi-head latent attention over a compressed KV cache ([`super::mla`]), a dense first
//! `first_k_dense_replace` layers, then MoE layers of routed experts under a group-limited
//! router with shared experts beside them.
//!
//! **Weight preparation** turns the checkpoint's attention weights into the ones the absorbed
//! graph reads, each an exact rearrangement of rows:
//! - `q_b_proj` (or `q_proj`) `[H·(N+R), in]` into `q_b_proj_nope [H·N, in]` and
//!   `q_b_proj_rope [H·R, in]`;
//! - `kv_a_proj_with_mqa` `[C+R, hidden]` (and its bias) into `kv_a_proj [C, hidden]` and
//!   `kv_a_proj_rope [R, hidden]`;
//! - `kv_b_proj` `[H·(N+V), C]` into `kv_b_proj_k [H, C, N]` (each head's key rows,
//!   transposed: absorbed into the query) and `kv_b_proj_v [H, V, C]`;
//! - interleaved rope rows (`rope_interleave`, every V2) reordered to rotate-half, the
//!   permutation transformers applies to the activations (`apply_rotary_pos_emb_interleave`):
//!   element `2j + i` moves to `i·R/2 + j`;
//! - the multi-token-prediction layers (`model.layers.{num_hidden_layers}...`) dropped: the
//!   graph has no MTP head;
//! - V2's router has no score-correction bias: a zero one is added.
//!
//! **The score scale** is `(N + R)^-1/2`, times `mscale²` with yarn where `mscale_all_dim` is
//! set: `mscale = 0.1 · mscale_all_dim · ln(factor) + 1`, as both transformers' V3 and
//! DeepSeek's own code compute it.

use super::config::ConfigReader;
use super::decoder::{Biases, DecoderConfig, GroupedRouter, MlaConfig, MoeConfig, MoeNaming};
use super::llama::LlamaFamilyHooks;
use super::mixtral::MixtralHooks;
use super::{Architecture, BuildOptions, ModelSpec};
use crate::deployment::DeploymentHooks;
use crate::ir::{GroupScore, RouterScoring};
use crate::weights::{StateDict, WeightTensor};
use crate::{DeploymentConfig, Error, GraphRole, ModuleRuntime, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The DeepSeek-V3 architecture.
pub struct DeepseekV3;

/// The DeepSeek-V2 architecture.
pub struct DeepseekV2;

impl Architecture for DeepseekV3 {
    fn name(&self) -> &'static str {
        "DeepseekV3ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "DeepSeek-V3 decoder: multi-head latent attention, sigmoid group-limited MoE with shared experts"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder, GraphRole::EpInit]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        Ok(Box::new(read_deepseek(cfg, true)?))
    }
}

impl Architecture for DeepseekV2 {
    fn name(&self) -> &'static str {
        "DeepseekV2ForCausalLM"
    }
    fn description(&self) -> &'static str {
        "DeepSeek-V2 decoder: multi-head latent attention, softmax (group-limited) MoE with shared experts"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder, GraphRole::EpInit]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        Ok(Box::new(read_deepseek(cfg, false)?))
    }
}

/// Reads a DeepSeek config: V3 (`v3`) or V2.
pub fn read_deepseek(cfg: &ConfigReader<'_>, v3: bool) -> Result<DeepseekModel> {
    let architecture = if v3 {
        "DeepseekV3ForCausalLM"
    } else {
        "DeepseekV2ForCausalLM"
    };
    // The decoder's `head_dim` is the rope dims (what rotates): transformers sets it so, and
    // a config without it must not have it derived from hidden_size.
    let rope = cfg.positive("qk_rope_head_dim")?;
    if !rope.is_multiple_of(2) {
        return Err(cfg.error(
            "qk_rope_head_dim",
            format!("is {rope}; rotary embedding needs an even count"),
        ));
    }
    let mut fields = cfg.fields().clone();
    fields.insert("head_dim".into(), rope.into());
    let patched = Value::Object(fields);
    let mut config = DecoderConfig::read(&ConfigReader::nested(cfg.file(), "", &patched)?)?;
    let q_lora_rank = match cfg.opt_usize("q_lora_rank")? {
        Some(0) => {
            return Err(cfg.error(
                "q_lora_rank",
                "is 0; expected a positive rank, or null for a direct q_proj",
            ))
        }
        r => r,
    };
    let kv_lora_rank = cfg.positive("kv_lora_rank")?;
    let nope = cfg.positive("qk_nope_head_dim")?;
    let v_head_dim = cfg.positive("v_head_dim")?;
    // V2 checkpoints are always interleaved; V3 says so (transformers' default: true).
    let rope_interleave = if v3 {
        cfg.opt_bool("rope_interleave")?.unwrap_or(true)
    } else {
        true
    };
    let mscale = yarn_mscale(cfg)?;
    let softmax_scale = ((nope + rope) as f64).powf(-0.5) * mscale * mscale;
    config.head_dim = rope;
    config.rotary_dim = None;
    let attention_bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
    config.biases = Biases {
        qkv: attention_bias,
        o: attention_bias,
        mlp: false,
    };
    config.mla = Some(MlaConfig {
        q_lora_rank,
        kv_lora_rank,
        qk_rope_head_dim: rope,
        qk_nope_head_dim: nope,
        v_head_dim,
        rope_interleave,
        softmax_scale: softmax_scale as f32,
    });
    config.moe = read_moe(cfg, v3, config.num_layers)?;
    Ok(DeepseekModel {
        architecture,
        config,
    })
}

/// Yarn's `mscale` for the score scale: `0.1 · mscale_all_dim · ln(factor) + 1` where the rope
/// type is not the default, `mscale_all_dim` is non-zero and `factor` above 1; else 1.
fn yarn_mscale(cfg: &ConfigReader<'_>) -> Result<f64> {
    let params = match cfg.child("rope_parameters")? {
        Some(p) => Some(p),
        None => cfg.child("rope_scaling")?,
    };
    let Some(p) = params else {
        return Ok(1.0);
    };
    let kind = match p.opt_str("rope_type")? {
        Some(k) => k,
        None => p.opt_str("type")?.unwrap_or("default"),
    };
    let all_dim = p.opt_f64("mscale_all_dim")?.unwrap_or(0.0);
    let factor = p.opt_f64("factor")?.unwrap_or(1.0);
    Ok(if kind != "default" && all_dim != 0.0 && factor > 1.0 {
        0.1 * all_dim * factor.ln() + 1.0
    } else {
        1.0
    })
}

/// The MoE layers' settings, `None` where the model has no routed experts.
fn read_moe(cfg: &ConfigReader<'_>, v3: bool, num_layers: usize) -> Result<Option<MoeConfig>> {
    let Some(experts) = cfg.opt_usize("n_routed_experts")? else {
        return Ok(None);
    };
    if experts == 0 {
        return Err(cfg.error(
            "n_routed_experts",
            "is 0; expected a positive count, or null for a dense model",
        ));
    }
    let top_k = cfg.positive("num_experts_per_tok")?;
    let width = cfg.positive("moe_intermediate_size")?;
    if let Some(freq) = cfg.opt_usize("moe_layer_freq")? {
        if freq != 1 {
            return Err(cfg.error(
                "moe_layer_freq",
                format!("is {freq}; only 1 (every layer after the dense ones) is supported"),
            ));
        }
    }
    let dense = cfg.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    let shared = cfg.opt_usize("n_shared_experts")?.unwrap_or(0);
    let scale = cfg.opt_f64("routed_scaling_factor")?.unwrap_or(1.0);
    if !(scale.is_finite() && scale > 0.0) {
        return Err(cfg.error(
            "routed_scaling_factor",
            format!("is {scale}; expected a positive number"),
        ));
    }
    let (scoring, group_score, grouped, renormalize) = if v3 {
        if let Some(f) = cfg.opt_str("scoring_func")? {
            if f != "sigmoid" {
                return Err(cfg.error(
                    "scoring_func",
                    format!("`{f}` is not supported for DeepSeek-V3; expected sigmoid"),
                ));
            }
        }
        if let Some(m) = cfg.opt_str("topk_method")? {
            if m != "noaux_tc" {
                return Err(cfg.error(
                    "topk_method",
                    format!("`{m}` is not supported for DeepSeek-V3; expected noaux_tc"),
                ));
            }
        }
        let norm = cfg.opt_bool("norm_topk_prob")?.unwrap_or(true);
        (RouterScoring::Sigmoid, GroupScore::TopTwoSum, true, norm)
    } else {
        if let Some(f) = cfg.opt_str("scoring_func")? {
            if f != "softmax" {
                return Err(cfg.error(
                    "scoring_func",
                    format!("`{f}` is not supported for DeepSeek-V2; expected softmax"),
                ));
            }
        }
        if cfg.opt_bool("norm_topk_prob")? == Some(true) {
            return Err(cfg.error(
                "norm_topk_prob",
                "is true: DeepSeek-V2 then leaves out routed_scaling_factor, which maxc does not model; expected false",
            ));
        }
        let grouped = match cfg.opt_str("topk_method")?.unwrap_or("greedy") {
            "greedy" => false,
            "group_limited_greedy" => true,
            m => {
                return Err(cfg.error(
                    "topk_method",
                    format!(
                    "`{m}` is not a DeepSeek-V2 method; expected greedy or group_limited_greedy"
                ),
                ))
            }
        };
        (RouterScoring::Softmax, GroupScore::Max, grouped, false)
    };
    let (n_group, topk_group) = if grouped {
        let n_group = cfg.opt_usize("n_group")?.unwrap_or(1);
        if n_group == 0 || !experts.is_multiple_of(n_group) {
            return Err(cfg.error(
                "n_group",
                format!("is {n_group}; expected a divisor of n_routed_experts ({experts})"),
            ));
        }
        let topk_group = cfg.opt_usize("topk_group")?.unwrap_or(1);
        if topk_group == 0 || topk_group > n_group {
            return Err(cfg.error(
                "topk_group",
                format!("is {topk_group}; expected 1 to n_group ({n_group})"),
            ));
        }
        if group_score == GroupScore::TopTwoSum && experts / n_group < 2 {
            return Err(cfg.error(
                "n_group",
                format!("is {n_group}: groups of {} expert(s), but a group's score is the sum of its top two; expected at most {} groups", experts / n_group, experts / 2),
            ));
        }
        (n_group, topk_group)
    } else {
        (1, 1)
    };
    let reachable = topk_group * (experts / n_group);
    if top_k > reachable {
        return Err(cfg.error(
            "num_experts_per_tok",
            format!("is {top_k}; expected at most the {reachable} experts of the topk_group ({topk_group}) groups kept"),
        ));
    }
    Ok(Some(MoeConfig {
        expert_intermediate_size: Some(width),
        dense_layers: (0..dense.min(num_layers)).collect(),
        renormalize,
        naming: MoeNaming::Qwen,
        grouped_router: Some(GroupedRouter {
            scoring,
            group_score,
            n_group,
            topk_group,
            scale: scale as f32,
        }),
        shared_intermediate_size: (shared > 0).then_some(width * shared),
        ..MoeConfig::new(experts, top_k)
    }))
}

/// A DeepSeek model: a decoder role, and the EP init role where it has routed experts.
#[derive(Clone, Debug)]
pub struct DeepseekModel {
    /// The architecture's name.
    pub architecture: &'static str,
    /// The decoder's config (`mla` set).
    pub config: DecoderConfig,
}

impl ModelSpec for DeepseekModel {
    fn architecture(&self) -> &'static str {
        self.architecture
    }
    fn roles(&self) -> Vec<GraphRole> {
        match self.config.moe {
            Some(_) => vec![GraphRole::Decoder, GraphRole::EpInit],
            None => vec![GraphRole::Decoder],
        }
    }
    fn deployment(&self) -> DeploymentConfig {
        let c = &self.config;
        let moe = c.moe.as_ref().map(|m| {
            MixtralHooks::new(
                LlamaFamilyHooks::new(c),
                m.num_experts,
                m.top_k,
                c.hidden_size,
            )
        });
        let mut d = DeploymentConfig::with_hooks(Arc::new(DeepseekHooks {
            llama: LlamaFamilyHooks::new(c),
            moe,
            config: c.clone(),
            v2: self.architecture == "DeepseekV2ForCausalLM",
        }));
        if c.moe.is_some() {
            d.expert_parallel_communication = true;
            d.export_ep_init = true;
        }
        d
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
    fn build(&self, role: GraphRole, opts: &BuildOptions) -> Result<crate::Graph> {
        super::mixtral::build_moe_role(&self.config, role, opts)
    }
}

/// DeepSeek's deployment hooks: the weight preparation above, then the Llama family's; expert
/// parallelism as Mixtral's.
#[derive(Debug)]
struct DeepseekHooks {
    llama: LlamaFamilyHooks,
    moe: Option<MixtralHooks>,
    config: DecoderConfig,
    v2: bool,
}

impl DeploymentHooks for DeepseekHooks {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        let c = &self.config;
        let m = c
            .mla
            .as_ref()
            .ok_or_else(|| Error::Eval("DeepSeek without MLA".into()))?;
        let (h, lat, r, n, v) = (
            c.num_heads,
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.qk_nope_head_dim,
            m.v_head_dim,
        );
        let weights = if super::gguf::is_gguf_layout(&weights) {
            super::gguf::gguf_to_hf(weights, h, h, super::gguf::GgufLayout::default())?
        } else {
            weights
        };
        let mut out = StateDict::new();
        for (key, w) in weights {
            // Multi-token-prediction layers past the decoder's last.
            if let Some(rest) = key.strip_prefix("model.layers.") {
                let layer = rest.split('.').next().and_then(|l| l.parse::<usize>().ok());
                if layer.is_some_and(|l| l >= c.num_layers) {
                    continue;
                }
            }
            let split = |suffix: &str| key.strip_suffix(suffix).map(str::to_string);
            if let Some(p) =
                split("self_attn.q_b_proj.weight").or_else(|| split("self_attn.q_proj.weight"))
            {
                let name = if key.ends_with("q_b_proj.weight") {
                    "q_b_proj"
                } else {
                    "q_proj"
                };
                let per = n + r;
                let heads = (0..h).map(|i| i * per..i * per + n).collect::<Vec<_>>();
                let ropes = (0..h)
                    .map(|i| i * per + n..(i + 1) * per)
                    .collect::<Vec<_>>();
                check_rows(
                    &w,
                    h * per,
                    &key,
                    &format!("{h} heads × (nope {n} + rope {r})"),
                )?;
                out.insert(
                    format!("{p}self_attn.{name}_nope.weight"),
                    gather_rows(&w, &heads, &key)?,
                );
                let rope = gather_rows(&w, &ropes, &key)?;
                out.insert(
                    format!("{p}self_attn.{name}_rope.weight"),
                    self.rope_rows(rope, h, &key)?,
                );
            } else if let Some((p, leaf)) = split("self_attn.kv_a_proj_with_mqa.weight")
                .map(|p| (p, "weight"))
                .or_else(|| split("self_attn.kv_a_proj_with_mqa.bias").map(|p| (p, "bias")))
            {
                check_rows(&w, lat + r, &key, &format!("kv_lora_rank {lat} + rope {r}"))?;
                out.insert(
                    format!("{p}self_attn.kv_a_proj.{leaf}"),
                    gather_rows(&w, std::slice::from_ref(&(0..lat)), &key)?,
                );
                let rope = gather_rows(&w, std::slice::from_ref(&(lat..lat + r)), &key)?;
                out.insert(
                    format!("{p}self_attn.kv_a_proj_rope.{leaf}"),
                    self.rope_rows(rope, 1, &key)?,
                );
            } else if let Some(p) = split("self_attn.kv_b_proj.weight") {
                let per = n + v;
                check_rows(
                    &w,
                    h * per,
                    &key,
                    &format!("{h} heads × (nope {n} + v {v})"),
                )?;
                if w.shape.get(1) != Some(&lat) {
                    return Err(Error::WeightDtype {
                        key,
                        message: format!(
                            "has shape {:?}; expected {lat} columns (kv_lora_rank)",
                            w.shape
                        ),
                    });
                }
                let k_rows = (0..h).map(|i| i * per..i * per + n).collect::<Vec<_>>();
                let v_rows = (0..h)
                    .map(|i| i * per + n..(i + 1) * per)
                    .collect::<Vec<_>>();
                let k = gather_rows(&w, &k_rows, &key)?;
                out.insert(
                    format!("{p}self_attn.kv_b_proj_k.weight"),
                    transpose_heads(&k, h, n, lat, &key)?,
                );
                let vw = gather_rows(&w, &v_rows, &key)?;
                let vw = WeightTensor::from_bytes(vw.dtype, vec![h, v, lat], vw.bytes().to_vec())?;
                out.insert(format!("{p}self_attn.kv_b_proj_v.weight"), vw);
            } else if key.ends_with("self_attn.kv_b_proj_k.weight")
                || key.ends_with("self_attn.kv_b_proj_v.weight")
            {
                // Already split (a GGUF file's attn_k_b / attn_v_b); the per-head matmuls read
                // floats, so a block type is widened.
                let w = if w.dtype.is_quantized() {
                    WeightTensor::from_f32(w.shape.clone(), &w.to_f32(&key)?)
                } else {
                    w
                };
                out.insert(key, w);
            } else {
                out.insert(key, w);
            }
        }
        if self.v2 {
            if let Some(moe) = &c.moe {
                for layer in (0..c.num_layers).filter(|l| !moe.dense_layers.contains(l)) {
                    let key = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
                    if out.get(&key).is_none() {
                        out.insert(
                            key,
                            WeightTensor::from_f32(
                                vec![moe.num_experts],
                                &vec![0.0; moe.num_experts],
                            ),
                        );
                    }
                }
            }
        }
        self.llama.prepare_weights(out)
    }

    /// Mixtral's expert parallelism, and the `takes_batch_context_lengths` hook: set where the
    /// attention is computed decompressed, whose kernels size each sequence's expansion of its
    /// cached latents by it (without a device-to-host copy of the cache lengths).
    fn apply_runtime(
        &self,
        mut config: DeploymentConfig,
        runtime: &ModuleRuntime,
    ) -> Result<DeploymentConfig> {
        config.takes_batch_context_lengths =
            runtime.mla_attention == crate::MlaAttention::Decompressed;
        match &self.moe {
            Some(m) => m.apply_runtime(config, runtime),
            None => Ok(config),
        }
    }

    /// Mixtral's records, and what DeepSeek adds: the shared experts (replicated on every
    /// rank, outside the exchange) and the router.
    fn export_records(&self, runtime: &ModuleRuntime) -> BTreeMap<String, Value> {
        let (Some(m), Some(moe)) = (&self.moe, &self.config.moe) else {
            return BTreeMap::new();
        };
        let mut r = m.export_records(runtime);
        let shared = moe.num_shared_experts(self.config.intermediate_size);
        r.insert("moe.num_shared_experts".into(), shared.into());
        r.insert(
            "moe.shared_intermediate_size".into(),
            moe.shared_intermediate_size.unwrap_or(0).into(),
        );
        if let Some(g) = &moe.grouped_router {
            r.insert(
                "moe.router".into(),
                serde_json::json!({
                    "scoring": format!("{:?}", g.scoring).to_lowercase(),
                    "group_score": match g.group_score {
                        GroupScore::TopTwoSum => "top_two_sum",
                        GroupScore::Max => "max",
                    },
                    "n_group": g.n_group,
                    "topk_group": g.topk_group,
                    "routed_scaling_factor": g.scale,
                    "renormalize": moe.renormalize,
                }),
            );
        }
        if shared > 0 {
            r.insert("ep.shared_experts".into(), "replicated".into());
        }
        r
    }
}

impl DeepseekHooks {
    /// Rope rows of `heads` heads reordered from interleaved pairs to rotate-half, where the
    /// checkpoint interleaves them.
    fn rope_rows(&self, w: WeightTensor, heads: usize, key: &str) -> Result<WeightTensor> {
        match &self.config.mla {
            Some(m) if m.rope_interleave => super::gguf::unpermute_rows(&w, heads, key),
            _ => Ok(w),
        }
    }
}

fn check_rows(w: &WeightTensor, rows: usize, key: &str, what: &str) -> Result<()> {
    if w.shape.first() == Some(&rows) {
        return Ok(());
    }
    Err(Error::WeightDtype {
        key: key.into(),
        message: format!("has shape {:?}; expected {rows} rows ({what})", w.shape),
    })
}

/// The rows `ranges` of `w`, in order, as one tensor (rows of any dtype are whole bytes).
fn gather_rows(
    w: &WeightTensor,
    ranges: &[std::ops::Range<usize>],
    key: &str,
) -> Result<WeightTensor> {
    let rows = *w.shape.first().unwrap_or(&0);
    let row_bytes = w.bytes().len() / rows.max(1);
    let mut bytes = Vec::new();
    let mut count = 0;
    for r in ranges {
        if r.end > rows {
            return Err(Error::WeightDtype {
                key: key.into(),
                message: format!(
                    "cannot take rows {}..{} of a tensor of shape {:?}",
                    r.start, r.end, w.shape
                ),
            });
        }
        bytes.extend_from_slice(&w.bytes()[r.start * row_bytes..r.end * row_bytes]);
        count += r.len();
    }
    let mut shape = w.shape.clone();
    if shape.is_empty() {
        shape.push(count);
    } else {
        shape[0] = count;
    }
    WeightTensor::from_bytes(w.dtype, shape, bytes)
}

/// `[heads·rows, cols]` as `[heads, cols, rows]`: each head's block transposed. Scalar dtypes
/// only (a block type's rows cannot be cut into columns).
fn transpose_heads(
    w: &WeightTensor,
    heads: usize,
    rows: usize,
    cols: usize,
    key: &str,
) -> Result<WeightTensor> {
    if w.dtype.is_quantized() {
        return Err(Error::WeightDtype {
            key: key.into(),
            message: format!("is {}: its key rows are transposed for the absorbed attention, which needs a float dtype", w.dtype),
        });
    }
    let size = w.dtype.size();
    let src = w.bytes();
    let mut out = vec![0u8; src.len()];
    for h in 0..heads {
        for i in 0..rows {
            for j in 0..cols {
                let from = ((h * rows + i) * cols + j) * size;
                let to = ((h * cols + j) * rows + i) * size;
                out[to..to + size].copy_from_slice(&src[from..from + size]);
            }
        }
    }
    WeightTensor::from_bytes(w.dtype, vec![heads, cols, rows], out)
}

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::GraphRole;
    use serde_json::{json, Value};
    use std::path::Path;

    fn v3() -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "vocab_size": 32, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 2,
            "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.5
        })
    }

    fn parse(cfg: &Value) -> crate::Result<Box<dyn crate::arch::ModelSpec>> {
        Registry::builtin().parse_config(Path::new("config.json"), cfg)
    }

    fn error_with(key: &str, value: Value) -> String {
        let mut cfg = v3();
        cfg[key] = value;
        parse(&cfg).unwrap_err().to_string()
    }

    #[test]
    fn a_v3_config_resolves_latent_attention_and_grouped_routing() {
        let spec = parse(&v3()).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        let m = c.mla.as_ref().unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, c.head_dim),
            (Some(24), 16, 8)
        );
        assert!((m.softmax_scale - 0.25).abs() < 1e-6, "(8 + 8)^-1/2");
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.dense_layers, vec![0]);
        assert_eq!(moe.shared_intermediate_size, Some(32));
        let g = moe.grouped_router.as_ref().unwrap();
        assert_eq!((g.n_group, g.topk_group, g.scale), (4, 2, 2.5));
        let kv = c.kv_layout(16, maxc_schema::KvDtype::F32);
        assert_eq!((kv.planes, kv.num_kv_heads, kv.head_dim), (1, 1, 24));
        assert!(spec.deployment().export_ep_init);
    }

    /// The `takes_batch_context_lengths` hook is set where the graph reads the input: with
    /// the decompressed attention, which sizes each sequence's expansion by it.
    #[test]
    fn the_context_lengths_hook_follows_the_attention_form() {
        use crate::arch::BuildOptions;
        use crate::{MlaAttention, ModuleRuntime};
        let spec = parse(&v3()).unwrap();
        for (form, hooked) in [
            (MlaAttention::Absorbed, false),
            (MlaAttention::Decompressed, true),
        ] {
            let runtime = ModuleRuntime {
                mla_attention: form,
                ..ModuleRuntime::default()
            };
            let d = spec.deployment().apply_runtime(&runtime).unwrap();
            assert_eq!(d.takes_batch_context_lengths, hooked, "{form:?}");
            let opts = BuildOptions {
                takes_batch_context_lengths: hooked,
                runtime,
                ..BuildOptions::default()
            };
            let g = spec.build(GraphRole::Decoder, &opts).unwrap();
            let reads = g.node_ids().any(|id| {
                g.operands(id)
                    .iter()
                    .any(|&o| g.node(o).name == "batch_context_lengths")
            });
            assert_eq!(
                reads, hooked,
                "{form:?}: the graph reads batch_context_lengths"
            );
        }
        // The decompressed form without the hook is refused, naming the setting.
        let opts = BuildOptions {
            runtime: ModuleRuntime {
                mla_attention: MlaAttention::Decompressed,
                ..ModuleRuntime::default()
            },
            ..BuildOptions::default()
        };
        let err = spec
            .build(GraphRole::Decoder, &opts)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mla_attention") && err.contains("takes_batch_context_lengths"),
            "{err}"
        );
    }

    /// DeepSeek-V3's own yarn: factor 40, mscale_all_dim 1: the scale is `192^-1/2 · m²` with
    /// `m = 0.1 · ln 40 + 1`.
    #[test]
    fn yarn_multiplies_the_score_scale_by_mscale_squared() {
        let mut cfg = v3();
        cfg["qk_nope_head_dim"] = json!(128);
        cfg["qk_rope_head_dim"] = json!(64);
        cfg["max_position_embeddings"] = json!(163840);
        cfg["rope_scaling"] = json!({
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0
        });
        let spec = parse(&cfg).unwrap();
        let m = spec
            .decoder(GraphRole::Decoder)
            .unwrap()
            .mla
            .clone()
            .unwrap();
        let mscale = 0.1 * 40f64.ln() + 1.0;
        let want = (192f64).powf(-0.5) * mscale * mscale;
        assert!((f64::from(m.softmax_scale) - want).abs() < 1e-6, "{m:?}");
    }

    #[test]
    fn bad_configs_name_the_key() {
        for (key, value, want) in [
            ("kv_lora_rank", json!(0), "expected a positive integer"),
            (
                "n_group",
                json!(3),
                "expected a divisor of n_routed_experts (8)",
            ),
            ("topk_group", json!(5), "expected 1 to n_group (4)"),
            ("q_lora_rank", json!(0), "or null for a direct q_proj"),
            (
                "num_experts_per_tok",
                json!(5),
                "expected at most the 4 experts",
            ),
            ("qk_rope_head_dim", json!(7), "even"),
            ("scoring_func", json!("softmax"), "expected sigmoid"),
        ] {
            let err = error_with(key, value);
            assert!(err.contains(key) && err.contains(want), "{key}: {err}");
        }
        // Groups of one expert cannot be scored by their top two.
        let mut cfg = v3();
        cfg["n_group"] = json!(8);
        cfg["topk_group"] = json!(4);
        let err = parse(&cfg).unwrap_err().to_string();
        assert!(err.contains("n_group") && err.contains("top two"), "{err}");
    }

    #[test]
    fn a_v2_lite_config_has_a_direct_q_proj_and_softmax_routing() {
        let cfg = json!({
            "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 32, "q_lora_rank": null, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1, "norm_topk_prob": false
        });
        let spec = parse(&cfg).unwrap();
        let c = spec.decoder(GraphRole::Decoder).unwrap();
        assert_eq!(c.mla.as_ref().unwrap().q_lora_rank, None);
        let g = c.moe.as_ref().unwrap().grouped_router.clone().unwrap();
        assert_eq!(g.scoring, crate::ir::RouterScoring::Softmax);
        let mut bad = cfg.clone();
        bad["norm_topk_prob"] = json!(true);
        let err = parse(&bad).unwrap_err().to_string();
        assert!(err.contains("norm_topk_prob"), "{err}");
    }

    /// Weight preparation: q rows split per head, the rope rows de-interleaved, the latent's
    /// rows split from the rope key's, kv_b split into transposed key blocks and value blocks,
    /// the MTP layer dropped.
    #[test]
    fn weights_are_split_and_rearranged_exactly() {
        use crate::weights::{StateDict, WeightTensor};
        let cfg = json!({
            "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 2,
            "intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 8, "q_lora_rank": 3, "kv_lora_rank": 2, "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 1, "v_head_dim": 1
        });
        let spec = parse(&cfg).unwrap();
        let seq = |rows: usize, cols: usize| {
            WeightTensor::from_f32(
                vec![rows, cols],
                &(0..rows * cols).map(|i| i as f32).collect::<Vec<_>>(),
            )
        };
        let mut w = StateDict::new();
        let a = "model.layers.0.self_attn.";
        // q_b: 2 heads × (nope 1 + rope 4) rows of 3.
        w.insert(format!("{a}q_b_proj.weight"), seq(10, 3));
        // kv_a: latent 2 + rope 4 rows of 2.
        w.insert(format!("{a}kv_a_proj_with_mqa.weight"), seq(6, 2));
        // kv_b: 2 heads × (nope 1 + v 1) rows of 2.
        w.insert(format!("{a}kv_b_proj.weight"), seq(4, 2));
        w.insert("model.layers.1.self_attn.q_a_proj.weight", seq(3, 2));
        let out = spec.deployment().prepare_weights(w).unwrap();
        let get = |k: &str| out.get(&format!("{a}{k}")).unwrap().to_f32(k).unwrap();
        let rows = |w: Vec<f32>, cols: usize| -> Vec<f32> {
            w.chunks(cols).map(|r| r[0] / cols as f32).collect()
        };
        // Rows of q_b: head 0 = row 0 (nope), rows 1-4 (rope); head 1 = row 5, rows 6-9. The
        // rope rows of each head, interleaved pairs (r0 r1)(r2 r3), become r0 r2 r1 r3.
        assert_eq!(rows(get("q_b_proj_nope.weight"), 3), [0., 5.]);
        assert_eq!(
            rows(get("q_b_proj_rope.weight"), 3),
            [1., 3., 2., 4., 6., 8., 7., 9.]
        );
        assert_eq!(rows(get("kv_a_proj.weight"), 2), [0., 1.]);
        assert_eq!(rows(get("kv_a_proj_rope.weight"), 2), [2., 4., 3., 5.]);
        // kv_b rows: head 0 k = row 0 [0, 1], v = row 1 [2, 3]; head 1 k = [4, 5], v = [6, 7].
        // Keys transposed per head: [H, C, N] = [2, 2, 1].
        assert_eq!(get("kv_b_proj_k.weight"), [0., 1., 4., 5.]);
        assert_eq!(get("kv_b_proj_v.weight"), [2., 3., 6., 7.]);
        assert!(out
            .get("model.layers.1.self_attn.q_a_proj.weight")
            .is_none());
        assert!(out.get(&format!("{a}kv_b_proj.weight")).is_none());
    }
}
