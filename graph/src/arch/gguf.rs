//! GGUF checkpoints for the Llama family (`general.architecture` `llama`, `qwen2`, `qwen3`,
//! `qwen3moe`, `phi3`, `gemma3`; `deepseek2` with [`super::deepseek_gguf`]): the config.json equivalent of the GGUF metadata, and the weight
//! transforms that map GGUF tensors back to the Hugging Face layout: names, the Q/K row
//! permutation llama.cpp's converter applies for its rotary layout (to `llama` only), Qwen3-MoE's
//! experts stacked one 3-D tensor per projection (split back per expert), and Phi-3's fused
//! projections (kept fused, as its Hugging Face checkpoints have them) and longrope factors
//! (stored as tensors, read into the config).

use crate::weights::gguf::{GgufFile, GgufValue};
use crate::weights::{StateDict, WeightTensor};
use crate::{Error, Result};
use serde_json::{json, Map, Value};

/// The GGUF architectures maxc reads, with the Hugging Face architecture each maps to.
pub const ARCHITECTURES: [(&str, &str); 7] = [
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3moe", "Qwen3MoeForCausalLM"),
    ("phi3", "Phi3ForCausalLM"),
    ("gemma3", "Gemma3ForCausalLM"),
    // V3, or V2 where the gating function is softmax (see `deepseek_gguf`).
    ("deepseek2", "DeepseekV3ForCausalLM"),
];

/// Phi-3's longrope factors as llama.cpp's converter stores them: f32 tensors of one factor per
/// rotated pair, long then short. They are config, not weights.
pub const LONGROPE_FACTORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// The config key that tells Gemma's reader its norm weights already hold the `+ 1`
/// (llama.cpp's converter adds it), so the kernels must not add it again.
pub const NORMS_INCLUDE_ONE: &str = "maxc_gguf_norms_include_one";

