//! The decoder-only transformer shared by the Llama family (Llama, Qwen2, Qwen3, Mixtral): its resolved
//! config and its graph, laid out as the checkpoint's key paths (`model.layers.N.self_attn...`).

use super::config::ConfigReader;
use super::rope::RopeConfig;
use super::BuildOptions;
use crate::ir::{names, Dim, GraphBuilder, KvLayout, Op, TensorType};
use crate::weights::{StateDict, WeightTensor};
use crate::{DType, Graph, GraphRole, Result};
use petgraph::graph::NodeIndex;
use serde::{Deserialize, Serialize};

/// Mixture-of-experts settings of a decoder's MLP.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's MLP width, where it is not the decoder's `intermediate_size`
    /// (Qwen3-MoE's `moe_intermediate_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_intermediate_size: Option<usize>,
    /// Layers whose MLP is dense (`intermediate_size` wide) instead: Qwen3-MoE's
    /// `mlp_only_layers` and the layers `decoder_sparse_step` skips.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// Whether the top-k routing weights are renormalized to sum to 1 (Mixtral always;
    /// Qwen3-MoE's `norm_topk_prob`).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub renormalize: bool,
    /// The checkpoint's names of the block and its experts' projections.
    #[serde(default, skip_serializing_if = "MoeNaming::is_mixtral")]
    pub naming: MoeNaming,
    /// DeepSeek's group-limited router, instead of softmax and top-k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grouped_router: Option<GroupedRouter>,
    /// The width of the shared experts that run for every token beside the routed ones
    /// (`mlp.shared_experts`: `moe_intermediate_size × n_shared_experts`), where there are any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_intermediate_size: Option<usize>,
}

/// DeepSeek's group-limited router ([`Op::MoeRouter`]): its weights at `mlp.gate.weight` and
/// its choice-score bias at `mlp.gate.e_score_correction_bias`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupedRouter {
    /// How logits become scores.
    pub scoring: crate::ir::RouterScoring,
    /// How a group is scored.
    pub group_score: crate::ir::GroupScore,
    /// Groups of experts (`n_group`).
    pub n_group: usize,
    /// Groups kept per token (`topk_group`).
    pub topk_group: usize,
    /// What the chosen weights are multiplied by (`routed_scaling_factor`).
    pub scale: f32,
}

/// Multi-head latent attention's sizes (DeepSeek-V2 and V3): queries through an optional
/// low-rank projection, keys and values through one compressed latent per token that the KV
/// cache holds with the shared rope key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// Rank of the query's low-rank projection (`q_a_proj`, `q_a_layernorm`, `q_b_proj`);
    /// `None`: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed latent C (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per-head elements that rotate R (`qk_rope_head_dim`), shared by every head's key.
    pub qk_rope_head_dim: usize,
    /// Per-head query/key elements that do not rotate N (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// Per-head value elements V (`v_head_dim`).
    pub v_head_dim: usize,
    /// Whether the checkpoint's rope rows are interleaved (pairs `2i, 2i+1`): weight
    /// preparation reorders them to rotate-half.
    pub rope_interleave: bool,
    /// The score scale: `(N + R)^-1/2`, times yarn's `mscale²`.
    pub softmax_scale: f32,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// How a checkpoint names its MoE block's weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeNaming {
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1, w3, w2}` (gate, up, down).
    #[default]
    Mixtral,
    /// `mlp.gate`, `mlp.experts.E.{gate_proj, up_proj, down_proj}`.
    Qwen,
}

impl MoeNaming {
    fn is_mixtral(&self) -> bool {
        *self == MoeNaming::Mixtral
    }

    /// The block's module name and its experts' gate, up and down projections.
    fn names(self) -> (&'static str, [&'static str; 3]) {
        match self {
            MoeNaming::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            MoeNaming::Qwen => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }
}

impl MoeConfig {
    /// Shared experts: their width over one routed expert's.
    pub fn num_shared_experts(&self, intermediate_size: usize) -> usize {
        let per = self
            .expert_intermediate_size
            .unwrap_or(intermediate_size)
            .max(1);
        self.shared_intermediate_size.map_or(0, |w| w / per)
    }

    /// `num_experts` experts, `top_k` of them per token, renormalized, on every layer, named
    /// as Mixtral names them.
    pub fn new(num_experts: usize, top_k: usize) -> Self {
        MoeConfig {
            num_experts,
            top_k,
            expert_intermediate_size: None,
            dense_layers: Vec::new(),
            renormalize: true,
            naming: MoeNaming::Mixtral,
            grouped_router: None,
            shared_intermediate_size: None,
        }
    }
}

/// How Gemma's decoder layers differ from Llama's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmaStyle {
    /// Every RMSNorm multiplies by `1 + w` (the weights are stored as offsets from 1).
    pub unit_offset_norms: bool,
    /// Embeddings are multiplied by `sqrt(hidden_size)`.
    pub scaled_embeddings: bool,
    /// Norms after attention and around the MLP: `post_attention_layernorm` on the attention's
    /// output, `pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP.
    pub sandwich_norms: bool,
    /// The MLP's activation is GELU (tanh) instead of SiLU.
    pub gelu_tanh: bool,
    /// The score scale (`query_pre_attn_scalar^-1/2`), instead of `head_dim^-1/2`.
    pub attention_scale: f32,
    /// Rotary parameters of the sliding-window layers (`rope_local_base_freq`, or
    /// `rope_parameters.sliding_attention`).
    pub local_rope: RopeConfig,
}

