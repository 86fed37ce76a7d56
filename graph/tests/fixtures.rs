//! The interpreter against the Hugging Face fixtures in ../shared/fixtures: every prompt and
//! position, alone, as one ragged batch, and as prefill chunks mixed with decode rows.

use maxc_graph::interp::{Interpreter, Session, Tensor};
use maxc_graph::pipeline::{load_model, LoadOptions};
use maxc_graph::weights::{read_safetensors_file, StateDict};
use maxc_graph::{GraphRole, KvCacheParams, ModuleRuntime, Registry};
use std::path::PathBuf;

const TOL: f32 = 1e-3;
const PAGE: usize = 16;
const MAX_LEN: usize = 160;

fn fixtures() -> PathBuf {
    std::env::var_os("MAXC_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"))
}

struct Case {
    interp: Interpreter,
    reference: StateDict,
    prefix: &'static str,
}

impl Case {
    fn load(model: &str, role: GraphRole, prefix: &'static str) -> Case {
        let dir = fixtures().join(model);
        let mut runtime = ModuleRuntime::default();
        runtime.batch.max_seq_len = MAX_LEN;
        runtime.kv = KvCacheParams {
            page_size: PAGE,
            num_pages: None,
        };
        let opts = LoadOptions {
            runtime,
            all_logits: true,
            roles: vec![role],
            ..Default::default()
        };
        let mut loaded = load_model(&dir, &Registry::builtin(), &opts).expect("fixture loads");
        let rg = loaded.roles.remove(&role).expect("role built");
        let interp = Interpreter::new(rg.graph, &rg.weights).expect("interpreter");
        let reference =
            read_safetensors_file(&dir.join("reference.safetensors")).expect("reference");
        Case {
            interp,
            reference,
            prefix,
        }
    }

    fn i64s(&self, key: &str) -> Vec<i64> {
        let k = format!("{}{key}", self.prefix);
        self.reference
            .get(&k)
            .unwrap_or_else(|| panic!("fixture has {k}"))
            .to_i64(&k)
            .unwrap()
    }

    fn f32s(&self, key: &str) -> Vec<f32> {
        let k = format!("{}{key}", self.prefix);
        self.reference
            .get(&k)
            .unwrap_or_else(|| panic!("fixture has {k}"))
            .to_f32(&k)
            .unwrap()
    }

    fn prompts(&self) -> Vec<usize> {
        (0..)
            .take_while(|i| {
                self.reference
                    .contains(&format!("{}p{i}.tokens", self.prefix))
            })
            .collect()
    }

    fn session(&self) -> Session<'_> {
        Session::new(&self.interp, 64, MAX_LEN.div_ceil(PAGE))
    }
}

/// Max |a - b| of logits rows `rows` of `got` against rows `from..` of the fixture `want`.
fn max_diff(got: &Tensor, rows: std::ops::Range<usize>, want: &[f32], from: usize) -> f32 {
    let v = got.shape[1];
    rows.enumerate()
        .flat_map(|(i, r)| {
            got.row(r)
                .iter()
                .zip(&want[(from + i) * v..(from + i + 1) * v])
                .map(|(a, b)| (a - b).abs())
        })
        .fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> i64 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as i64)
        .unwrap()
}

fn each_prompt_alone(case: &Case) {
    for i in case.prompts() {
        let tokens = case.i64s(&format!("p{i}.tokens"));
        let mut s = case.session();
        let got = s.step(&[(0, &tokens)]).unwrap();
        let d = max_diff(
            &got,
            0..tokens.len(),
            &case.f32s(&format!("p{i}.logits")),
            0,
        );
        assert!(d < TOL, "prompt {i}: max |logit diff| {d}");
    }
}

fn all_prompts_as_one_ragged_batch(case: &Case) {
    let prompts: Vec<Vec<i64>> = case
        .prompts()
        .iter()
        .map(|i| case.i64s(&format!("p{i}.tokens")))
        .collect();
    let chunks: Vec<(u64, &[i64])> = prompts
        .iter()
        .enumerate()
        .map(|(i, t)| (i as u64, t.as_slice()))
        .collect();
    let mut s = case.session();
    let got = s.step(&chunks).unwrap();
    let mut row = 0;
    for (i, t) in prompts.iter().enumerate() {
        let d = max_diff(
            &got,
            row..row + t.len(),
            &case.f32s(&format!("p{i}.logits")),
            0,
        );
        assert!(
            d < TOL,
            "prompt {i} in the ragged batch: max |logit diff| {d}"
        );
        row += t.len();
    }
}

