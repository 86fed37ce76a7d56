//! SentencePiece (`tokenizer.ggml.model` `llama`) tokenizers built from GGUF metadata encode and
//! decode as Google's `sentencepiece` does: two BPE models it trained, their metadata written as
//! llama.cpp's converter writes it, and its ids for each text
//! (`graph/tests/sentencepiece/make_reference.py`). The real Gemma 3 file is checked against
//! llama.cpp in `scripts/compare-llama-cpp.sh`.

use maxc_graph::tokenizer::tokenizer_json_from_metadata;
use maxc_graph::weights::gguf::GgufValue;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The reference file `name` (`llama` or `gemma`): its metadata and its cases.
fn reference(name: &str) -> (BTreeMap<String, GgufValue>, Vec<Value>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sentencepiece")
        .join(format!("{name}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let meta = v["metadata"].as_object().unwrap();
    let metadata = meta
        .iter()
        .map(|(k, v)| (k.clone(), gguf_value(v)))
        .collect();
    (metadata, v["cases"].as_array().unwrap().clone())
}

/// A JSON value as the GGUF reader gives it.
fn gguf_value(v: &Value) -> GgufValue {
    match v {
        Value::Bool(b) => GgufValue::Bool(*b),
        Value::String(s) => GgufValue::String(s.clone()),
        Value::Number(n) if n.is_u64() => GgufValue::U64(n.as_u64().unwrap()),
        Value::Number(n) => GgufValue::F64(n.as_f64().unwrap()),
        Value::Array(a) => GgufValue::Array(a.iter().map(gguf_value).collect()),
        other => panic!("no GGUF value for {other}"),
    }
}

fn tokenizer(metadata: &BTreeMap<String, GgufValue>) -> Tokenizer {
    let json = tokenizer_json_from_metadata(Path::new("model.gguf"), metadata).unwrap();
    json.parse().unwrap()
}

fn ids(tok: &Tokenizer, text: &str, special: bool) -> Vec<u32> {
    tok.encode(text, special).unwrap().get_ids().to_vec()
}

fn agrees_with_sentencepiece(name: &str) {
    let (metadata, cases) = reference(name);
    let tok = tokenizer(&metadata);
    let bos = metadata["tokenizer.ggml.bos_token_id"].as_u64().unwrap() as u32;
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids(&tok, text, false), want, "{name}: {text:?}");
        // BOS is added by default (llama.cpp's rule for SentencePiece vocabularies).
        let with_bos = ids(&tok, text, true);
        assert_eq!(with_bos[0], bos, "{name}: {text:?}");
        assert_eq!(with_bos[1..], want[..], "{name}: {text:?}");
        let decoded = tok.decode(&want, true).unwrap();
        assert_eq!(
            decoded,
            case["decoded"].as_str().unwrap(),
            "{name}: {want:?}"
        );
    }
}

#[test]
fn a_llama_style_vocabulary_encodes_as_sentencepiece() {
    agrees_with_sentencepiece("llama");
}

#[test]
fn a_gemma_style_vocabulary_encodes_as_sentencepiece() {
    agrees_with_sentencepiece("gemma");
}

#[test]
fn control_tokens_in_the_text_are_their_ids_and_add_bos_false_adds_none() {
    let (mut metadata, _) = reference("llama");
    let tok = tokenizer(&metadata);
    let tokens = tok.get_vocab(true);
    let ctl = tokens["<ctl>"];
    let got = ids(&tok, "a<ctl>b", false);
    // As llama.cpp with parse_special: the control token is matched in the raw text, and the
    // text after it gets the space prefix again.
    assert_eq!(got[1], ctl, "{got:?}");
    assert_eq!(got[2..], ids(&tok, "b", false)[..]);
    metadata.insert(
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(false),
    );
    let tok = tokenizer(&metadata);
    assert_eq!(ids(&tok, "a", true), ids(&tok, "a", false));
}

#[test]
fn scores_that_do_not_match_the_tokens_are_named() {
    let (mut metadata, _) = reference("gemma");
    metadata.insert(
        "tokenizer.ggml.scores".into(),
        GgufValue::Array(vec![GgufValue::F64(0.0)]),
    );
    let err = tokenizer_json_from_metadata(Path::new("model.gguf"), &metadata).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("model.gguf")
            && err.contains("tokenizer.ggml.scores")
            && err.contains("one per token"),
        "{err}"
    );
    metadata.remove("tokenizer.ggml.scores");
    let err = tokenizer_json_from_metadata(Path::new("model.gguf"), &metadata).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
}

/// The real Gemma 3 270M file (`scripts/fetch-gemma3.sh`; `MAXC_GEMMA3_GGUF` names another
/// copy) tokenizes each text as llama.cpp does, and decodes back to it. Skipped, saying so,
/// where the file has not been fetched.
#[test]
fn the_real_gemma3_file_tokenizes_as_llama_cpp() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = std::env::var_os("MAXC_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".tools/models/gemma-3-270m-q4_k_m.gguf"));
    if !path.is_file() {
        eprintln!(
            "skipped: {} is absent (bash scripts/fetch-gemma3.sh fetches it)",
            path.display()
        );
        return;
    }
    let gguf = maxc_graph::weights::gguf::GgufFile::open(&path).unwrap();
    let json = maxc_graph::tokenizer::tokenizer_json_from_gguf(&gguf).unwrap();
    let tok: Tokenizer = json.parse().unwrap();
    let reference = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sentencepiece/gemma3-270m-llama-cpp.json");
    let v: Value = serde_json::from_slice(&std::fs::read(reference).unwrap()).unwrap();
    for case in v["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids(&tok, text, true), want, "{text:?}");
        if !text.contains("<start_of_turn>") {
            assert_eq!(tok.decode(&want, true).unwrap(), text, "{want:?}");
        }
    }
}
