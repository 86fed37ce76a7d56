//! GGUF checkpoints for the Llama family (`general.architecture` `llama`, `qwen2`, `qwen3`):
//! the config.json equivalent of the GGUF metadata, and the weight transforms that map GGUF
//! tensors back to the Hugging Face layout (names, and the Q/K row permutation llama.cpp's
//! converter applies for its rotary layout, which it applies to `llama` only).

use crate::weights::gguf::{GgufFile, GgufValue};
use crate::weights::{StateDict, WeightTensor};
use crate::{Error, Result};
use serde_json::{json, Map, Value};

/// The GGUF architectures maxc reads, with the Hugging Face architecture each maps to.
pub const ARCHITECTURES: [(&str, &str); 4] = [
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("gemma3", "Gemma3ForCausalLM"),
];

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
    if let Some(d) = num("attention.key_length").or(num("rope.dimension_count")) {
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
    Ok(Value::Object(cfg))
}

/// The GGUF architectures, for errors.
fn known() -> String {
    let names: Vec<&str> = ARCHITECTURES.iter().map(|a| a.0).collect();
    names.join(", ")
}

/// The Hugging Face name of a GGUF Llama-family tensor (Gemma's norms with `gemma`: its
/// `ffn_norm` is the MLP's pre-norm, and it has post-norms).
pub fn hf_name(gguf: &str, gemma: bool) -> Option<String> {
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
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{leaf}"))
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

/// GGUF tensors renamed to the Hugging Face layout, q and k un-permuted where the converter
/// permuted them (`permuted`: `llama` files). Tensors with no Llama equivalent are an error
/// naming them.
pub fn gguf_to_hf(
    weights: StateDict,
    heads: usize,
    kv_heads: usize,
    (permuted, gemma): (bool, bool),
) -> Result<StateDict> {
    let mut out = StateDict::new();
    for (key, w) in weights {
        let name = hf_name(&key, gemma).ok_or_else(|| Error::UnusedWeights {
            role: "(GGUF import)".into(),
            count: 1,
            keys: format!("`{key}` (no Llama equivalent)"),
        })?;
        let w = if !permuted {
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
        assert_eq!(
            hf_name("blk.12.attn_output.weight", false).unwrap(),
            "model.layers.12.self_attn.o_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight", false).unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_name("token_embd.weight", false).unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(hf_name("rope_freqs.weight", false), None);
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
