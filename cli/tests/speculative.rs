//! Speculative decoding (the draft role proposes, the decoder verifies several tokens in one
//! step): greedy output equals plain decoding alone and among concurrent requests; a draft equal
//! to the decoder has every token accepted and the acceptance metrics say so; sampling with
//! speculation follows the decoder's distribution (a chi-square test over many seeds).

use maxc_golden::fixtures;
use maxc_graph::weights::read_safetensors_file;
use maxc_runtime::sampling::{chi_square, chi_square_critical, Sampler, SamplingParams};
use maxc_runtime::Engine;
use maxc_serve::metrics::Metrics;
use maxc_serve::scheduler::{generate, GenerateOptions};
use maxc_serve::scheduler::{
    Event, Request, Scheduler, SchedulerConfig, Speculation, SpeculationOptions,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn compile(model: &Path, out: &Path, extra: &[&str]) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(["compile", model.to_str().unwrap(), "--out"])
        .arg(out)
        .args(["--quiet", "--max-seq-len", "160", "--page-size", "16"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn roles_artifact(extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("roles.maxc");
    compile(&fixtures().join("tiny-roles"), &a, extra);
    (tmp, a)
}

/// The fixture's prompts with their greedy continuations and margins.
fn fixture_prompts() -> Vec<(Vec<i64>, Vec<i64>, Vec<f32>)> {
    let r = read_safetensors_file(&fixtures().join("tiny-roles/reference.safetensors")).unwrap();
    (0..)
        .map_while(|i| {
            let t = r.get(&format!("target.p{i}.tokens"))?;
            Some((
                t.to_i64("tokens").unwrap(),
                r.get(&format!("target.p{i}.greedy"))?
                    .to_i64("greedy")
                    .unwrap(),
                r.get(&format!("target.p{i}.greedy_margin"))?
                    .to_f32("margin")
                    .unwrap(),
            ))
        })
        .collect()
}

fn speculative(artifact: &Path, metrics: Arc<Metrics>) -> Scheduler {
    let engine = Engine::open(artifact, "decoder").unwrap();
    let spec = Speculation::open(
        &engine,
        &SpeculationOptions::default(),
        Default::default(),
        None,
    )
    .unwrap();
    let cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
    Scheduler::new(engine, cfg, metrics).with_speculation(spec)
}

/// Runs `reqs` through `s` together; returns each one's tokens.
fn run_all(s: &mut Scheduler, reqs: Vec<Request>) -> Vec<Vec<i64>> {
    let mut rx: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            s.submit(r, tx);
            rx
        })
        .collect();
    let mut out = vec![Vec::new(); rx.len()];
    let mut steps = 0;
    while s.has_work() {
        s.step();
        steps += 1;
        assert!(steps < 100_000, "the scheduler does not finish");
        for (i, r) in rx.iter_mut().enumerate() {
            while let Ok(e) = r.try_recv() {
                match e {
                    Event::Token { id, .. } => out[i].push(id),
                    Event::Error(e) => panic!("request {i}: {e}"),
                    _ => {}
                }
            }
        }
    }
    out
}

fn greedy(prompt: &[i64], max: usize) -> Request {
    let mut r = Request::greedy(prompt.to_vec(), max);
    r.ignore_eos = true;
    r
}

#[test]
fn greedy_speculation_gives_exactly_the_plain_tokens() {
    let (_t, a) = roles_artifact(&[]);
    let prompts = fixture_prompts();
    assert_eq!(prompts.len(), 4);
    let mut plain = Scheduler::alone(Engine::open(&a, "decoder").unwrap());
    let opts = GenerateOptions {
        max_new_tokens: 24,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
    };
    let metrics = Arc::new(Metrics::new());
    let mut s = speculative(&a, metrics);
    for (i, (prompt, reference, margin)) in prompts.iter().enumerate() {
        let want = generate(&mut plain, prompt, &opts, |_| {}).unwrap();
        // The fixture's greedy tokens, where the decision is not a near tie.
        for (j, (&w, &r)) in want.iter().zip(reference).enumerate() {
            if margin[..=j].iter().all(|&m| m > 1e-2) {
                assert_eq!(
                    w, r,
                    "prompt {i}, token {j}: plain decoding against the fixture"
                );
            }
        }
        let got = run_all(&mut s, vec![greedy(prompt, 24)]);
        assert_eq!(got[0], want, "prompt {i} alone");
    }
    // Every prompt at once, at several lengths, each as it comes out alone.
    let reqs: Vec<(usize, usize)> = (0..12).map(|i| (i % 4, 5 + (i * 7) % 20)).collect();
    let want: Vec<Vec<i64>> = reqs
        .iter()
        .map(|&(p, max)| {
            let o = GenerateOptions {
                max_new_tokens: max,
                ..opts.clone()
            };
            generate(&mut plain, &prompts[p].0, &o, |_| {}).unwrap()
        })
        .collect();
    let got = run_all(
        &mut s,
        reqs.iter()
            .map(|&(p, max)| greedy(&prompts[p].0, max))
            .collect(),
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "concurrent request {i}");
    }
    let st = s.speculation().unwrap().stats();
    assert!(st.verifications > 0 && st.positions.len() == 3, "{st:?}");
    // Both caches hold nothing once every request is done (the decoder's prefix cache aside).
    let draft_pages = s.speculation().unwrap().kv().pages();
    assert_eq!(draft_pages.free_pages(), draft_pages.total_pages());
}