/// Which projections carry a bias.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Biases {
    /// q, k and v projections.
    pub qkv: bool,
    /// The attention output projection.
    pub o: bool,
    /// gate, up and down projections.
    pub mlp: bool,
}

/// A decoder's config, resolved: every default applied, every size known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    /// Model width H.
    pub hidden_size: usize,
    /// MLP width (per expert for MoE).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// The LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Projection biases.
    pub biases: Biases,
    /// MoE MLP, where the model has one.
    pub moe: Option<MoeConfig>,
    /// The checkpoint's dtype, where config.json says.
    pub checkpoint_dtype: Option<DType>,
    /// Longest context the model was trained for, where config.json says.
    pub max_position_embeddings: Option<usize>,
    /// Per-head RMSNorms of q and k (`q_norm`, `k_norm`, `[head_dim]`) before rotary, as
    /// Qwen3 has them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// Elements of each head that rotate, where fewer than `head_dim` (`partial_rotary_factor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_dim: Option<usize>,
    /// Gemma's variations on the layer, where the model has them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemma: Option<GemmaStyle>,
    /// Each layer's sliding window (`None`: full attention); empty where no layer has one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_windows: Vec<Option<usize>>,
    /// Multi-head latent attention, where the model has it (then `head_dim` is the rope dim).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
}

impl DecoderConfig {
    /// The config one of `degree` tensor-parallel ranks builds: its share of the query and KV
    /// heads and of the MLP width (Megatron's layout: q/k/v and gate/up split by rows, o and
    /// down by columns and summed over the ranks; each expert of a mixture as a dense MLP, the
    /// router replicated; or, where `experts_spread`, each rank `1/degree` of the experts whole).
    /// Counts that do not divide, and layers not split yet (latent attention), are errors
    /// naming the field.
    pub fn shard(&self, degree: usize, experts_spread: bool) -> Result<DecoderConfig> {
        let refuse = |field: &str, value: String, message: String| crate::Error::Setting {
            field: field.into(),
            value,
            message,
        };
        let moe = self.moe.as_ref();
        // Spread experts stay whole: their count divides instead of their width.
        let expert_width = moe
            .and_then(|m| m.expert_intermediate_size)
            .filter(|_| !experts_spread);
        let shared_width = moe.and_then(|m| m.shared_intermediate_size);
        let spread_count = moe.filter(|_| experts_spread).map(|m| m.num_experts);
        for (field, n) in [
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("num_experts", spread_count.unwrap_or(degree)),
            ("moe_intermediate_size", expert_width.unwrap_or(degree)),
            (
                "shared_expert_intermediate_size",
                shared_width.unwrap_or(degree),
            ),
        ] {
            if !n.is_multiple_of(degree) {
                return Err(refuse(
                    field,
                    n.to_string(),
                    format!("must divide evenly over tensor_parallel_degree {degree}"),
                ));
            }
        }
        // Fewer KV heads than ranks: each rank holds the one its query heads read (ranks
        // share it, as Megatron and vLLM replicate them).
        let kv = self.num_kv_heads;
        if !(kv.is_multiple_of(degree) || (kv < degree && degree.is_multiple_of(kv))) {
            return Err(refuse(
                "num_key_value_heads",
                kv.to_string(),
                format!(
                    "must divide evenly over tensor_parallel_degree {degree}, or divide it (each rank then holds a copy of one)"
                ),
            ));
        }
        // Every expert (routed and shared) is split as a dense MLP is: each rank holds its
        // share of every expert's width, and the router, replicated, routes alike everywhere.
        // Spread experts: each rank holds `num_experts / degree` of them, whole (at the dense
        // MLP's width where the model gives no expert width, which the split below divides).
        let moe = self.moe.clone().map(|m| MoeConfig {
            expert_intermediate_size: match (experts_spread, m.expert_intermediate_size) {
                (true, w) => Some(w.unwrap_or(self.intermediate_size)),
                (false, w) => w.map(|f| f / degree),
            },
            shared_intermediate_size: shared_width.map(|f| f / degree),
            ..m
        });
        Ok(DecoderConfig {
            num_heads: self.num_heads / degree,
            num_kv_heads: (self.num_kv_heads / degree).max(1),
            intermediate_size: self.intermediate_size / degree,
            moe,
            ..self.clone()
        })
    }

