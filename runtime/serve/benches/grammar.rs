//! What structured outputs cost per token: llguidance's mask over SmolLM2's 49,152-token
//! vocabulary, for the grammars the HTTP tests use, walked token by token as a sampler would
//! (the most likely allowed token of pseudo-random logits). Prints the one-time costs (the
//! token trie and the grammar compiler, each grammar's compilation) and, per token, the mask's
//! computation (which the scheduler runs beside the forward pass) and its application to a row
//! of logits (which it runs after). SmolLM2 comes from `scripts/fetch-smollm2.sh`
//! (`MAXC_SMOLLM2` points elsewhere).
//!
//! `cargo bench -p maxc-serve --bench grammar`

use maxc_graph::tokenizer::tokenizer_json_from_gguf;
use maxc_graph::weights::gguf::GgufFile;
use maxc_serve::constraint::{GrammarSpec, Grammars};
use maxc_serve::tokenizer::Tokenizer;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gguf = std::env::var_os("MAXC_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !gguf.exists() {
        println!(
            "{} is missing: run scripts/fetch-smollm2.sh (or set MAXC_SMOLLM2)",
            gguf.display()
        );
        return;
    }
    let file = GgufFile::open(&gguf).expect("the GGUF opens");
    let json = tokenizer_json_from_gguf(&file).expect("its tokenizer");
    let tok: &'static Tokenizer = Box::leak(Box::new(
        Tokenizer::from_json_str(&json).expect("tokenizer.json"),
    ));
    let vocab = tok.vocab_size();
    let eos: Vec<i64> = ["<|im_end|>", "<|endoftext|>"]
        .iter()
        .filter_map(|t| tok.token_id(t).map(i64::from))
        .collect();
    let t = Instant::now();
    let grammars = Grammars::new(&json, tok, vocab, &eos).expect("grammars");
    println!(
        "token trie and grammar compiler over {vocab} tokens: {:.1} ms (once per server)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let specs = [
        (
            "json_schema",
            GrammarSpec::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                             "maxItems": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string",
                              "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
                "required": ["name", "tags", "age", "email"]})),
        ),
        ("json_object", GrammarSpec::JsonObject),
        (
            "regex",
            GrammarSpec::Regex("([a-z]+ ){3,20}[0-9]{3}-[0-9]{4}".into()),
        ),
        (
            "choice",
            GrammarSpec::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
        ),
    ];
    println!(
        "{:<12} {:>10} {:>7} {:>12} {:>12} {:>12} {:>13}",
        "grammar",
        "compile ms",
        "tokens",
        "mask p50 us",
        "mask p90 us",
        "mask max us",
        "apply p50 us"
    );
    for (name, spec) in specs {
        let t = Instant::now();
        let mut c = grammars.compile(&spec).expect("compiles");
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        let (mut masks, mut applies) = (Vec::new(), Vec::new());
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut tokens = 0;
        while !c.is_complete() && tokens < 96 {
            let t = Instant::now();
            c.prepare();
            masks.push(t.elapsed().as_secs_f64() * 1e6);
            let mut row: Vec<f32> = (0..vocab)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (state >> 40) as f32 / (1u64 << 24) as f32
                })
                .collect();
            let t = Instant::now();
            c.apply(&mut row);
            applies.push(t.elapsed().as_secs_f64() * 1e6);
            let best = (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0);
            if eos.contains(&(best as i64)) {
                break;
            }
            c.consume(best as i64).expect("an allowed token");
            tokens += 1;
        }
        println!(
            "{name:<12} {compile_ms:>10.2} {tokens:>7} {:>12.1} {:>12.1} {:>12.1} {:>13.1}",
            percentile(&mut masks.clone(), 0.5),
            percentile(&mut masks.clone(), 0.9),
            percentile(&mut masks, 1.0),
            percentile(&mut applies, 0.5)
        );
    }
}
