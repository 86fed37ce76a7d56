//! GGUF files of the DeepSeek family (`general.architecture` `deepseek2`, as llama.cpp's
//! converter writes DeepSeek-V2, V3, R1 and Kimi K2): their config.json equivalent. The tensors'
//! names are [`super::gguf::hf_name`]'s; `attn_k_b` / `attn_v_b` (newer files: `kv_b_proj`
//! split per head, keys transposed) are already the `kv_b_proj_k` / `kv_b_proj_v` weights the
//! absorbed graph reads, and older files' `attn_kv_b` goes through the same weight preparation
//! as a Hugging Face `kv_b_proj`. llama.cpp rotates adjacent pairs for `deepseek2` and its
//! converter keeps the checkpoint's rope rows, so the rows are de-interleaved as a checkpoint's
//! are.

use crate::weights::gguf::{GgufFile, GgufValue};
use crate::{Error, Result};
use serde_json::{json, Map, Value};

/// The DeepSeek fields of `cfg` from a `deepseek2` file's metadata (the common ones, which
/// [`super::gguf::config_from_gguf`] has set, are overridden where MLA gives them another
/// meaning). The architecture is V3 where the gating function is sigmoid (2), else V2
/// (llama.cpp's default for files without the key is softmax, as V2's).
pub fn deepseek2_config(gguf: &GgufFile, cfg: &mut Map<String, Value>) -> Result<()> {
    let path = &gguf.path;
    let key = |k: &str| format!("deepseek2.{k}");
    let num = |k: &str| gguf.get(&key(k)).and_then(GgufValue::as_u64);
    let float = |k: &str| gguf.get(&key(k)).and_then(GgufValue::as_f64);
    let need = |k: &str| {
        num(k).ok_or_else(|| Error::config(path, key(k), "missing; expected a positive integer"))
    };
    let heads = need("attention.head_count")?;
    let rope = need("rope.dimension_count")?;
    let kv_lora = need("attention.kv_lora_rank")?;
    // Per-head sizes: newer files store MLA as MQA of one latent head and keep the per-head
    // ones in `*_mla`; older files have them in key_length / value_length.
    let (qk, v) = match (
        num("attention.key_length_mla"),
        num("attention.value_length_mla"),
    ) {
        (Some(k), Some(v)) => (k, v),
        _ => (
            need("attention.key_length")?,
            need("attention.value_length")?,
        ),
    };
    if qk <= rope {
        return Err(Error::config(
            path,
            key("attention.key_length_mla"),
            format!("is {qk}; expected the per-head key size, above the rope dims ({rope})"),
        ));
    }
    let sigmoid = match num("expert_gating_func") {
        None | Some(1) => false,
        Some(2) => true,
        Some(other) => {
            return Err(Error::config(
                path,
                key("expert_gating_func"),
                format!("is {other}; expected 1 (softmax) or 2 (sigmoid)"),
            ))
        }
    };
    let arch = if sigmoid {
        "DeepseekV3ForCausalLM"
    } else {
        "DeepseekV2ForCausalLM"
    };
    cfg.insert("architectures".into(), json!([arch]));
    cfg.insert("num_key_value_heads".into(), json!(heads));
    cfg.insert("head_dim".into(), json!(rope));
    if let Some(q) = num("attention.q_lora_rank") {
        cfg.insert("q_lora_rank".into(), json!(q));
    }
    cfg.insert("kv_lora_rank".into(), json!(kv_lora));
    cfg.insert("qk_rope_head_dim".into(), json!(rope));
    cfg.insert("qk_nope_head_dim".into(), json!(qk - rope));
    cfg.insert("v_head_dim".into(), json!(v));
    cfg.insert(
        "first_k_dense_replace".into(),
        json!(num("leading_dense_block_count").unwrap_or(0)),
    );
    if let Some(e) = num("expert_count") {
        cfg.insert("n_routed_experts".into(), json!(e));
        cfg.insert(
            "num_experts_per_tok".into(),
            json!(need("expert_used_count")?),
        );
        cfg.insert(
            "moe_intermediate_size".into(),
            json!(need("expert_feed_forward_length")?),
        );
        cfg.insert(
            "n_shared_experts".into(),
            json!(num("expert_shared_count").unwrap_or(0)),
        );
        cfg.insert(
            "routed_scaling_factor".into(),
            json!(float("expert_weights_scale").unwrap_or(1.0)),
        );
        let norm = matches!(
            gguf.get(&key("expert_weights_norm")),
            Some(GgufValue::Bool(true))
        );
        cfg.insert("norm_topk_prob".into(), json!(norm));
        let groups = num("expert_group_count").unwrap_or(1);
        cfg.insert("n_group".into(), json!(groups));
        cfg.insert(
            "topk_group".into(),
            json!(num("expert_group_used_count").unwrap_or(groups)),
        );
        if sigmoid {
            cfg.insert("scoring_func".into(), json!("sigmoid"));
            cfg.insert("topk_method".into(), json!("noaux_tc"));
        } else {
            cfg.insert("scoring_func".into(), json!("softmax"));
            let method = if groups > 1 {
                "group_limited_greedy"
            } else {
                "greedy"
            };
            cfg.insert("topk_method".into(), json!(method));
        }
    }
    // Yarn: llama.cpp keeps the factor, the original context and `yarn_log_multiplier`
    // (0.1 · mscale_all_dim); DeepSeek's `mscale` equals its `mscale_all_dim` (both 1.0 in V3),
    // which leaves yarn's cos/sin factor at 1.
    match gguf
        .get(&key("rope.scaling.type"))
        .and_then(GgufValue::as_str)
    {
        None | Some("none") => {}
        Some("yarn") => {
            let factor = float("rope.scaling.factor").unwrap_or(1.0);
            let all_dim = float("rope.scaling.yarn_log_multiplier").unwrap_or(0.0) / 0.1;
            let mut yarn = json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings":
                    need("rope.scaling.original_context_length")?,
                "mscale": all_dim,
                "mscale_all_dim": all_dim,
            });
            for (k, field) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(b) = float(k) {
                    yarn[field] = json!(b);
                }
            }
            cfg.insert("rope_scaling".into(), yarn);
        }
        Some(other) => {
            return Err(Error::config(
                path,
                key("rope.scaling.type"),
                format!("`{other}` is not supported for deepseek2; expected none or yarn"),
            ))
        }
    }
    Ok(())
}
