//! Graph roles and the per-architecture deployment config with its hooks.

use crate::weights::StateDict;
use crate::{ModuleRuntime, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A graph that a model needs. One artifact holds the programs of all its roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphRole {
    /// The language model.
    Decoder,
    /// A speculative-decoding draft model.
    Draft,
    /// Expert-parallel exchange initialization.
    EpInit,
}

impl GraphRole {
    /// Every role, in a stable order.
    pub const ALL: [GraphRole; 3] = [GraphRole::Decoder, GraphRole::Draft, GraphRole::EpInit];

    /// The role's name (`decoder`, `draft`, `ep_init`).
    pub fn name(self) -> &'static str {
        match self {
            GraphRole::Decoder => "decoder",
            GraphRole::Draft => "draft",
            GraphRole::EpInit => "ep_init",
        }
    }
}

impl fmt::Display for GraphRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for GraphRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        GraphRole::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role `{s}` (expected decoder, draft or ep_init)"))
    }
}

/// Composition-only settings, known when a model is loaded (before any graph is built).
#[derive(Clone, Debug, Default)]
pub struct ModelLoadContext {
    /// The roles being composed into this artifact; empty means every role of the architecture.
    pub roles: Vec<GraphRole>,
}

/// The architecture-specific parts of a deployment config: the hooks. Every method has the
/// default that DESIGN.md gives, so an architecture overrides only what it changes.
pub trait DeploymentHooks: Send + Sync + fmt::Debug {
    /// Completes `config` with the deployment before any graph is built.
    fn apply_runtime(
        &self,
        config: DeploymentConfig,
        _runtime: &ModuleRuntime,
    ) -> Result<DeploymentConfig> {
        Ok(config)
    }

    /// Completes composition-only settings.
    fn apply_model_load_context(
        &self,
        config: DeploymentConfig,
        _ctx: &ModelLoadContext,
    ) -> Result<DeploymentConfig> {
        Ok(config)
    }

    /// Reads the raw checkpoint keys, before `prepare_weights`; called only where
    /// `preserve_checkpoint_keys` is set.
    fn finalize_from_checkpoint(
        &self,
        config: DeploymentConfig,
        _raw: &StateDict,
    ) -> Result<DeploymentConfig> {
        Ok(config)
    }

    /// The architecture's weight transforms (renames, fusions, un-permutations, dequantization).
    /// Runs before role prefixes are applied and before dtype conversion.
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        Ok(weights)
    }

    /// What the exporter records of the deployment, by name.
    fn export_records(&self, _runtime: &ModuleRuntime) -> BTreeMap<String, Value> {
        BTreeMap::new()
    }
}

/// Hooks that keep every default.
#[derive(Debug, Default)]
pub struct DefaultHooks;

impl DeploymentHooks for DefaultHooks {}

/// How an architecture is deployed: settings plus hooks. One per architecture.
#[derive(Clone, Debug)]
pub struct DeploymentConfig {
    /// Finalization reads the raw checkpoint keys before `prepare_weights` transforms them.
    pub preserve_checkpoint_keys: bool,
    /// The checkpoint prefix each role's weights sit under; a role without one takes every weight.
    pub weight_prefixes: BTreeMap<GraphRole, String>,
    /// The decoder graph takes `batch_context_lengths` as an input.
    pub takes_batch_context_lengths: bool,
    /// Expert parallelism uses a runtime exchange.
    pub expert_parallel_communication: bool,
    /// The artifact includes the `EpInit` graph.
    pub export_ep_init: bool,
    hooks: Arc<dyn DeploymentHooks>,
}

impl Default for DeploymentConfig {
    fn default() -> Self {
        DeploymentConfig::with_hooks(Arc::new(DefaultHooks))
    }
}

impl DeploymentConfig {
    /// Default settings with an architecture's hooks.
    pub fn with_hooks(hooks: Arc<dyn DeploymentHooks>) -> Self {
        DeploymentConfig {
            preserve_checkpoint_keys: false,
            weight_prefixes: BTreeMap::new(),
            takes_batch_context_lengths: false,
            expert_parallel_communication: true,
            export_ep_init: false,
            hooks,
        }
    }

    /// See [`DeploymentHooks::apply_runtime`].
    pub fn apply_runtime(self, runtime: &ModuleRuntime) -> Result<Self> {
        let hooks = self.hooks.clone();
        hooks.apply_runtime(self, runtime)
    }

    /// See [`DeploymentHooks::apply_model_load_context`].
    pub fn apply_model_load_context(self, ctx: &ModelLoadContext) -> Result<Self> {
        let hooks = self.hooks.clone();
        hooks.apply_model_load_context(self, ctx)
    }

    /// See [`DeploymentHooks::finalize_from_checkpoint`].
    pub fn finalize_from_checkpoint(self, raw: &StateDict) -> Result<Self> {
        let hooks = self.hooks.clone();
        hooks.finalize_from_checkpoint(self, raw)
    }

    /// See [`DeploymentHooks::prepare_weights`].
    pub fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        self.hooks.prepare_weights(weights)
    }

    /// See [`DeploymentHooks::export_records`].
    /// Above tensor-parallel degree 1, also `tp.degree`, `tp.layout` and `tp.roles` (each
    /// rank's role: `decoder`, then `decoder@tp1`, ...).
    pub fn export_records(&self, runtime: &ModuleRuntime) -> BTreeMap<String, Value> {
        let mut records = self.hooks.export_records(runtime);
        let degree = runtime.tensor_parallel_degree;
        if degree > 1 {
            records.insert("tp.degree".into(), Value::from(degree));
            records.insert(
                "tp.layout".into(),
                Value::from(
                    "megatron: q/k/v and gate/up split by rows (heads, MLP width), o_proj and \
                     down_proj by columns and summed over the ranks; a mixture's experts split \
                     inside each (as a dense MLP) or spread whole over the ranks (tp.experts), \
                     its router replicated; the vocabulary projection split by rows and the \
                     logits all-gathered (replicated where the vocabulary does not divide); \
                     embeddings and norms replicated",
                ),
            );
            let roles: Vec<String> = (0..degree)
                .map(|r| match r {
                    0 => "decoder".to_string(),
                    r => format!("decoder@tp{r}"),
                })
                .collect();
            records.insert("tp.roles".into(), Value::from(roles));
        }
        records
    }

    /// The weights of `role`: those under its prefix, with the prefix stripped; every weight where
    /// the role has no prefix.
    pub fn role_weights(&self, role: GraphRole, weights: &StateDict) -> StateDict {
        match self.weight_prefixes.get(&role) {
            None => weights.clone(),
            Some(prefix) => weights.select_prefix(prefix),
        }
    }
}