    /// Rank `rank`'s share of the (prepared) weights of this whole-model config, for the graph
    /// of [`DecoderConfig::shard`]: the rows of its query and KV heads and of its MLP width, the
    /// same columns of the attention output and MLP down projections; every other weight
    /// (embeddings, norms, the vocabulary projection) whole. Where `experts_spread`, the rank's
    /// own experts whole instead, numbered from 0, and each MoE block's `expert_select` (see
    /// [`EXPERT_SELECT`]).
    pub fn shard_weights(
        &self,
        weights: &StateDict,
        rank: usize,
        degree: usize,
        experts_spread: bool,
    ) -> Result<StateDict> {
        let local = self.shard(degree, experts_spread)?;
        let d = self.head_dim;
        let q = local.num_heads * d;
        // The attention output's input columns: each head's value width (latent attention's
        // `v_head_dim`, else `head_dim`).
        let o_cols = local.num_heads * self.mla.as_ref().map_or(d, |m| m.v_head_dim);
        let kv = local.num_kv_heads * d;
        // The first KV head this rank holds (a shared one where there are fewer than ranks).
        let kv0 = rank * self.num_kv_heads / degree * d;
        let dense = local.intermediate_size;
        let moe = local.moe.as_ref();
        let expert = moe
            .and_then(|m| m.expert_intermediate_size)
            .unwrap_or(dense);
        let shared = moe.and_then(|m| m.shared_intermediate_size);
        let mut out = StateDict::new();
        let head_rows = head_split(self, degree).then(|| {
            let n = self.vocab_size / degree;
            rank * n..(rank + 1) * n
        });
        if let (true, Some(moe)) = (experts_spread, &self.moe) {
            let per = moe.num_experts / degree;
            let block = moe.naming.names().0;
            let router = format!(".{block}.gate.weight");
            // Row i picks column rank · per + i of the routing weights: this rank's experts.
            let mut select = vec![0f32; per * moe.num_experts];
            for i in 0..per {
                select[i * moe.num_experts + rank * per + i] = 1.0;
            }
            for key in weights.keys().filter(|k| k.ends_with(&router)) {
                let at = key.len() - "gate.weight".len();
                out.insert(
                    format!("{}{EXPERT_SELECT}.weight", &key[..at]),
                    WeightTensor::from_f32(vec![per, moe.num_experts], &select),
                );
            }
        }
        for (key, w) in weights.iter() {
            if let (true, Some(moe)) = (experts_spread, &self.moe) {
                if let Some((head, e, tail)) = expert_key(key) {
                    let per = moe.num_experts / degree;
                    if e / per == rank {
                        out.insert(
                            format!("{head}.experts.{}.{tail}", e - rank * per),
                            w.clone(),
                        );
                    }
                    continue;
                }
            }
            let split = |rows: usize| rank * rows..(rank + 1) * rows;
            let (module, param) = key.rsplit_once('.').unwrap_or((key.as_str(), ""));
            // The MLP's width: a routed expert's, a shared expert's or the dense one's.
            let f = if key.contains(".experts.") {
                expert
            } else if key.contains(".shared_experts.") {
                shared.unwrap_or(dense)
            } else {
                dense
            };
            let shard = match (module.rsplit('.').next().unwrap_or(""), param) {
                ("q_proj", "weight") => w.rows(split(q), key)?,
                ("k_proj" | "v_proj", "weight") => w.rows(kv0..kv0 + kv, key)?,
                ("q_proj", "bias") => w.span(split(q), key)?,
                ("k_proj" | "v_proj", "bias") => w.span(kv0..kv0 + kv, key)?,
                ("o_proj", "weight") => w.cols(split(o_cols), key)?,
                // Latent attention: each head's query rows and up-projections; the latent
                // (kv_a_proj, its norm, the rope key) is every head's, replicated.
                ("q_b_proj_nope" | "q_proj_nope", "weight") => {
                    w.rows(split(local.num_heads * self.mla_dims().0), key)?
                }
                ("q_b_proj_rope" | "q_proj_rope", "weight") => {
                    w.rows(split(local.num_heads * self.mla_dims().1), key)?
                }
                ("kv_b_proj_k" | "kv_b_proj_v", "weight") => w.rows(split(local.num_heads), key)?,
                // Mixtral's experts: w1 (gate), w3 (up), w2 (down).
                ("gate_proj" | "up_proj" | "w1" | "w3", "weight") => w.rows(split(f), key)?,
                ("gate_proj" | "up_proj", "bias") => w.span(split(f), key)?,
                ("down_proj" | "w2", "weight") => w.cols(split(f), key)?,
                ("lm_head", "weight") if key == "lm_head.weight" => match &head_rows {
                    Some(rows) => w.rows(rows.clone(), key)?,
                    None => w.clone(),
                },
                _ => w.clone(),
            };
            out.insert(key.clone(), shard);
        }
        Ok(out)
    }

    /// Latent attention's per-head query widths, `(nope, rope)` (zeros without it).
    fn mla_dims(&self) -> (usize, usize) {
        self.mla
            .as_ref()
            .map_or((0, 0), |m| (m.qk_nope_head_dim, m.qk_rope_head_dim))
    }

