//! `tokenizer.json` from GGUF metadata, on small synthetic vocabularies: what each
//! `tokenizer.ggml.*` key turns into, and errors that name the key.

use maxc_graph::tokenizer::{pre_tokenizer_split, tokenizer_json_from_metadata};
use maxc_graph::weights::gguf::GgufValue;
use std::collections::BTreeMap;
use std::path::Path;

fn strings(items: &[&str]) -> GgufValue {
    GgufValue::Array(
        items
            .iter()
            .map(|s| GgufValue::String(s.to_string()))
            .collect(),
    )
}

/// A byte-level vocabulary: two control tokens, one user-defined token, letters and a merge.
fn metadata() -> BTreeMap<String, GgufValue> {
    let tokens = [
        "<|endoftext|>",
        "<|im_start|>",
        "<think>",
        "a",
        "b",
        "Ġ",
        "ab",
        "c",
    ];
    let types = [3u64, 3, 4, 1, 1, 1, 1, 1];
    let mut m = BTreeMap::new();
    m.insert(
        "tokenizer.ggml.model".into(),
        GgufValue::String("gpt2".into()),
    );
    m.insert(
        "tokenizer.ggml.pre".into(),
        GgufValue::String("smollm".into()),
    );
    m.insert("tokenizer.ggml.tokens".into(), strings(&tokens));
    let types = types.iter().map(|&t| GgufValue::I64(t as i64)).collect();
    m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types));
    m.insert("tokenizer.ggml.merges".into(), strings(&["a b"]));
    m.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U64(1));
    m.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U64(0));
    m
}

fn build(m: &BTreeMap<String, GgufValue>) -> Result<serde_json::Value, String> {
    let json =
        tokenizer_json_from_metadata(Path::new("model.gguf"), m).map_err(|e| e.to_string())?;
    Ok(serde_json::from_str(&json).expect("tokenizer.json parses"))
}

#[test]
fn gpt2_metadata_becomes_byte_level_bpe_with_added_tokens() {
    let v = build(&metadata()).unwrap();
    assert_eq!(v["model"]["type"], "BPE");
    assert_eq!(v["model"]["vocab"]["ab"], 6);
    assert_eq!(v["model"]["merges"][0], serde_json::json!(["a", "b"]));
    assert_eq!(v["pre_tokenizer"]["type"], "ByteLevel");
    assert_eq!(v["pre_tokenizer"]["use_regex"], true);
    assert_eq!(v["decoder"]["type"], "ByteLevel");
    let added = v["added_tokens"].as_array().unwrap();
    let summary: Vec<(u64, &str, bool)> = added
        .iter()
        .map(|t| {
            (
                t["id"].as_u64().unwrap(),
                t["content"].as_str().unwrap(),
                t["special"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (0, "<|endoftext|>", true),
            (1, "<|im_start|>", true),
            (2, "<think>", false)
        ]
    );
    // No add_bos_token: the template adds nothing.
    assert_eq!(v["post_processor"]["special_tokens"], serde_json::json!({}));
}

#[test]
fn add_bos_token_puts_bos_in_the_post_processor() {
    let mut m = metadata();
    m.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true));
    let v = build(&m).unwrap();
    let pp = &v["post_processor"];
    assert_eq!(pp["single"][0]["SpecialToken"]["id"], "<|im_start|>");
    assert_eq!(
        pp["special_tokens"]["<|im_start|>"]["ids"],
        serde_json::json!([1])
    );
}

#[test]
fn known_pre_values_get_their_split_regex() {
    let mut m = metadata();
    m.insert(
        "tokenizer.ggml.pre".into(),
        GgufValue::String("qwen2".into()),
    );
    let v = build(&m).unwrap();
    let seq = &v["pre_tokenizer"]["pretokenizers"];
    assert_eq!(v["pre_tokenizer"]["type"], "Sequence");
    assert_eq!(seq[0]["type"], "Split");
    assert_eq!(seq[0]["behavior"], "Isolated");
    assert_eq!(seq[1]["use_regex"], false);
    for pre in ["llama-bpe", "tekken", "qwen2", "qwen35", "gpt-4o"] {
        m.insert("tokenizer.ggml.pre".into(), GgufValue::String(pre.into()));
        build(&m).unwrap_or_else(|e| panic!("pre `{pre}`: {e}"));
    }
    assert_eq!(pre_tokenizer_split("smollm"), None);
    assert_eq!(pre_tokenizer_split("gpt-2"), None);
}

#[test]
fn tokens_outside_the_byte_alphabet_are_respelled_and_not_added() {
    let mut m = metadata();
    let mut tokens = match &m["tokenizer.ggml.tokens"] {
        GgufValue::Array(a) => a.clone(),
        _ => unreachable!(),
    };
    tokens[7] = GgufValue::String("é x".into());
    m.insert("tokenizer.ggml.tokens".into(), GgufValue::Array(tokens));
    let types = [3u64, 3, 4, 1, 1, 1, 1, 3].map(GgufValue::U64).to_vec();
    m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types));
    let v = build(&m).unwrap();
    assert_eq!(v["model"]["vocab"]["Ã©Ġx"], 7);
    // A control token outside the byte alphabet is a mislabel; transformers does not add it.
    let added: Vec<&str> = v["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["content"].as_str().unwrap())
        .collect();
    assert_eq!(added, ["<|endoftext|>", "<|im_start|>", "<think>"]);
}

#[test]
fn other_tokenizer_models_are_refused_by_name() {
    let mut m = metadata();
    m.insert(
        "tokenizer.ggml.model".into(),
        GgufValue::String("bert".into()),
    );
    let err = build(&m).unwrap_err();
    assert!(
        err.contains("model.gguf")
            && err.contains("tokenizer.ggml.model")
            && err.contains("`bert`")
            && err.contains("gpt2, llama"),
        "{err}"
    );
}

#[test]
fn bad_metadata_errors_name_the_key() {
    let cases: [(&str, Option<GgufValue>, &str); 5] = [
        ("tokenizer.ggml.tokens", None, "missing"),
        ("tokenizer.ggml.model", None, "missing"),
        ("tokenizer.ggml.merges", Some(strings(&["ab"])), "merge 0"),
        (
            "tokenizer.ggml.bos_token_id",
            Some(GgufValue::U64(99)),
            "outside the vocabulary",
        ),
        (
            "tokenizer.ggml.token_type",
            Some(strings(&["x"])),
            "expected an integer",
        ),
    ];
    for (key, value, what) in cases {
        let mut m = metadata();
        match value {
            Some(v) => m.insert(key.into(), v),
            None => m.remove(key),
        };
        let err = build(&m).unwrap_err();
        assert!(err.contains(key) && err.contains(what), "{key}: {err}");
    }
}
