//! `MixtralForCausalLM`: the Llama decoder with a sparse MoE MLP (softmax router, top-k,
//! renormalized; SwiGLU experts), deployed with expert parallelism: its experts spread over
//! `expert_parallel_degree` ranks that exchange tokens through buffers set up once by the
//! `ep_init` graph.
//!
//! **Max tokens per rank.** In one step every active token (`max_batch_active_tokens`, all
//! replicas together) sends its `top_k` slots to the ranks holding its experts. A token's
//! experts are distinct, so at most `min(top_k, experts_per_rank)` of its slots land on one
//! rank; the worst case, every token routed to the same rank, is
//! `max_tokens_per_rank = max_batch_active_tokens × min(top_k, experts_per_rank)` slots, and
//! every receive buffer is sized for it.

use super::config::ConfigReader;
use super::decoder::{DecoderConfig, MoeConfig};
use super::ep_init::EpExchange;
use super::llama::LlamaFamilyHooks;
use super::{Architecture, BuildOptions, ModelSpec};
use crate::deployment::DeploymentHooks;
use crate::weights::StateDict;
use crate::{DeploymentConfig, Error, GraphRole, ModuleRuntime, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The Mixtral architecture.
pub struct Mixtral;

impl Architecture for Mixtral {
    fn name(&self) -> &'static str {
        "MixtralForCausalLM"
    }
    fn description(&self) -> &'static str {
        "Mixtral decoder: Llama attention, sparse MoE MLP with top-k routing"
    }
    fn roles(&self) -> &'static [GraphRole] {
        &[GraphRole::Decoder, GraphRole::EpInit]
    }
    fn parse_config(&self, cfg: &ConfigReader<'_>) -> Result<Box<dyn ModelSpec>> {
        let mut config = DecoderConfig::read(cfg)?;
        let num_experts = cfg.positive("num_local_experts")?;
        let top_k = cfg.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(cfg.error(
                "num_experts_per_tok",
                format!("is {top_k}; expected at most num_local_experts ({num_experts})"),
            ));
        }
        config.moe = Some(MoeConfig::new(num_experts, top_k));
        Ok(Box::new(MixtralModel {
            architecture: "MixtralForCausalLM",
            config,
            gguf_qk_permuted: true,
        }))
    }
}

/// A sparse-MoE model deployed as Mixtral is (Mixtral, Qwen3-MoE): a decoder role, and the
/// EP init role.
#[derive(Clone, Debug)]
pub struct MixtralModel {
    /// The architecture's name.
    pub architecture: &'static str,
    /// The decoder's config (with `moe` set).
    pub config: DecoderConfig,
    /// Whether its GGUF files have q and k permuted for llama.cpp's rotary layout (Mixtral's,
    /// written as `llama`; not Qwen3-MoE's).
    pub gguf_qk_permuted: bool,
}

impl ModelSpec for MixtralModel {
    fn architecture(&self) -> &'static str {
        self.architecture
    }
    /// The decoder, and the EP init graph where the deployment exports it (an
    /// expert-parallel degree above 1).
    fn roles(&self) -> Vec<GraphRole> {
        vec![GraphRole::Decoder, GraphRole::EpInit]
    }
    fn deployment(&self) -> DeploymentConfig {
        let moe = self
            .config
            .moe
            .clone()
            .unwrap_or_else(|| MoeConfig::new(1, 1));
        let mut d = DeploymentConfig::with_hooks(Arc::new(MixtralHooks {
            llama: LlamaFamilyHooks {
                gguf_qk_permuted: self.gguf_qk_permuted,
                ..LlamaFamilyHooks::new(&self.config)
            },
            num_experts: moe.num_experts,
            top_k: moe.top_k,
            hidden_size: self.config.hidden_size,
        }));
        d.expert_parallel_communication = true;
        d.export_ep_init = true;
        d
    }
    fn decoder(&self, role: GraphRole) -> Option<&DecoderConfig> {
        (role == GraphRole::Decoder).then_some(&self.config)
    }
    fn build(&self, role: GraphRole, opts: &BuildOptions) -> Result<crate::Graph> {
        build_moe_role(&self.config, role, opts)
    }
}

/// The graph of `role` of a sparse-MoE decoder: its EP init graph (the exchange its experts
/// need at the deployment's degree), or the decoder.
pub fn build_moe_role(
    config: &DecoderConfig,
    role: GraphRole,
    opts: &BuildOptions,
) -> Result<crate::Graph> {
    match (role, &config.moe) {
        (GraphRole::EpInit, Some(moe)) => EpExchange::new(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            &opts.runtime,
        )
        .with_shared(moe.num_shared_experts(config.intermediate_size))
        .graph(),
        _ => super::decoder::build_decoder(config, role, opts),
    }
}