/// tiny-roles with the decoder's weights and config as its draft too; where `perturb`, the
/// draft's output rows are rescaled (row `r` by 0.5, 0.75 or 1.0 as `r mod 3`), so that its
/// distribution differs from the decoder's in probabilities and in which tokens lead.
fn self_draft_checkpoint(dir: &Path, perturb: bool) {
    let src = fixtures().join("tiny-roles");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["draft_config"] = config["text_config"].clone();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).ok();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (name, view) in st.tensors() {
        if let Some(rest) = name.strip_prefix("language_model.") {
            let (dtype, shape) = (view.dtype(), view.shape().to_vec());
            let mut draft = view.data().to_vec();
            if perturb && rest == "lm_head.weight" {
                assert_eq!(dtype, safetensors::Dtype::BF16);
                let cols = shape[1];
                for (i, v) in draft.chunks_exact_mut(2).enumerate() {
                    let x = half::bf16::from_le_bytes([v[0], v[1]]).to_f32();
                    let scale = 0.5 + 0.25 * ((i / cols) % 3) as f32;
                    v.copy_from_slice(&half::bf16::from_f32(x * scale).to_le_bytes());
                }
            }
            tensors.insert(format!("draft_model.{rest}"), (dtype, shape.clone(), draft));
            tensors.insert(name, (dtype, shape, view.data().to_vec()));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, (d, s, b))| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn a_draft_equal_to_the_decoder_has_every_token_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("self-draft");
    self_draft_checkpoint(&ckpt, false);
    let a = tmp.path().join("self.maxc");
    compile(&ckpt, &a, &[]);
    let metrics = Arc::new(Metrics::new());
    let mut s = speculative(&a, metrics.clone());
    let prompts = fixture_prompts();
    let reqs: Vec<Request> = prompts.iter().map(|p| greedy(&p.0, 22)).collect();
    let out = run_all(&mut s, reqs);
    let mut plain = Scheduler::alone(Engine::open(&a, "decoder").unwrap());
    for (i, (p, got)) in prompts.iter().zip(&out).enumerate() {
        let opts = GenerateOptions {
            max_new_tokens: 22,
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        };
        assert_eq!(
            got,
            &generate(&mut plain, &p.0, &opts, |_| {}).unwrap(),
            "prompt {i}"
        );
    }
    let st = s.speculation().unwrap().stats().clone();
    // 22 tokens: the first from the prompt, five steps of 3 accepted proposals and the
    // decoder's own token each, then one plain step; the four requests run in lockstep.
    assert_eq!(st.verifications, 4 * 5, "{st:?}");
    assert_eq!(st.positions, vec![(20, 20); 3]);
    assert_eq!(st.mean_accepted(), 3.0);
    let text = metrics.encode();
    for pos in 0..3 {
        let line = format!(
            "maxserve_spec_decode_acceptance_rate_per_position_percent_sum{{position=\"{pos}\"}} 500.0"
        );
        assert!(text.contains(&line), "no `{line}` in\n{text}");
    }
    assert!(
        text.contains("maxserve_spec_decode_avg_acceptance_length_tokens_sum 15.0")
            && text.contains("maxserve_spec_decode_avg_acceptance_length_tokens_count 5"),
        "{text}"
    );
}