    /// Reads the fields every Llama-family config has. `biases` and `moe` are the
    /// architecture's to set.
    pub fn read(cfg: &ConfigReader<'_>) -> Result<Self> {
        let hidden_size = cfg.positive("hidden_size")?;
        let num_heads = cfg.positive("num_attention_heads")?;
        let num_kv_heads = cfg.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(cfg.error(
                "num_key_value_heads",
                format!(
                    "is {num_kv_heads}; expected a divisor of num_attention_heads ({num_heads})"
                ),
            ));
        }
        let head_dim = match cfg.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(cfg.error(
                    "head_dim",
                    format!("absent, and hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads})"),
                ))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(cfg.error(
                "head_dim",
                format!("is {head_dim}; rotary embedding needs an even, positive head_dim"),
            ));
        }
        // Gemma configs name the MLP's activation `hidden_activation` (theirs to check); their
        // `hidden_act`, where present, is not what the MLP uses.
        if let Some(act) = cfg
            .opt_str("hidden_act")?
            .filter(|_| cfg.get("hidden_activation").is_none())
        {
            if act != "silu" {
                return Err(cfg.error(
                    "hidden_act",
                    format!("`{act}` is not supported; expected silu"),
                ));
            }
        }
        let rms_norm_eps = cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        let rope = RopeConfig::read(cfg)?;
        let partial = match cfg.opt_f64("partial_rotary_factor")? {
            Some(f) => Some(f),
            None => match cfg.child("rope_parameters")? {
                Some(p) => p.opt_f64("partial_rotary_factor")?,
                None => None,
            },
        };
        let rotary_dim = match partial {
            None => None,
            Some(f) if f > 0.0 && f <= 1.0 => {
                let r = (head_dim as f64 * f) as usize;
                if r == 0 || !r.is_multiple_of(2) {
                    return Err(cfg.error(
                        "partial_rotary_factor",
                        format!("is {f}: {r} of head_dim {head_dim} rotate; expected an even, positive count"),
                    ));
                }
                (r < head_dim).then_some(r)
            }
            Some(f) => {
                return Err(cfg.error(
                    "partial_rotary_factor",
                    format!("is {f}; expected a fraction in (0, 1]"),
                ))
            }
        };
        if let super::rope::RopeScaling::Longrope {
            short_factor,
            long_factor,
            ..
        } = &rope.scaling
        {
            let want = rotary_dim.unwrap_or(head_dim) / 2;
            for (key, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != want {
                    return Err(cfg.error(
                        &format!("rope_parameters.{key}"),
                        format!(
                            "has {} factors; expected one per rotated pair ({want})",
                            f.len()
                        ),
                    ));
                }
            }
        }
        Ok(DecoderConfig {
            hidden_size,
            intermediate_size: cfg.positive("intermediate_size")?,
            num_layers: cfg.positive("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            vocab_size: cfg.positive("vocab_size")?,
            tie_word_embeddings: cfg.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            rope,
            biases: Biases::default(),
            moe: None,
            checkpoint_dtype: cfg.checkpoint_dtype()?,
            max_position_embeddings: cfg.opt_usize("max_position_embeddings")?,
            qk_norm: false,
            layer_windows: Vec::new(),
            rotary_dim,
            gemma: None,
            mla: None,
        })
    }

    /// Each decoder layer's sliding window (`None`: full attention).
    pub fn windows(&self) -> Vec<Option<usize>> {
        (0..self.num_layers)
            .map(|l| self.layer_windows.get(l).copied().flatten())
            .collect()
    }

    /// The layout of this decoder's paged KV cache: its layers in page groups by window.
    pub fn kv_layout(&self, page_size: usize, dtype: maxc_schema::KvDtype) -> KvLayout {
        if let Some(m) = &self.mla {
            let width = m.kv_lora_rank + m.qk_rope_head_dim;
            return KvLayout::latent(&self.windows(), width, page_size, dtype);
        }
        KvLayout::grouped(
            &self.windows(),
            self.num_kv_heads,
            self.head_dim,
            page_size,
            dtype,
        )
    }
}