/// Mixtral's deployment hooks: the Llama family's weight preparation, and expert parallelism.
#[derive(Debug)]
pub struct MixtralHooks {
    llama: LlamaFamilyHooks,
    num_experts: usize,
    top_k: usize,
    hidden_size: usize,
}

impl MixtralHooks {
    /// The hooks of `num_experts` experts, `top_k` per token, of width `hidden_size`, with
    /// `llama`'s weight preparation.
    pub fn new(
        llama: LlamaFamilyHooks,
        num_experts: usize,
        top_k: usize,
        hidden_size: usize,
    ) -> Self {
        MixtralHooks {
            llama,
            num_experts,
            top_k,
            hidden_size,
        }
    }

    /// The exchange at `runtime`'s deployment.
    fn exchange(&self, runtime: &ModuleRuntime) -> EpExchange {
        EpExchange::new(self.num_experts, self.top_k, self.hidden_size, runtime)
    }

    /// Experts each rank holds at `degree`.
    fn experts_per_rank(&self, degree: usize) -> usize {
        self.num_experts / degree.max(1)
    }

    /// The worst case of slots one rank receives in a step (see the module docs).
    pub fn max_tokens_per_rank(&self, runtime: &ModuleRuntime) -> usize {
        self.exchange(runtime).max_tokens_per_rank()
    }
}

impl DeploymentHooks for MixtralHooks {
    fn prepare_weights(&self, weights: StateDict) -> Result<StateDict> {
        self.llama.prepare_weights(weights)
    }