#[test]
fn sampling_with_speculation_follows_the_decoders_distribution() {
    // A draft near the decoder, so that proposals are accepted and rejected both.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("near-draft");
    self_draft_checkpoint(&ckpt, true);
    let a = tmp.path().join("near.maxc");
    compile(&ckpt, &a, &[]);
    let prompt = fixture_prompts()[1].0.clone();
    let params = |seed: u64| SamplingParams {
        temperature: 1.0,
        top_k: 6,
        seed,
        ..Default::default()
    };
    // The decoder's exact distribution of the first two tokens: p(t1) · p(t2 | t1).
    let mut engine = maxc_runtime::Session::open(&a, "decoder").unwrap();
    let sampler = Sampler::new(params(0));
    let first = sampler.distribution(&engine.prefill(1, &prompt).unwrap());
    engine.release(1);
    let mut expected: BTreeMap<(i64, i64), f64> = BTreeMap::new();
    for &(t1, _) in &first.probs {
        let p1 = f64::from(first.prob(t1));
        let mut ctx = prompt.clone();
        ctx.push(t1 as i64);
        let second = sampler.distribution(&engine.prefill(2, &ctx).unwrap());
        engine.release(2);
        for &(t2, _) in &second.probs {
            expected.insert((t1 as i64, t2 as i64), p1 * f64::from(second.prob(t2)));
        }
    }
    // Many seeds through the speculative scheduler: three tokens each, so that the second is
    // a verified proposal (or its replacement) and the third a proposal or the bonus token.
    let n = 3000;
    let mut s = speculative(&a, Arc::new(Metrics::new()));
    let reqs: Vec<Request> = (0..n)
        .map(|seed| {
            let mut r = greedy(&prompt, 3);
            r.sampling = params(seed);
            r
        })
        .collect();
    let out = run_all(&mut s, reqs);
    let mut counts: BTreeMap<(i64, i64), u64> = BTreeMap::new();
    for o in &out {
        *counts.entry((o[0], o[1])).or_default() += 1;
    }
    // Cells expected fewer than 5 times share one bin.
    let (mut observed, mut probs) = (vec![0u64], vec![0f64]);
    for (cell, &p) in &expected {
        let c = counts.remove(cell).unwrap_or(0);
        if p * n as f64 >= 5.0 {
            observed.push(c);
            probs.push(p);
        } else {
            observed[0] += c;
            probs[0] += p;
        }
    }
    assert!(
        counts.is_empty(),
        "pairs the decoder never gives: {counts:?}"
    );
    let (stat, df) = chi_square(&observed, &probs);
    assert!(df >= 10, "{df} degrees of freedom");
    assert!(
        stat < chi_square_critical(df),
        "chi-square {stat:.1} over {df} degrees of freedom (critical {:.1})",
        chi_square_critical(df)
    );
    // The draft's proposals were verified (some accepted, some replaced).
    let st = s.speculation().unwrap().stats();
    assert!(st.positions[0].0 >= n && st.positions[0].1 > 0, "{st:?}");
    assert!(st.positions[0].1 < st.positions[0].0, "{st:?}");
    eprintln!("chi-square {stat:.1} over {df} df; {st:?}");
}