/// Each layer's sliding window, from `layer_types` (transformers 5, and Gemma 3's in 4) where
/// the config has it, else from `use_sliding_window` with `max_window_layers` (Qwen2's rule:
/// layers from `max_window_layers` on slide), else, with `every_layer` (Mistral), from
/// `sliding_window` alone. Empty where no layer slides, or where the window is at least
/// `max_position_embeddings`.
pub fn read_layer_windows(
    cfg: &ConfigReader<'_>,
    num_layers: usize,
    every_layer: bool,
) -> Result<Vec<Option<usize>>> {
    let window = cfg.opt_usize("sliding_window")?;
    if window == Some(0) {
        return Err(cfg.error("sliding_window", "is 0; expected a positive window or null"));
    }
    // A window that spans the whole context hides nothing: those layers attend fully, as in
    // transformers' masks (every Phi-3.5 and Phi-4-mini config sets 262144 over a 131072 context).
    let context = cfg.opt_usize("max_position_embeddings")?;
    if let (Some(w), Some(ctx)) = (window, context) {
        if w >= ctx {
            return Ok(Vec::new());
        }
    }
    let need = |why: &str| {
        window.ok_or_else(|| {
            cfg.error(
                "sliding_window",
                format!("missing, but {why} slides; expected the window's size"),
            )
        })
    };
    let windows: Vec<Option<usize>> = if let Some(types) = cfg.get("layer_types") {
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
        types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(None),
                Some("sliding_attention") => need(&format!("layer_types[{i}]")).map(Some),
                _ => Err(cfg.error(
                    &format!("layer_types[{i}]"),
                    format!(
                        "{t} is not a layer type; expected full_attention or sliding_attention"
                    ),
                )),
            })
            .collect::<Result<_>>()?
    } else if let Some(use_sliding) = cfg.opt_bool("use_sliding_window")? {
        if !use_sliding {
            return Ok(Vec::new());
        }
        let w = need("use_sliding_window")?;
        let from = cfg.opt_usize("max_window_layers")?.unwrap_or(0);
        (0..num_layers).map(|l| (l >= from).then_some(w)).collect()
    } else if every_layer {
        vec![window; num_layers]
    } else {
        Vec::new()
    };
    Ok(if windows.iter().all(Option::is_none) {
        Vec::new()
    } else {
        windows
    })
}

/// Key paths, as candle's `VarBuilder::pp`: `Path::new("model").pp("layers").pp(0)`.
#[derive(Clone, Debug)]
pub(super) struct KeyPath(pub(super) String);

impl KeyPath {
    fn new(root: &str) -> Self {
        KeyPath(root.to_string())
    }
    pub(super) fn pp(&self, part: impl std::fmt::Display) -> Self {
        if self.0.is_empty() {
            KeyPath(part.to_string())
        } else {
            KeyPath(format!("{}.{part}", self.0))
        }
    }
    pub(super) fn key(&self, leaf: &str) -> String {
        self.pp(leaf).0
    }
}

/// The per-step inputs every decoder layer reads.
pub(super) struct StepInputs {
    pub(super) kv_cache: NodeIndex,
    /// The KV cache's layout.
    pub(super) kv: KvLayout,
    /// Each page group's lookup table.
    pub(super) lookups: Vec<NodeIndex>,
    pub(super) cache_lengths: NodeIndex,
    pub(super) row_offsets: NodeIndex,
    pub(super) positions: NodeIndex,
    /// Each sequence's context (cached plus new tokens), where the deployment's
    /// `takes_batch_context_lengths` hook asks for it.
    pub(super) context_lengths: Option<NodeIndex>,
}

/// The module beside a spread MoE block's router (`…mlp.expert_select.weight`, `[experts per
/// rank, experts]`): row `i` is one-hot at the rank's `i`-th expert, so that the routing weights
/// times its transpose are the rank's columns of them, exactly.
pub const EXPERT_SELECT: &str = "expert_select";

/// Whether a deployment spreads a mixture's experts over its tensor-parallel ranks (an
/// expert-parallel degree equal to the tensor-parallel one) instead of splitting each expert.
pub fn experts_spread(runtime: &crate::ModuleRuntime) -> bool {
    runtime.tensor_parallel_degree > 1
        && runtime.expert_parallel_degree == runtime.tensor_parallel_degree
}

/// Whether the vocabulary projection is split by rows over `ranks` tensor-parallel ranks: where
/// there are several, the vocabulary divides, and the projection has weights of its own. A tied
/// one stays the (replicated) embedding table: a split copy of its rows would cost each rank
/// `1/ranks` of the table in memory for `1/ranks` of the head's work (the 1B-shaped checkpoint
/// at degree 2: +107 MB a rank), until the lookup splits the table too.
pub fn head_split(cfg: &DecoderConfig, ranks: usize) -> bool {
    ranks > 1 && !cfg.tie_word_embeddings && cfg.vocab_size.is_multiple_of(ranks)
}

/// `(module, expert, rest)` of a routed expert's weight key, `{module}.experts.{e}.{rest}`.
fn expert_key(key: &str) -> Option<(&str, usize, &str)> {
    let (head, after) = key.split_once(".experts.")?;
    let (e, tail) = after.split_once('.')?;
    Some((head, e.parse().ok()?, tail))
}

/// Builds a decoder's graph: embedding, `num_layers` pre-norm blocks (attention over the paged
/// KV cache, then a dense SwiGLU or MoE MLP, each with a residual add), the final norm and the
/// LM head. Weight keys are those of the Hugging Face checkpoint, without any role prefix.
pub fn build_decoder(cfg: &DecoderConfig, role: GraphRole, opts: &BuildOptions) -> Result<Graph> {
    let degree = opts.runtime.tensor_parallel_degree;
    let sharded;
    let cfg = if degree > 1 {
        sharded = cfg.shard(degree, experts_spread(&opts.runtime))?;
        &sharded
    } else {
        cfg
    };
    let max_seq_len = opts.runtime.batch.max_seq_len;
    let local = cfg.gemma.as_ref().map(|g| &g.local_rope);
    for rope in std::iter::once(&cfg.rope).chain(local) {
        rope.check_context(max_seq_len)
            .map_err(|message| crate::Error::Setting {
                field: "max_seq_len".into(),
                value: max_seq_len.to_string(),
                message,
            })?;
    }
    let b = DecoderBuilder {
        b: GraphBuilder::new(role),
        cfg,
        opts,
    };
    b.build()
}