/// The longest prompt is prefilled in chunks while the shortest decodes greedily alongside it;
/// then both decode their fixture's greedy continuation. Logits are checked at every row.
fn chunked_prefill_mixed_with_decode(case: &Case) {
    let prompts = case.prompts();
    let (long, short) = (*prompts.last().unwrap(), prompts[0]);
    let mut seqs: Vec<(u64, usize, Vec<i64>)> = [long, short]
        .iter()
        .map(|&p| {
            let mut t = case.i64s(&format!("p{p}.tokens"));
            let prompt_len = t.len();
            t.extend(case.i64s(&format!("p{p}.greedy")));
            (p as u64, prompt_len, t)
        })
        .collect();
    let mut s = case.session();
    let chunk = 33;
    let mut fed = [0usize, 0usize];
    while fed.iter().zip(&seqs).any(|(f, (_, _, t))| *f < t.len()) {
        let mut chunks = Vec::new();
        let mut spans = Vec::new();
        for (k, (id, prompt_len, t)) in seqs.iter().enumerate() {
            let n = if fed[k] < *prompt_len {
                chunk.min(*prompt_len - fed[k])
            } else {
                1
            };
            let n = n.min(t.len() - fed[k]);
            if n > 0 {
                chunks.push((*id, &t[fed[k]..fed[k] + n]));
                spans.push((k, fed[k], n));
            }
        }
        let got = s.step(&chunks).unwrap();
        let mut row = 0;
        for (k, start, n) in spans {
            let (id, prompt_len, _) = &seqs[k];
            let want = case.f32s(&format!("p{id}.seq_logits"));
            let d = max_diff(&got, row..row + n, &want, start);
            assert!(
                d < TOL,
                "prompt {id}, positions {start}..{}: max |logit diff| {d}",
                start + n
            );
            // Where the next token is a greedy one, the argmax must be it (margin permitting).
            let (greedy, margin) = (
                case.i64s(&format!("p{id}.greedy")),
                case.f32s(&format!("p{id}.greedy_margin")),
            );
            for r in 0..n {
                let pos = start + r;
                if pos + 1 >= *prompt_len && pos + 1 - prompt_len < greedy.len() {
                    let g = pos + 1 - prompt_len;
                    if margin[g] > 1e-2 {
                        assert_eq!(
                            argmax(got.row(row + r)),
                            greedy[g],
                            "prompt {id}, greedy step {g}"
                        );
                    }
                }
            }
            fed[k] += n;
            row += n;
        }
    }
    seqs.clear();
}

macro_rules! fixture_suite {
    ($name:ident, $model:literal, $role:expr, $prefix:literal) => {
        mod $name {
            use super::*;
            use std::sync::OnceLock;
            fn case() -> &'static Case {
                static CASE: OnceLock<Case> = OnceLock::new();
                CASE.get_or_init(|| Case::load($model, $role, $prefix))
            }
            #[test]
            fn each_prompt_alone() {
                super::each_prompt_alone(case());
            }
            #[test]
            fn all_prompts_as_one_ragged_batch() {
                super::all_prompts_as_one_ragged_batch(case());
            }
            #[test]
            fn chunked_prefill_mixed_with_decode() {
                super::chunked_prefill_mixed_with_decode(case());
            }
        }
    };
}

fixture_suite!(tiny_llama, "tiny-llama", GraphRole::Decoder, "");
fixture_suite!(tiny_qwen2, "tiny-qwen2", GraphRole::Decoder, "");
fixture_suite!(tiny_mixtral, "tiny-mixtral", GraphRole::Decoder, "");
fixture_suite!(
    tiny_roles_target,
    "tiny-roles",
    GraphRole::Decoder,
    "target."
);
fixture_suite!(tiny_roles_draft, "tiny-roles", GraphRole::Draft, "draft.");