/// The Hugging Face style config of a GGUF file's model (see [`ARCHITECTURES`]).
pub fn config_from_gguf(gguf: &GgufFile) -> Result<Value> {
    let path = &gguf.path;
    let arch = gguf
        .get("general.architecture")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| {
            Error::config(
                path,
                "general.architecture",
                format!("missing; expected the model's architecture ({})", known()),
            )
        })?;
    let Some(&(_, hf_arch)) = ARCHITECTURES.iter().find(|(a, _)| *a == arch) else {
        return Err(Error::config(
            path,
            "general.architecture",
            format!("`{arch}` is not supported; expected one of {}", known()),
        ));
    };
    let num = |key: &str| {
        gguf.get(&format!("{arch}.{key}"))
            .and_then(GgufValue::as_u64)
    };
    let float = |key: &str| {
        gguf.get(&format!("{arch}.{key}"))
            .and_then(GgufValue::as_f64)
    };
    let need = |key: &str| {
        num(key).ok_or_else(|| {
            Error::config(
                path,
                format!("{arch}.{key}"),
                "missing; expected a positive integer",
            )
        })
    };
    let heads = need("attention.head_count")?;
    let hidden = need("embedding_length")?;
    let vocab = match num("vocab_size") {
        Some(v) => v,
        None => gguf
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .map(|t| t.len() as u64)
            .ok_or_else(|| {
                Error::config(
                    path,
                    format!("{arch}.vocab_size"),
                    "missing, and there is no tokenizer.ggml.tokens to count",
                )
            })?,
    };
    let mut cfg = Map::new();
    cfg.insert("architectures".into(), json!([hf_arch]));
    cfg.insert("model_type".into(), json!(arch));
    cfg.insert("hidden_size".into(), json!(hidden));
    cfg.insert(
        "intermediate_size".into(),
        json!(need("feed_forward_length")?),
    );
    cfg.insert("num_hidden_layers".into(), json!(need("block_count")?));
    cfg.insert("num_attention_heads".into(), json!(heads));
    cfg.insert(
        "num_key_value_heads".into(),
        json!(num("attention.head_count_kv").unwrap_or(heads)),
    );
    // Phi-3's `rope.dimension_count` is the rotary width, not the head's (read below).
    let head_dim = match arch {
        "phi3" => num("attention.key_length"),
        _ => num("attention.key_length").or(num("rope.dimension_count")),
    };
    if let Some(d) = head_dim {
        cfg.insert("head_dim".into(), json!(d));
    }
    cfg.insert(
        "rms_norm_eps".into(),
        json!(float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5)),
    );
    cfg.insert(
        "rope_theta".into(),
        json!(float("rope.freq_base").unwrap_or(10000.0)),
    );
    match gguf
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(GgufValue::as_str)
    {
        _ if arch == "deepseek2" => {}
        None | Some("none") => {}
        Some("linear") => {
            let factor = float("rope.scaling.factor").unwrap_or(1.0);
            cfg.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": factor}),
            );
        }
        Some(other) => {
            return Err(Error::config(
                path,
                format!("{arch}.rope.scaling.type"),
                format!("`{other}` is not supported; expected none or linear"),
            ))
        }
    }
    cfg.insert("vocab_size".into(), json!(vocab));
    if let Some(n) = num("context_length") {
        cfg.insert("max_position_embeddings".into(), json!(n));
    }
    let tied = !gguf.tensors.iter().any(|t| t.name == "output.weight");
    cfg.insert("tie_word_embeddings".into(), json!(tied));
    for (key, field) in [
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ] {
        if let Some(id) = gguf.get(key).and_then(GgufValue::as_u64) {
            cfg.insert(field.into(), json!(id));
        }
    }
    if arch == "gemma3" {
        // llama.cpp's Gemma 3: the sliding window from the file, every sixth layer full, local
        // layers at base 10000 and scores at head_dim^-1/2 (its defaults, which the reader
        // shares); norm weights stored with their `+ 1`.
        if let Some(w) = num("attention.sliding_window") {
            cfg.insert("sliding_window".into(), json!(w));
        }
        cfg.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
        cfg.insert(NORMS_INCLUDE_ONE.into(), json!(true));
    } else {
        cfg.insert("hidden_act".into(), json!("silu"));
    }
    if arch == "phi3" {
        phi3_config(gguf, &mut cfg, head_dim.unwrap_or(hidden / heads.max(1)))?;
    }
    if arch == "deepseek2" {
        super::deepseek_gguf::deepseek2_config(gguf, &mut cfg)?;
    }
    if arch == "qwen3moe" {
        let layers = need("block_count")?;
        // llama.cpp runs every layer sparse and has no key for `mlp_only_layers` or
        // `decoder_sparse_step`: a block without a router (`ffn_gate_inp`) is a dense one.
        let names: std::collections::BTreeSet<&str> =
            gguf.tensors.iter().map(|t| t.name.as_str()).collect();
        let dense: Vec<u64> = (0..layers)
            .filter(|l| !names.contains(format!("blk.{l}.ffn_gate_inp.weight").as_str()))
            .collect();
        cfg.insert("num_experts".into(), json!(need("expert_count")?));
        cfg.insert(
            "num_experts_per_tok".into(),
            json!(need("expert_used_count")?),
        );
        cfg.insert(
            "moe_intermediate_size".into(),
            json!(need("expert_feed_forward_length")?),
        );
        // llama.cpp's Qwen3-MoE graph renormalizes the top-k weights (its converter writes no
        // `expert_weights_norm`); a file that has the key says.
        let norm = match gguf.get(&format!("{arch}.expert_weights_norm")) {
            Some(GgufValue::Bool(b)) => *b,
            _ => true,
        };
        cfg.insert("norm_topk_prob".into(), json!(norm));
        cfg.insert("decoder_sparse_step".into(), json!(1));
        cfg.insert("mlp_only_layers".into(), json!(dense));
    }
    Ok(Value::Object(cfg))
}