fn maxc(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_maxc"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_separate_draft_artifact_pairs_when_its_tokenizer_matches() {
    let tmp = tempfile::tempdir().unwrap();
    let path = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let (llama, qwen, plain, roles) = (
        path("llama.maxc"),
        path("qwen.maxc"),
        path("plain.maxc"),
        path("roles.maxc"),
    );
    let f = fixtures();
    compile(
        &f.join("tiny-llama"),
        Path::new(&llama),
        &["--num-speculative-tokens", "4"],
    );
    compile(&f.join("tiny-qwen2"), Path::new(&qwen), &[]);
    compile(&f.join("tiny-llama"), Path::new(&plain), &[]);
    compile(&f.join("tiny-roles"), Path::new(&roles), &[]);
    let prompt = "1,57,300,12,999,4,81";
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            &llama,
            "--tokens",
            prompt,
            "--max-new-tokens",
            "30",
        ];
        args.extend_from_slice(&["--ignore-eos"]);
        args.extend_from_slice(extra);
        let o = maxc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            String::from_utf8_lossy(&o.stdout).trim().to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (want, _) = gen(&[]);
    // Another model as the draft: the decoder's tokens all the same.
    let (got, log) = gen(&["--draft", &qwen]);
    assert_eq!(got, want, "{log}");
    assert!(
        log.contains("speculative, 4 draft tokens per step"),
        "{log}"
    );
    // The decoder's own model as a separate draft: every proposal accepted.
    let (got, log) = gen(&["--draft", &plain, "--num-speculative-tokens", "3"]);
    assert_eq!(got, want, "{log}");
    assert!(
        log.contains("accepted by position 100% 100% 100%; 3.00 accepted per step"),
        "{log}"
    );
    // Pairings that cannot work are refused, saying why.
    for (decoder, extra, why) in [
        (
            &llama,
            vec!["--draft", roles.as_str()],
            "tokenizer.json differs",
        ),
        (
            &plain,
            vec!["--draft", qwen.as_str()],
            "--num-speculative-tokens",
        ),
        (&plain, vec!["--speculative"], "has no draft role"),
        (
            &llama,
            vec!["--draft", qwen.as_str(), "--num-speculative-tokens", "5"],
            "1 to 4",
        ),
    ] {
        let mut args = vec!["generate", decoder.as_str(), "--tokens", prompt];
        args.extend(extra);
        let o = maxc(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why), "{args:?}: {err}");
    }
}

#[test]
fn speculation_survives_chunked_prefill_and_preemption() {
    // A 24-token step budget chunks the long prompts while others decode with proposals; 12
    // pages of 16 tokens cannot hold every request at once, so some are preempted.
    let (_t, a) = roles_artifact(&["--max-batch-input-tokens", "24", "--kv-cache-pages", "12"]);
    let prompts = fixture_prompts();
    let mut plain = Scheduler::alone(Engine::open(&a, "decoder").unwrap());
    let reqs: Vec<(usize, usize)> = (0..10).map(|i| (i % 4, 10 + (i * 5) % 30)).collect();
    let want: Vec<Vec<i64>> = reqs
        .iter()
        .map(|&(p, max)| {
            let o = GenerateOptions {
                max_new_tokens: max,
                sampling: SamplingParams::default(),
                stop_at_eos: false,
            };
            generate(&mut plain, &prompts[p].0, &o, |_| {}).unwrap()
        })
        .collect();
    let mut s = speculative(&a, Arc::new(Metrics::new()));
    let mut rx: Vec<_> = reqs
        .iter()
        .map(|&(p, max)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            s.submit(greedy(&prompts[p].0, max), tx);
            rx
        })
        .collect();
    let mut got = vec![Vec::new(); reqs.len()];
    let mut preempted = 0;
    while s.has_work() {
        preempted += s.step().preempted;
        for (i, r) in rx.iter_mut().enumerate() {
            while let Ok(e) = r.try_recv() {
                match e {
                    Event::Token { id, .. } => got[i].push(id),
                    Event::Error(e) => panic!("request {i}: {e}"),
                    _ => {}
                }
            }
        }
    }
    assert!(
        preempted > 0,
        "the cache was large enough for every request"
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
    let st = s.speculation().unwrap().stats();
    assert!(st.verifications > 0, "{st:?}");
    let draft_pages = s.speculation().unwrap().kv().pages();
    assert_eq!(draft_pages.free_pages(), draft_pages.total_pages());
}