pub(super) struct DecoderBuilder<'a> {
    pub(super) b: GraphBuilder,
    pub(super) cfg: &'a DecoderConfig,
    pub(super) opts: &'a BuildOptions,
}

impl DecoderBuilder<'_> {
    pub(super) fn weight(&mut self, key: String, shape: &[usize]) -> Result<NodeIndex> {
        let ty = TensorType::new(self.opts.param_dtype, shape.iter().map(|&d| Dim::Fixed(d)));
        self.b.param(&key, ty)
    }

    /// `x · Wᵀ (+ bias)` with the weight at `path.weight` of shape `[out, in]`.
    pub(super) fn linear(
        &mut self,
        path: &KeyPath,
        x: NodeIndex,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<NodeIndex> {
        let w = self.weight(path.key("weight"), &[out, inp])?;
        let y = self.b.op(&path.0, Op::Linear, &[x, w])?;
        self.with_bias(path, y, out, bias)
    }

    /// `y` plus the bias at `path.bias` (`[out]`) where there is one.
    fn with_bias(
        &mut self,
        path: &KeyPath,
        y: NodeIndex,
        out: usize,
        bias: bool,
    ) -> Result<NodeIndex> {
        if !bias {
            return Ok(y);
        }
        let bw = self.weight(path.key("bias"), &[out])?;
        self.b.op(&path.key("add_bias"), Op::Add, &[y, bw])
    }

    /// [`Self::linear`] of a weight whose input columns are split over the tensor-parallel
    /// ranks: each rank's partial product summed over the ranks, then the (replicated) bias.
    pub(super) fn row_split_linear(
        &mut self,
        path: &KeyPath,
        x: NodeIndex,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<NodeIndex> {
        if self.opts.runtime.tensor_parallel_degree <= 1 {
            return self.linear(path, x, out, inp, bias);
        }
        let y = self.linear(path, x, out, inp, false)?;
        let y = self.b.op(&path.key("all_reduce"), Op::AllReduceSum, &[y])?;
        self.with_bias(path, y, out, bias)
    }

    pub(super) fn rms_norm(&mut self, path: &KeyPath, x: NodeIndex) -> Result<NodeIndex> {
        self.rms_norm_of(path, x, self.cfg.hidden_size)
    }

    /// RMSNorm over the last `width` values (the hidden size, or a head's).
    pub(super) fn rms_norm_of(
        &mut self,
        path: &KeyPath,
        x: NodeIndex,
        width: usize,
    ) -> Result<NodeIndex> {
        let w = self.weight(path.key("weight"), &[width])?;
        let offset = match &self.cfg.gemma {
            Some(g) if g.unit_offset_norms => 1.0,
            _ => 0.0,
        };
        self.b.op(
            &path.0,
            Op::RmsNorm {
                eps: self.cfg.rms_norm_eps as f32,
                offset,
            },
            &[x, w],
        )
    }

    /// What the embeddings are multiplied by: `sqrt(hidden_size)` in f32 for Gemma, else 1.
    fn embed_scale(&self) -> f32 {
        match &self.cfg.gemma {
            Some(g) if g.scaled_embeddings => (self.cfg.hidden_size as f64).sqrt() as f32,
            _ => 1.0,
        }
    }

    pub(super) fn reshape(
        &mut self,
        name: String,
        x: NodeIndex,
        shape: Vec<Dim>,
    ) -> Result<NodeIndex> {
        self.b.op(&name, Op::Reshape { shape }, &[x])
    }

    fn build(mut self) -> Result<Graph> {
        let c = self.cfg;
        let t = || Dim::sym(names::TOTAL_SEQ_LEN);
        let bsz = || Dim::sym(names::BATCH_SIZE);
        let tokens = self.b.input("tokens", TensorType::new(DType::I64, [t()]))?;
        let row_offsets = self.b.input(
            "input_row_offsets",
            TensorType::new(DType::I32, [Dim::sym(names::INPUT_ROW_OFFSETS_LEN)]),
        )?;
        let cache_lengths = self
            .b
            .input("cache_lengths", TensorType::new(DType::I32, [bsz()]))?;
        let kv = c.kv_layout(self.opts.page_size, self.opts.runtime.kv.dtype);
        let lookups = (0..kv.groups.len().max(1))
            .map(|g| {
                self.b.input(
                    &maxc_schema::kv_lookup_input(g),
                    TensorType::new(DType::I32, [bsz(), Dim::sym(names::MAX_NUM_PAGES)]),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let logit_indices = self.b.input(
            "logit_indices",
            TensorType::new(DType::I32, [Dim::sym(names::LOGIT_ROWS)]),
        )?;
        let context_lengths = if self.opts.takes_batch_context_lengths {
            Some(self.b.input(
                "batch_context_lengths",
                TensorType::new(DType::I32, [bsz()]),
            )?)
        } else {
            None
        };
        let kv_cache = self.b.kv_cache(kv.clone())?;

        let model = KeyPath::new("model");
        let embed = self.weight(
            model.pp("embed_tokens").key("weight"),
            &[c.vocab_size, c.hidden_size],
        )?;
        let mut h = self.b.op(
            "model.embed_tokens",
            Op::Embedding {
                scale: self.embed_scale(),
            },
            &[embed, tokens],
        )?;
        let positions = self.b.op(
            "positions",
            Op::Positions,
            &[tokens, row_offsets, cache_lengths],
        )?;
        let step = StepInputs {
            kv_cache,
            kv,
            lookups,
            cache_lengths,
            row_offsets,
            positions,
            context_lengths,
        };

        for layer in 0..c.num_layers {
            let lp = model.pp("layers").pp(layer);
            let sandwich = c.gemma.as_ref().is_some_and(|g| g.sandwich_norms);
            let x = self.rms_norm(&lp.pp("input_layernorm"), h)?;
            let mut attn = match &c.mla {
                Some(m) => self.latent_attention(&lp.pp("self_attn"), layer, x, &step, m)?,
                None => self.attention(&lp.pp("self_attn"), layer, x, &step)?,
            };
            if sandwich {
                attn = self.rms_norm(&lp.pp("post_attention_layernorm"), attn)?;
            }
            h = self.b.op(&lp.key("attn_residual"), Op::Add, &[h, attn])?;
            let pre_mlp = if sandwich {
                "pre_feedforward_layernorm"
            } else {
                "post_attention_layernorm"
            };
            let x = self.rms_norm(&lp.pp(pre_mlp), h)?;
            let mut mlp = match &c.moe {
                Some(moe) if !moe.dense_layers.contains(&layer) => {
                    self.moe(&lp.pp(moe.naming.names().0), x, moe)?
                }
                _ => self.mlp(&lp.pp("mlp"), x, c.intermediate_size)?,
            };
            if sandwich {
                mlp = self.rms_norm(&lp.pp("post_feedforward_layernorm"), mlp)?;
            }
            h = self.b.op(&lp.key("mlp_residual"), Op::Add, &[h, mlp])?;
        }
        let h = self.rms_norm(&model.pp("norm"), h)?;
        // Every row's final hidden state, which embeddings pool (it lives to the step's end).
        self.b.output("hidden_states", h);
        // The head runs only on the rows the step returns logits for.
        let h = self
            .b
            .op("logit_rows", Op::LogitRows, &[h, logit_indices])?;
        // Split over tensor-parallel ranks by rows (each rank's share of the vocabulary), the
        // logits gathered; replicated where tied or where the vocabulary does not divide.
        let ranks = self.opts.runtime.tensor_parallel_degree;
        let split = head_split(c, ranks);
        let head = if c.tie_word_embeddings {
            embed
        } else {
            let rows = if split {
                c.vocab_size / ranks
            } else {
                c.vocab_size
            };
            self.weight("lm_head.weight".into(), &[rows, c.hidden_size])?
        };
        let logits = if split {
            let local = self.b.op("lm_head", Op::Linear, &[h, head])?;
            self.b
                .op("lm_head.all_gather", Op::AllGather { ranks }, &[local])?
        } else {
            self.b.op("lm_head", Op::Linear, &[h, head])?
        };
        self.b.output("logits", logits);
        self.b.finish()
    }

    fn attention(
        &mut self,
        p: &KeyPath,
        layer: usize,
        x: NodeIndex,
        s: &StepInputs,
    ) -> Result<NodeIndex> {
        let c = self.cfg;
        let (hq, hkv, d, hid) = (c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size);
        let t = || Dim::sym(names::TOTAL_SEQ_LEN);
        let window = c.layer_windows.get(layer).copied().flatten();
        let rope = match &c.gemma {
            Some(g) if window.is_some() => &g.local_rope,
            _ => &c.rope,
        };
        let table = rope.table(c.rotary_dim.unwrap_or(d), self.opts.checkpoint_dtype);
        let heads = |this: &mut Self, name: &str, n: usize, rope: bool| -> Result<NodeIndex> {
            let proj = p.pp(format!("{name}_proj"));
            let y = this.linear(&proj, x, n * d, hid, c.biases.qkv)?;
            let mut y = this.reshape(proj.key("heads"), y, vec![t(), n.into(), d.into()])?;
            if !rope {
                return Ok(y);
            }
            if c.qk_norm {
                y = this.rms_norm_of(&p.pp(format!("{name}_norm")), y, d)?;
            }
            this.b.op(
                &proj.key("rope"),
                Op::Rope {
                    table: table.clone(),
                },
                &[y, s.positions],
            )
        };
        let q = heads(self, "q", hq, true)?;
        let k = heads(self, "k", hkv, true)?;
        let v = heads(self, "v", hkv, false)?;
        let scale = match &c.gemma {
            Some(g) => g.attention_scale,
            None => 1.0 / (d as f32).sqrt(),
        };
        let a = self.b.op(
            &p.key("attention"),
            Op::PagedAttention {
                layer,
                scale,
                window,
            },
            &[
                q,
                k,
                v,
                s.kv_cache,
                s.lookups[s.kv.slot(layer).map_or(0, |k| k.group)],
                s.cache_lengths,
                s.row_offsets,
            ],
        )?;
        let a = self.reshape(p.key("merge_heads"), a, vec![t(), (hq * d).into()])?;
        self.row_split_linear(&p.pp("o_proj"), a, hid, hq * d, c.biases.o)
    }

    /// The SwiGLU MLP of width `f` at `p` (`gate_proj`, `up_proj`, `down_proj`).
    pub(super) fn mlp(&mut self, p: &KeyPath, x: NodeIndex, f: usize) -> Result<NodeIndex> {
        let (h, bias) = (self.cfg.hidden_size, self.cfg.biases.mlp);
        let gate = self.linear(&p.pp("gate_proj"), x, f, h, bias)?;
        let up = self.linear(&p.pp("up_proj"), x, f, h, bias)?;
        let act = match &self.cfg.gemma {
            Some(g) if g.gelu_tanh => Op::GeluTanh,
            _ => Op::Silu,
        };
        let act = self.b.op(&p.key("act"), act, &[gate])?;
        let prod = self.b.op(&p.key("gate_up"), Op::Mul, &[act, up])?;
        self.row_split_linear(&p.pp("down_proj"), prod, h, f, bias)
    }

    /// The sparse MoE block of Mixtral and Qwen3-MoE: softmax router, top-k (renormalized
    /// where the model says), SwiGLU experts (gate, up, down as [`MoeNaming`] names them).
    fn moe(&mut self, p: &KeyPath, x: NodeIndex, moe: &MoeConfig) -> Result<NodeIndex> {
        let h = self.cfg.hidden_size;
        let f = moe
            .expert_intermediate_size
            .unwrap_or(self.cfg.intermediate_size);
        let [gate, up, down] = moe.naming.names().1;
        let router = self.linear(&p.pp("gate"), x, moe.num_experts, h, false)?;
        let routing = match &moe.grouped_router {
            Some(g) => {
                let bias = self.weight(
                    p.pp("gate").key("e_score_correction_bias"),
                    &[moe.num_experts],
                )?;
                self.b.op(
                    &p.key("router"),
                    Op::MoeRouter {
                        top_k: moe.top_k,
                        n_group: g.n_group,
                        topk_group: g.topk_group,
                        scoring: g.scoring,
                        group_score: g.group_score,
                        renormalize: moe.renormalize,
                        scale: g.scale,
                    },
                    &[router, bias],
                )?
            }
            None => {
                let probs = self
                    .b
                    .op(&p.key("router_softmax"), Op::Softmax, &[router])?;
                self.b.op(
                    &p.key("router_top_k"),
                    Op::TopK {
                        k: moe.top_k,
                        renormalize: moe.renormalize,
                    },
                    &[probs],
                )?
            }
        };
        // Experts spread over the tensor-parallel ranks: this rank's routing columns (by its
        // `expert_select` rows, exact: one 1 per row) and its own experts alone.
        let spread = experts_spread(&self.opts.runtime);
        let experts = if spread {
            moe.num_experts / self.opts.runtime.tensor_parallel_degree
        } else {
            moe.num_experts
        };
        let routing = if spread {
            self.linear(
                &p.pp(EXPERT_SELECT),
                routing,
                experts,
                moe.num_experts,
                false,
            )?
        } else {
            routing
        };
        let mut operands = vec![x, routing];
        for e in 0..experts {
            let ep = p.pp("experts").pp(e);
            operands.push(self.weight(ep.pp(gate).key("weight"), &[f, h])?);
            operands.push(self.weight(ep.pp(up).key("weight"), &[f, h])?);
            operands.push(self.weight(ep.pp(down).key("weight"), &[h, f])?);
        }
        let routed = self.b.op(
            &p.key("experts"),
            Op::MoeExperts {
                num_experts: experts,
            },
            &operands,
        )?;
        // Each tensor-parallel rank computed its share of every expert's width: a partial sum.
        let routed = if self.opts.runtime.tensor_parallel_degree > 1 {
            self.b.op(
                &p.pp("experts").key("all_reduce"),
                Op::AllReduceSum,
                &[routed],
            )?
        } else {
            routed
        };
        match moe.shared_intermediate_size {
            Some(width) => {
                let shared = self.mlp(&p.pp("shared_experts"), x, width)?;
                self.b
                    .op(&p.key("shared_experts_add"), Op::Add, &[routed, shared])
            }
            None => Ok(routed),
        }
    }
}