/// Phi-3's fields, as llama.cpp's converter (Phi3MiniModel) writes them: the rotary width
/// (`rope.dimension_count`, `partial_rotary_factor` of `head_dim`), the sliding window (0 for
/// none), the original context, and longrope's attention factor and its factors (tensors
/// [`LONGROPE_FACTORS`]).
fn phi3_config(gguf: &GgufFile, cfg: &mut Map<String, Value>, head_dim: u64) -> Result<()> {
    let (path, key) = (&gguf.path, |k: &str| format!("phi3.{k}"));
    let num = |k: &str| gguf.get(&key(k)).and_then(GgufValue::as_u64);
    if let Some(rotary) = num("rope.dimension_count") {
        if rotary == 0 || rotary > head_dim {
            return Err(Error::config(
                path,
                key("rope.dimension_count"),
                format!("is {rotary}; expected a rotary width in 1..={head_dim} (head_dim)"),
            ));
        }
        if rotary < head_dim {
            cfg.insert(
                "partial_rotary_factor".into(),
                json!(rotary_fraction(rotary as usize, head_dim as usize)),
            );
        }
    }
    if let Some(w) = num("attention.sliding_window").filter(|&w| w > 0) {
        cfg.insert("sliding_window".into(), json!(w));
    }
    let original = num("rope.scaling.original_context_length");
    if let Some(o) = original {
        cfg.insert("original_max_position_embeddings".into(), json!(o));
    }
    let [long, short] = LONGROPE_FACTORS.map(|name| gguf.tensors.iter().find(|t| t.name == name));
    let (long, short) = match (long, short) {
        (None, None) => return Ok(()),
        (Some(l), Some(s)) => (l, s),
        _ => {
            return Err(Error::checkpoint(
                path,
                format!(
                    "has one of the longrope factor tensors {}; expected both or neither",
                    LONGROPE_FACTORS.join(" and ")
                ),
            ))
        }
    };
    let original = original.ok_or_else(|| {
        Error::config(
            path,
            key("rope.scaling.original_context_length"),
            "missing; longrope (the file has rope_factors tensors) needs the original context",
        )
    })?;
    let factors = |t: &crate::weights::gguf::GgufTensorInfo| -> Result<Vec<f64>> {
        let w = WeightTensor::from_bytes(t.ggml_type, t.shape(), gguf.tensor_bytes(t)?.to_vec())
            .map_err(|e| Error::checkpoint(path, format!("tensor `{}`: {e}", t.name)))?;
        Ok(w.to_f32(&t.name)?.into_iter().map(f64::from).collect())
    };
    let mut rope = Map::new();
    rope.insert("rope_type".into(), json!("longrope"));
    rope.insert("long_factor".into(), json!(factors(long)?));
    rope.insert("short_factor".into(), json!(factors(short)?));
    rope.insert("original_max_position_embeddings".into(), json!(original));
    if let Some(a) = gguf
        .get(&key("rope.scaling.attn_factor"))
        .and_then(GgufValue::as_f64)
    {
        rope.insert("attention_factor".into(), json!(a));
    }
    cfg.insert("rope_scaling".into(), Value::Object(rope));
    Ok(())
}

/// `rotary / head_dim` as a `partial_rotary_factor` that gives back `rotary` under
/// transformers' `int(head_dim * factor)`: the quotient, or the next float up where the product
/// rounds below `rotary` (30 of 44, say).
fn rotary_fraction(rotary: usize, head_dim: usize) -> f64 {
    let f = rotary as f64 / head_dim as f64;
    if (head_dim as f64 * f) as usize == rotary {
        f
    } else {
        f.next_up()
    }
}

/// The GGUF architectures, for errors.
fn known() -> String {
    let names: Vec<&str> = ARCHITECTURES.iter().map(|a| a.0).collect();
    names.join(", ")
}

/// How an architecture's GGUF tensors differ from the plain Llama layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GgufLayout {
    /// q and k rows are permuted for llama.cpp's rotary layout (`llama` files).
    pub qk_permuted: bool,
    /// Norms named as Gemma's: `ffn_norm` before the MLP, `post_attention_norm`,
    /// `post_ffw_norm`.
    pub gemma_norms: bool,
    /// `ffn_up` holds Phi-3's fused gate and up rows (`mlp.gate_up_proj`).
    pub fused_gate_up: bool,
    /// The [`LONGROPE_FACTORS`] tensors are config ([`config_from_gguf`] reads them), not
    /// weights.
    pub longrope_factors: bool,
}

impl GgufLayout {
    /// Phi-3's (`phi3` files).
    pub const PHI3: GgufLayout = GgufLayout {
        qk_permuted: false,
        gemma_norms: false,
        fused_gate_up: true,
        longrope_factors: true,
    };
}

/// The Hugging Face name of a GGUF Llama-family tensor laid out as `layout` says. The stacked
/// experts (`ffn_*_exps`) have no one name: see [`stacked_experts`].
pub fn hf_name(gguf: &str, layout: &GgufLayout) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, leaf) = rest.rsplit_once('.')?;
    if (module, leaf) == ("exp_probs_b", "bias") {
        // DeepSeek's router bias.
        return Some(format!(
            "model.layers.{layer}.mlp.gate.e_score_correction_bias"
        ));
    }
    let gemma = layout.gemma_norms;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" if layout.fused_gate_up => "mlp.gate_up_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // The MoE router, named as Qwen names it (`MoeNaming::Qwen`).
        "ffn_gate_inp" => "mlp.gate",
        // DeepSeek's shared experts and multi-head latent attention (`deepseek2`).
        "ffn_gate_shexp" => "mlp.shared_experts.gate_proj",
        "ffn_up_shexp" => "mlp.shared_experts.up_proj",
        "ffn_down_shexp" => "mlp.shared_experts.down_proj",
        "attn_q_a" => "self_attn.q_a_proj",
        "attn_q_a_norm" => "self_attn.q_a_layernorm",
        "attn_q_b" => "self_attn.q_b_proj",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm",
        "attn_kv_b" => "self_attn.kv_b_proj",
        "attn_k_b" => "self_attn.kv_b_proj_k",
        "attn_v_b" => "self_attn.kv_b_proj_v",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{leaf}"))
}

