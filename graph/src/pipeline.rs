//! The weight pipeline and graph building in DESIGN.md's order, as one call: read the checkpoint
//! (memory-mapped) -> finalize from raw keys where asked -> `prepare_weights` -> per role: select
//! by prefix and strip it -> convert to the parameter dtype -> bind strictly to the graph.

use crate::arch::gguf::config_from_gguf;
use crate::arch::{BuildOptions, ModelSpec};
use crate::deployment::ModelLoadContext;
use crate::ir::TensorType;
use crate::weights::gguf::{GgufFile, GgufValue};
use crate::weights::{load_checkpoint_weights, StateDict};
use crate::{DType, DeploymentConfig, Error, Graph, GraphRole, ModuleRuntime, Registry, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The formats weights are stored in: `--weights keep|f32|bf16|f16|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// Each weight as the checkpoint stores it (float types and GGUF blocks); block weights
    /// bound where a kernel cannot read blocks (a norm, say) are dequantized to f32.
    #[default]
    Keep,
    /// Every weight in this float type (blocks dequantized).
    Float(DType),
    /// Matmul weights and embedding tables quantized to this block type where their rows are
    /// whole blocks (Q4_K falls back to Q5_0 as ggml does), the other weights kept.
    Quantize(DType),
}

impl WeightFormat {
    /// The name as the command line spells it.
    pub fn name(&self) -> String {
        match self {
            WeightFormat::Keep => "keep".into(),
            WeightFormat::Float(d) | WeightFormat::Quantize(d) => d.name().into(),
        }
    }

    /// The dtype weight `w`, bound to a parameter that may (`blocks`) or may not hold blocks,
    /// is stored in.
    pub fn dtype_for(&self, w: &crate::weights::WeightTensor, blocks: bool) -> DType {
        let kept = if w.dtype.is_quantized() && !blocks {
            DType::F32
        } else {
            w.dtype
        };
        match *self {
            WeightFormat::Keep => kept,
            WeightFormat::Float(d) if w.dtype.is_real() => d,
            WeightFormat::Float(_) => w.dtype,
            WeightFormat::Quantize(q) if blocks && w.shape.len() == 2 => {
                crate::weights::quantize::format_for(q, &w.shape).unwrap_or(kept)
            }
            WeightFormat::Quantize(_) => kept,
        }
    }
}

impl From<DType> for WeightFormat {
    fn from(d: DType) -> Self {
        if d.is_quantized() {
            WeightFormat::Quantize(d)
        } else {
            WeightFormat::Float(d)
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        use crate::weights::quantize::QUANTIZERS;
        if s.eq_ignore_ascii_case("keep") {
            return Ok(WeightFormat::Keep);
        }
        let expected = "keep, f32, bf16, f16, q8_0, q4_0, q4_1, q5_0, q5_1 or q4_k";
        match s.parse::<DType>() {
            Ok(d) if d.is_float() => Ok(WeightFormat::Float(d)),
            Ok(d) if QUANTIZERS.contains(&d) => Ok(WeightFormat::Quantize(d)),
            _ => Err(format!("unknown weight format `{s}` (expected {expected})")),
        }
    }
}

/// What to load, and how.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The deployment.
    pub runtime: ModuleRuntime,
    /// The formats weights are stored in.
    pub weights: WeightFormat,
    /// The roles to build; empty means every role of the model.
    pub roles: Vec<GraphRole>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            runtime: ModuleRuntime::default(),
            weights: WeightFormat::Keep,
            roles: Vec::new(),
        }
    }
}

/// One role's graph with its bound weights (keys are the graph's parameter names).
#[derive(Clone, Debug)]
pub struct RoleGraph {
    /// The graph.
    pub graph: Graph,
    /// Exactly the graph's parameters, converted to their dtype (tensor-parallel rank 0's share
    /// where the deployment has several ranks).
    pub weights: StateDict,
    /// Tensor-parallel ranks 1.. of the same graph: each one's share of the weights (empty at
    /// degree 1).
    pub rank_weights: Vec<StateDict>,
}

/// A checkpoint turned into graphs.
#[derive(Debug)]
pub struct LoadedModel {
    /// The checkpoint folder or GGUF file.
    pub dir: PathBuf,
    /// config.json as read.
    pub config_json: serde_json::Value,
    /// The parsed model.
    pub spec: Box<dyn ModelSpec>,
    /// The deployment config, completed by the runtime.
    pub deployment: DeploymentConfig,
    /// The graphs, by role.
    pub roles: BTreeMap<GraphRole, RoleGraph>,
}

/// A checkpoint's tokenizer: `tokenizer.json` text and the chat template, where it has them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerFiles {
    /// A Hugging Face `tokenizer.json`.
    pub json: Option<String>,
    /// A Jinja chat template.
    pub chat_template: Option<String>,
    /// Why a GGUF's tokenizer was left out (a tokenizer model maxc does not build yet): the
    /// model still compiles, to be run on token ids.
    pub left_out: Option<String>,
}

/// The tokenizer of a checkpoint: a folder's `tokenizer.json` and `tokenizer_config.json`'s
/// `chat_template`; for a GGUF file, a `tokenizer.json` built from its metadata and its
/// `tokenizer.chat_template`.
pub fn read_tokenizer(path: &Path) -> Result<TokenizerFiles> {
    if is_gguf(path) {
        let gguf = GgufFile::open(path)?;
        let model = gguf.get("tokenizer.ggml.model").and_then(GgufValue::as_str);
        match model {
            None => return Ok(TokenizerFiles::default()),
            Some(m) if !crate::tokenizer::TOKENIZER_MODELS.contains(&m) => {
                return Ok(TokenizerFiles {
                    left_out: Some(format!(
                        "{}: `tokenizer.ggml.model` is `{m}`; maxc builds {} tokenizers only, so the artifact has none: send token ids",
                        path.display(),
                        crate::tokenizer::TOKENIZER_MODELS.join(" and ")
                    )),
                    ..Default::default()
                })
            }
            Some(_) => {}
        }
        return Ok(TokenizerFiles {
            json: Some(crate::tokenizer::tokenizer_json_from_gguf(&gguf)?),
            chat_template: crate::tokenizer::chat_template_from_gguf(&gguf),
            left_out: None,
        });
    }
    let json_path = path.join("tokenizer.json");
    let json = match json_path.is_file() {
        true => Some(std::fs::read_to_string(&json_path).map_err(|e| Error::io(&json_path, e))?),
        false => None,
    };
    let config_path = path.join("tokenizer_config.json");
    let chat_template = if config_path.is_file() {
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(&config_path, format!("not valid JSON: {e}")))?;
        match v.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            // A list of named templates: the one named `default`.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        }
    } else {
        None
    };
    Ok(TokenizerFiles {
        left_out: None,
        json,
        chat_template,
    })
}

/// Whether `path` is a GGUF file (rather than a checkpoint folder).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Reads and parses the model's config: `path/config.json` for a folder, the metadata of a GGUF
/// file.
pub fn read_config(
    path: &Path,
    registry: &Registry,
) -> Result<(serde_json::Value, Box<dyn ModelSpec>)> {
    if is_gguf(path) {
        let gguf = GgufFile::open(path)?;
        let json = config_from_gguf(&gguf)?;
        let spec = registry.parse_config(path, &json)?;
        return Ok((json, spec));
    }
    let file = path.join("config.json");
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(&file, format!("not valid JSON: {e}")))?;
    let spec = registry.parse_config(&file, &json)?;
    Ok((json, spec))
}

/// The raw weights of a checkpoint folder or GGUF file.
pub fn read_weights(path: &Path) -> Result<StateDict> {
    if is_gguf(path) {
        GgufFile::open(path)?.state_dict()
    } else {
        load_checkpoint_weights(path)
    }
}

/// Loads the checkpoint (a folder, or a GGUF file) at `dir` and builds the graph of every
/// requested role.
pub fn load_model(dir: &Path, registry: &Registry, opts: &LoadOptions) -> Result<LoadedModel> {
    opts.runtime.validate()?;
    let (config_json, spec) = read_config(dir, registry)?;
    let roles = if opts.roles.is_empty() {
        spec.roles()
    } else {
        opts.roles.clone()
    };
    for role in &roles {
        if !spec.roles().contains(role) {
            return Err(Error::Setting {
                field: "role".into(),
                value: role.to_string(),
                message: format!(
                    "{} has roles {:?}",
                    spec.architecture(),
                    spec.roles().iter().map(|r| r.name()).collect::<Vec<_>>()
                ),
            });
        }
    }
    let ctx = ModelLoadContext {
        roles: roles.clone(),
    };
    let mut deployment = spec
        .deployment()
        .apply_runtime(&opts.runtime)?
        .apply_model_load_context(&ctx)?;
    // The EP init graph goes into the artifact only where the deployment exports it.
    let mut roles = roles;
    if !deployment.export_ep_init {
        if !opts.roles.is_empty() && opts.roles.contains(&GraphRole::EpInit) {
            return Err(Error::Setting {
                field: "role".into(),
                value: GraphRole::EpInit.to_string(),
                message: format!(
                    "this deployment of {} exports no EP init graph (it needs an expert-parallel degree above 1 and expert-parallel communication)",
                    spec.architecture()
                ),
            });
        }
        roles.retain(|r| *r != GraphRole::EpInit);
    }

    if opts.runtime.tensor_parallel_degree > 1 {
        if let Some(r) = roles.iter().find(|r| **r != GraphRole::Decoder) {
            return Err(Error::Setting {
                field: "tensor_parallel_degree".into(),
                value: opts.runtime.tensor_parallel_degree.to_string(),
                message: format!(
                    "{} has a {r} role, which tensor parallelism does not split yet (the decoder alone can be)",
                    spec.architecture()
                ),
            });
        }
    }
    let raw = read_weights(dir)?;
    let checkpoint_dtype = stored_float_dtype(&raw);
    if deployment.preserve_checkpoint_keys {
        deployment = deployment.finalize_from_checkpoint(&raw)?;
    }
    let prepared = deployment.prepare_weights(raw)?;
    check_outside_prefixes(&deployment, &spec.roles(), &prepared)?;

    let build = BuildOptions {
        param_dtype: match opts.weights {
            WeightFormat::Float(d) => d,
            _ => DType::F32,
        },
        page_size: opts.runtime.kv.page_size,
        takes_batch_context_lengths: deployment.takes_batch_context_lengths,
        checkpoint_dtype,
        runtime: opts.runtime.clone(),
    };
    let mut built = BTreeMap::new();
    for role in roles {
        let mut graph = spec.build(role, &build)?;
        if role == GraphRole::EpInit {
            // The exchange state holds no weights.
            graph.validate()?;
            built.insert(
                role,
                RoleGraph {
                    graph,
                    weights: StateDict::new(),
                    rank_weights: Vec::new(),
                },
            );
            continue;
        }
        let selected = deployment.role_weights(role, &prepared);
        let prefix = deployment.weight_prefixes.get(&role).map(String::as_str);
        let degree = opts.runtime.tensor_parallel_degree;
        if degree <= 1 {
            let weights = bind_weights(role, &mut graph, selected, prefix, opts.weights)?;
            built.insert(
                role,
                RoleGraph {
                    graph,
                    weights,
                    rank_weights: Vec::new(),
                },
            );
            continue;
        }
        // Every rank builds the same graph (its share of the heads and width); the weights are
        // each rank's rows and columns of the whole model's.
        let cfg = spec.decoder(role).ok_or_else(|| Error::Setting {
            field: "tensor_parallel_degree".into(),
            value: degree.to_string(),
            message: format!(
                "{} role {role} has no decoder to split",
                spec.architecture()
            ),
        })?;
        let mut shares = Vec::with_capacity(degree);
        for rank in 0..degree {
            let spread = crate::arch::decoder::experts_spread(&opts.runtime);
            let share = cfg.shard_weights(&selected, rank, degree, spread)?;
            shares.push(bind_weights(role, &mut graph, share, prefix, opts.weights)?);
        }
        let weights = shares.remove(0);
        built.insert(
            role,
            RoleGraph {
                graph,
                weights,
                rank_weights: shares,
            },
        );
    }
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        config_json,
        spec,
        deployment,
        roles: built,
    })
}

/// The float dtype holding most of the checkpoint's float weight elements (f32 when none).
pub fn stored_float_dtype(weights: &StateDict) -> DType {
    let mut elems: BTreeMap<DType, usize> = BTreeMap::new();
    for (_, w) in weights.iter().filter(|(_, w)| w.dtype.is_float()) {
        *elems.entry(w.dtype).or_insert(0) += w.numel();
    }
    elems
        .into_iter()
        .max_by_key(|&(d, n)| (n, std::cmp::Reverse(d)))
        .map_or(DType::F32, |(d, _)| d)
}

/// Where every role has a prefix, weights under none of them belong to no role: an error.
fn check_outside_prefixes(
    deployment: &DeploymentConfig,
    roles: &[GraphRole],
    weights: &StateDict,
) -> Result<()> {
    let prefixes: Vec<&str> = roles
        .iter()
        .filter_map(|r| deployment.weight_prefixes.get(r).map(String::as_str))
        .collect();
    if prefixes.len() < roles.len() {
        return Ok(()); // a role without a prefix takes every weight; binding checks what it leaves.
    }
    let stray: Vec<&String> = weights
        .keys()
        .filter(|k| !prefixes.iter().any(|p| k.starts_with(p)))
        .collect();
    if stray.is_empty() {
        return Ok(());
    }
    Err(Error::UnusedWeights {
        role: format!("(none; role prefixes are {})", prefixes.join(", ")),
        count: stray.len(),
        keys: list_keys(stray.into_iter()),
    })
}

fn list_keys<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let keys: Vec<&String> = keys.collect();
    let mut shown: Vec<String> = keys.iter().take(8).map(|k| format!("`{k}`")).collect();
    if keys.len() > 8 {
        shown.push(format!("... and {} more", keys.len() - 8));
    }
    shown.join(", ")
}

/// Binds `weights` to the graph's parameters strictly: a missing, unused or mis-shaped key is an
/// error naming it. Each weight is converted to the dtype `format` gives it, and its parameter
/// in `graph` takes that dtype.
pub fn bind_weights(
    role: GraphRole,
    graph: &mut Graph,
    weights: StateDict,
    prefix: Option<&str>,
    format: WeightFormat,
) -> Result<StateDict> {
    let params: BTreeMap<String, TensorType> = graph.params();
    let block_params = graph.block_params();
    let mut bound = StateDict::new();
    for (key, ty) in &params {
        let expected: Vec<usize> = ty.shape.iter().map(|d| d.fixed().unwrap_or(0)).collect();
        let w = weights.get(key).ok_or_else(|| Error::MissingWeight {
            role: role.to_string(),
            key: key.clone(),
            expected: ty.to_string(),
            hint: prefix
                .map(|p| format!("; looked for `{p}{key}` in the checkpoint"))
                .unwrap_or_default(),
        })?;
        if w.shape != expected {
            return Err(Error::WeightShape {
                role: role.to_string(),
                key: key.clone(),
                found: w.shape.clone(),
                expected,
            });
        }
        let dtype = format.dtype_for(w, block_params.contains(key));
        bound.insert(key.clone(), w.convert(dtype, key)?);
        graph.set_param_dtype(key, dtype)?;
    }
    let used: BTreeSet<&String> = params.keys().collect();
    let unused: Vec<&String> = weights.keys().filter(|k| !used.contains(k)).collect();
    if !unused.is_empty() {
        return Err(Error::UnusedWeights {
            role: role.to_string(),
            count: unused.len(),
            keys: list_keys(unused.into_iter()),
        });
    }
    Ok(bound)
}