    /// The degree must divide the experts. Without an exchange (`expert_parallel_communication`
    /// off) every rank must hold every expert its tokens may be routed to, which only one rank
    /// holding them all does. The `ep_init` graph is exported where there is an exchange to set
    /// up (degree above 1).
    fn apply_runtime(
        &self,
        mut config: DeploymentConfig,
        runtime: &ModuleRuntime,
    ) -> Result<DeploymentConfig> {
        let d = runtime.expert_parallel_degree;
        if d == 0 || !self.num_experts.is_multiple_of(d) {
            return Err(Error::Setting {
                field: "expert_parallel_degree".into(),
                value: d.to_string(),
                message: format!(
                    "must divide the model's {} experts (num_local_experts) so that every rank holds the same number; divisors: {}",
                    self.num_experts,
                    (1..=self.num_experts)
                        .filter(|&k| self.num_experts.is_multiple_of(k))
                        .map(|k| k.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        let tp = runtime.tensor_parallel_degree;
        if d > 1 && tp > 1 && d != tp {
            return Err(Error::Setting {
                field: "expert_parallel_degree".into(),
                value: d.to_string(),
                message: format!(
                    "with tensor_parallel_degree {tp} the experts are split inside every expert (expert_parallel_degree 1) or spread whole over the same ranks (expert_parallel_degree {tp}); other combinations are not supported"
                ),
            });
        }
        if tp > 1 {
            // Within a tensor-parallel group the experts' partial sums join in the all-reduce
            // after them: no exchange to set up.
            config.export_ep_init = false;
            return Ok(config);
        }
        if !config.expert_parallel_communication && d > 1 {
            let per = self.experts_per_rank(d);
            let missing: Vec<String> = (0..d)
                .map(|r| {
                    let lacks: Vec<String> = (0..self.num_experts)
                        .filter(|e| e / per != r)
                        .map(|e| e.to_string())
                        .collect();
                    format!("rank {r} lacks experts {}", lacks.join(","))
                })
                .collect();
            return Err(Error::Setting {
                field: "expert_parallel_degree".into(),
                value: d.to_string(),
                message: format!(
                    "expert-parallel communication is off, so every rank must hold each expert its tokens are routed to (any of the {} experts); at this degree {}",
                    self.num_experts,
                    missing.join("; ")
                ),
            });
        }
        config.export_ep_init =
            config.export_ep_init && config.expert_parallel_communication && d > 1;
        Ok(config)
    }

    fn export_records(&self, runtime: &ModuleRuntime) -> BTreeMap<String, Value> {
        let x = self.exchange(runtime);
        let mut r = BTreeMap::new();
        r.insert("moe.num_experts".into(), json!(self.num_experts));
        r.insert("moe.top_k".into(), json!(self.top_k));
        r.insert("moe.hidden_size".into(), json!(self.hidden_size));
        if runtime.tensor_parallel_degree > 1 {
            // The tensor-parallel ranks hold the experts: split inside each, or spread whole.
            let spread = crate::arch::decoder::experts_spread(runtime);
            r.insert(
                "tp.experts".into(),
                json!(if spread { "spread" } else { "split" }),
            );
            if spread {
                r.insert("ep.degree".into(), json!(x.degree));
                r.insert("ep.experts_per_rank".into(), json!(x.experts_per_rank()));
                r.insert("ep.over".into(), json!("tensor-parallel ranks"));
            }
            return r;
        }
        r.insert("ep.degree".into(), json!(x.degree));
        r.insert("ep.experts_per_rank".into(), json!(x.experts_per_rank()));
        r.insert("ep.dispatch_dtype".into(), json!("f32"));
        r.insert(
            "ep.max_tokens_per_rank".into(),
            json!(x.max_tokens_per_rank()),
        );
        if x.degree == 1 {
            // One rank: no exchange, no buffers.
            return r;
        }
        // The `ep_init` program's outputs, in bytes (see `ep_init`'s module docs): two buffer
        // groups, so that dispatch and combine never share a buffer in flight.
        let (send, recv) = (x.send_slots(), x.max_tokens_per_rank());
        let (slot, row) = (4 * x.slot_floats(), 4 * x.hidden);
        r.insert(
            "ep.buffers".into(),
            json!({
                "dispatch_send_bytes": send * slot,
                "dispatch_recv_bytes": recv * slot,
                "combine_send_bytes": recv * row,
                "combine_recv_bytes": send * row,
                "counters_bytes": 2 * 2 * x.degree * 4,
            }),
        );
        r
    }
}

#[cfg(test)]
mod tests {
    use crate::registry::Registry;
    use crate::{Error, ModuleRuntime};
    use std::path::Path;

    fn spec() -> Box<dyn crate::arch::ModelSpec> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/fixtures/tiny-mixtral");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        Registry::builtin()
            .parse_config(&dir.join("config.json"), &json)
            .unwrap()
    }

    fn runtime(degree: usize) -> ModuleRuntime {
        let mut rt = ModuleRuntime {
            expert_parallel_degree: degree,
            ..Default::default()
        };
        rt.batch.max_batch_size = 8;
        rt.batch.max_seq_len = 128;
        rt.batch.max_batch_input_tokens = 64;
        rt
    }

    #[test]
    fn a_degree_that_does_not_divide_the_experts_is_refused() {
        let e = spec().deployment().apply_runtime(&runtime(3)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Setting { ref field, .. } if field == "expert_parallel_degree"));
        assert!(
            msg.contains("= 3") && msg.contains("4 experts") && msg.contains("divisors: 1, 2, 4"),
            "{msg}"
        );
    }

    #[test]
    fn without_communication_experts_must_be_local() {
        let mut d = spec().deployment();
        d.expert_parallel_communication = false;
        // One rank holds every expert: fine.
        assert!(d.clone().apply_runtime(&runtime(1)).is_ok());
        let msg = d.apply_runtime(&runtime(2)).unwrap_err().to_string();
        assert!(
            msg.contains("rank 0 lacks experts 2,3") && msg.contains("rank 1 lacks experts 0,1"),
            "{msg}"
        );
    }

    #[test]
    fn the_ep_init_graph_is_exported_where_there_is_an_exchange() {
        let d = spec().deployment();
        assert!(d.expert_parallel_communication && d.export_ep_init);
        assert!(!d.clone().apply_runtime(&runtime(1)).unwrap().export_ep_init);
        assert!(d.clone().apply_runtime(&runtime(2)).unwrap().export_ep_init);
        assert!(d.apply_runtime(&runtime(4)).unwrap().export_ep_init);
    }

    #[test]
    fn records_hold_the_deployment_and_the_worst_case_per_rank() {
        let d = spec().deployment();
        // 64 active tokens (the step budget), top-2 of 4 experts, hidden 256.
        let (tokens, hidden) = (64u64, 256u64);
        let slot = 4 * hidden + 12;
        for (degree, per_rank_experts) in [(1u64, 4u64), (2, 2), (4, 1)] {
            let r = d.export_records(&runtime(degree as usize));
            assert_eq!(r["ep.degree"], degree);
            assert_eq!(r["moe.num_experts"], 4);
            assert_eq!(r["moe.top_k"], 2);
            assert_eq!(r["moe.hidden_size"], hidden);
            assert_eq!(r["ep.experts_per_rank"], per_rank_experts);
            assert_eq!(r["ep.dispatch_dtype"], "f32");
            // Every token's slots on one rank: at most min(top_k, experts there) per token.
            let worst = tokens * 2u64.min(per_rank_experts);
            assert_eq!(r["ep.max_tokens_per_rank"], worst, "degree {degree}");
            if degree == 1 {
                assert!(!r.contains_key("ep.buffers"), "one rank: no exchange");
                continue;
            }
            let b = &r["ep.buffers"];
            assert_eq!(b["dispatch_recv_bytes"], worst * slot);
            assert_eq!(b["dispatch_send_bytes"], tokens * 2 * slot);
            assert_eq!(b["combine_send_bytes"], worst * 4 * hidden);
            assert_eq!(b["combine_recv_bytes"], tokens * 2 * 4 * hidden);
        }
    }
}