/// The layer and Hugging Face projection (`gate_proj`, `up_proj`, `down_proj`) of a GGUF
/// tensor of stacked experts (`blk.N.ffn_gate_exps.weight`: `[experts, rows, cols]`, one
/// `model.layers.N.mlp.experts.E.gate_proj.weight` per expert).
pub fn stacked_experts(gguf: &str) -> Option<(usize, &'static str)> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let proj = match rest {
        "ffn_gate_exps.weight" => "gate_proj",
        "ffn_up_exps.weight" => "up_proj",
        "ffn_down_exps.weight" => "down_proj",
        _ => return None,
    };
    Some((layer.parse().ok()?, proj))
}

/// Each expert's weight of a stacked `[experts, rows, cols]` tensor, in order. An expert is
/// whole rows, so this is a byte slice for block types too.
pub fn split_experts(w: &WeightTensor, key: &str) -> Result<Vec<WeightTensor>> {
    if w.shape.len() != 3 {
        return Err(Error::WeightDtype {
            key: key.into(),
            message: format!(
                "has shape {:?}; expected stacked experts [experts, rows, cols]",
                w.shape
            ),
        });
    }
    (0..w.shape[0])
        .map(|e| {
            let mut t = w.rows(e..e + 1, key)?;
            t.shape.remove(0);
            Ok(t)
        })
        .collect()
}

/// Undoes llama.cpp's rotary permutation of a q or k projection with `heads` heads: its row
/// `h·D + 2j + i` holds the Hugging Face row `h·D + i·D/2 + j`.
pub fn unpermute_rows(w: &WeightTensor, heads: usize, key: &str) -> Result<WeightTensor> {
    let rows = *w.shape.first().unwrap_or(&0);
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(Error::WeightDtype {
            key: key.into(),
            message: format!("{rows} rows do not split into {heads} heads of even size"),
        });
    }
    let d = rows / heads;
    let row_bytes = w.bytes().len() / rows;
    let src = w.bytes();
    let mut out = vec![0u8; src.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..d / 2 {
                let (hf, gg) = (h * d + i * (d / 2) + j, h * d + 2 * j + i);
                out[hf * row_bytes..(hf + 1) * row_bytes]
                    .copy_from_slice(&src[gg * row_bytes..(gg + 1) * row_bytes]);
            }
        }
    }
    WeightTensor::from_bytes(w.dtype, w.shape.clone(), out)
}

/// GGUF tensors renamed to the Hugging Face layout of `layout`: q and k un-permuted where the
/// converter permuted them, stacked experts split per expert, longrope factors left to the
/// config. Tensors with no Llama equivalent are an error naming them.
pub fn gguf_to_hf(
    weights: StateDict,
    heads: usize,
    kv_heads: usize,
    layout: GgufLayout,
) -> Result<StateDict> {
    let mut out = StateDict::new();
    for (key, w) in weights {
        if layout.longrope_factors && LONGROPE_FACTORS.contains(&key.as_str()) {
            continue;
        }
        if let Some((layer, proj)) = stacked_experts(&key) {
            for (e, t) in split_experts(&w, &key)?.into_iter().enumerate() {
                out.insert(
                    format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight"),
                    t,
                );
            }
            continue;
        }
        let name = hf_name(&key, &layout).ok_or_else(|| Error::UnusedWeights {
            role: "(GGUF import)".into(),
            count: 1,
            keys: format!("`{key}` (no Llama equivalent)"),
        })?;
        let w = if !layout.qk_permuted {
            w
        } else if name.ends_with("self_attn.q_proj.weight") {
            unpermute_rows(&w, heads, &key)?
        } else if name.ends_with("self_attn.k_proj.weight") {
            unpermute_rows(&w, kv_heads, &key)?
        } else {
            w
        };
        out.insert(name, w);
    }
    Ok(out)
}

/// Whether `weights` carry GGUF names.
pub fn is_gguf_layout(weights: &StateDict) -> bool {
    weights.contains("token_embd.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_the_hugging_face_layout() {
        let plain = GgufLayout::default();
        assert_eq!(
            hf_name("blk.12.attn_output.weight", &plain).unwrap(),
            "model.layers.12.self_attn.o_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight", &plain).unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_name("token_embd.weight", &plain).unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(hf_name("rope_freqs.weight", &plain), None);
        assert_eq!(
            hf_name("blk.3.ffn_up.weight", &plain).unwrap(),
            "model.layers.3.mlp.up_proj.weight"
        );
        assert_eq!(
            hf_name("blk.3.ffn_up.weight", &GgufLayout::PHI3).unwrap(),
            "model.layers.3.mlp.gate_up_proj.weight"
        );
        assert_eq!(
            hf_name("blk.3.attn_qkv.weight", &GgufLayout::PHI3).unwrap(),
            "model.layers.3.self_attn.qkv_proj.weight"
        );
        assert_eq!(
            hf_name("blk.1.ffn_gate_inp.weight", &plain).unwrap(),
            "model.layers.1.mlp.gate.weight"
        );
    }

    #[test]
    fn stacked_experts_split_on_the_outer_dim_into_hugging_face_names() {
        // 3 experts of 2 rows × 4 cols; expert e's row r, col c holds 100e + 10r + c.
        let values: Vec<f32> = (0..3)
            .flat_map(|e| {
                (0..2).flat_map(move |r| (0..4).map(move |c| (100 * e + 10 * r + c) as f32))
            })
            .collect();
        let mut sd = StateDict::new();
        sd.insert(
            "blk.1.ffn_down_exps.weight",
            WeightTensor::from_f32(vec![3, 2, 4], &values),
        );
        sd.insert(
            "blk.1.ffn_gate_inp.weight",
            WeightTensor::from_f32(vec![3, 4], &[0.0; 12]),
        );
        let out = gguf_to_hf(sd, 1, 1, GgufLayout::default()).unwrap();
        let keys: Vec<&String> = out.keys().collect();
        assert_eq!(keys.len(), 4, "{keys:?}");
        let e2 = out
            .get("model.layers.1.mlp.experts.2.down_proj.weight")
            .unwrap();
        assert_eq!(e2.shape, vec![2, 4]);
        assert_eq!(
            e2.to_f32("e2").unwrap(),
            vec![200.0, 201.0, 202.0, 203.0, 210.0, 211.0, 212.0, 213.0]
        );
        assert!(out.contains("model.layers.1.mlp.gate.weight"));
        let flat = WeightTensor::from_f32(vec![6, 4], &values);
        let e = split_experts(&flat, "blk.0.ffn_up_exps.weight")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.ffn_up_exps.weight") && e.contains("[experts, rows, cols]"),
            "{e}"
        );
    }

    #[test]
    fn phi3_rotary_width_gives_back_its_partial_factor() {
        // The tiny-phi3 fixture: hidden 256 over 8 heads (head_dim 32), 24 dims rotate.
        assert_eq!(rotary_fraction(24, 32), 0.75);
        // Every even width of every even head up to 512 survives transformers' truncation,
        // 30 of 44 among them (30/44 · 44 rounds to 29.999…).
        for d in (2..=512).step_by(2) {
            for r in (2..d).step_by(2) {
                let f = rotary_fraction(r, d);
                assert!(f < 1.0 && (d as f64 * f) as usize == r, "{r} of {d}: {f}");
            }
        }
    }

    #[test]
    fn longrope_factors_are_left_to_the_config_only_where_the_layout_says() {
        let mut sd = StateDict::new();
        sd.insert(
            "token_embd.weight",
            WeightTensor::from_f32(vec![2, 2], &[0.0; 4]),
        );
        sd.insert(
            "rope_factors_long.weight",
            WeightTensor::from_f32(vec![1], &[1.0]),
        );
        let out = gguf_to_hf(sd.clone(), 1, 1, GgufLayout::PHI3).unwrap();
        assert_eq!(
            out.keys().collect::<Vec<_>>(),
            vec!["model.embed_tokens.weight"]
        );
        let e = gguf_to_hf(sd, 1, 1, GgufLayout::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_factors_long.weight"), "{e}");
    }

    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        // llama.cpp: w.reshape(heads, 2, D/2, cols).swapaxes(1, 2).reshape(rows, cols).
        let (heads, d, cols) = (2, 8, 3);
        let hf: Vec<f32> = (0..heads * d * cols).map(|x| x as f32).collect();
        let mut permuted = vec![0.0; hf.len()];
        for h in 0..heads {
            for i in 0..2 {
                for j in 0..d / 2 {
                    let src = h * d + i * (d / 2) + j; // (h, i, j) in the HF layout
                    let dst = h * d + j * 2 + i; // (h, j, i) after swapaxes
                    permuted[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        let w = WeightTensor::from_f32(vec![heads * d, cols], &permuted);
        let back = unpermute_rows(&w, heads, "q").unwrap().to_f32("q").unwrap();
        assert_eq!(back, hf);
    }
}
