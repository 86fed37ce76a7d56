//! SmolLM2-135M-Instruct's tokenizer, built from its GGUF, against the transformers references in
//! `shared/fixtures/smollm2-135m`: every tokenizer case, every prompt (the chat prompt through the
//! GGUF's chat template), decode round trips and the streaming decoder.

use maxc_graph::tokenizer::{
    chat_template_from_gguf, special_tokens_from_gguf, tokenizer_json_from_gguf,
};
use maxc_graph::weights::gguf::GgufFile;
use maxc_serve::chat::{ChatMessage, ChatTemplate, ChatTemplateError};
use maxc_serve::tokenizer::{Tokenizer, TokenizerError};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// sha256 of the `tokenizer.json` that transformers 5.24.0 (`AutoTokenizer.from_pretrained(...,
/// gguf_file=...)`, then `backend_tokenizer.save`, tokenizers 0.23.3) writes for this GGUF.
const TRANSFORMERS_TOKENIZER_JSON_SHA256: &str =
    "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4";

#[derive(Deserialize)]
struct Cases {
    add_special_tokens: bool,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Prompts {
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    text: String,
    chat: Option<Vec<ChatMessage>>,
    tokens: Vec<u32>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    std::env::var_os("MAXC_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("golden/fixtures"))
        .join("smollm2-135m")
}

fn read_json<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The GGUF, fetched with `scripts/fetch-smollm2.sh` when absent.
fn gguf() -> &'static GgufFile {
    static GGUF: OnceLock<GgufFile> = OnceLock::new();
    GGUF.get_or_init(|| {
        let path = root().join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !path.is_file() {
            let out = Command::new("bash")
                .arg("scripts/fetch-smollm2.sh")
                .current_dir(root())
                .output()
                .expect("bash runs");
            assert!(
                out.status.success(),
                "scripts/fetch-smollm2.sh failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"))
    })
}

fn tokenizer_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| tokenizer_json_from_gguf(gguf()).unwrap_or_else(|e| panic!("{e}")))
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_json_str(tokenizer_json()).unwrap_or_else(|e| panic!("{e}")))
}

fn chat_template() -> ChatTemplate {
    let source = chat_template_from_gguf(gguf()).expect("the GGUF has tokenizer.chat_template");
    let special = special_tokens_from_gguf(gguf()).unwrap_or_else(|e| panic!("{e}"));
    let (bos, eos) = (special.bos.expect("bos"), special.eos.expect("eos"));
    ChatTemplate::new(&source)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_special_tokens(bos.text, eos.text)
}

#[test]
fn every_tokenizer_case_matches_transformers() {
    let cases: Cases = read_json("tokenizer_cases.json");
    assert!(!cases.add_special_tokens);
    assert!(cases.cases.len() >= 20, "only {} cases", cases.cases.len());
    let tok = tokenizer();
    let wrong: Vec<String> = cases
        .cases
        .iter()
        .filter_map(|c| {
            let ids = tok.encode(&c.text, false).unwrap_or_else(|e| panic!("{e}"));
            (ids != c.ids).then(|| format!("{:?}: got {ids:?}, expected {:?}", c.text, c.ids))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} cases differ:\n{}",
        wrong.len(),
        cases.cases.len(),
        wrong.join("\n")
    );
}

#[test]
fn every_prompt_matches_including_the_chat_template() {
    let prompts: Prompts = read_json("prompts.json");
    let tok = tokenizer();
    let template = chat_template();
    let mut chats = 0;
    for p in &prompts.prompts {
        if let Some(chat) = &p.chat {
            chats += 1;
            let text = template
                .render(chat, true)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(text, p.text, "rendered chat template");
            // apply_chat_template tokenizes the rendered text without adding special tokens.
            assert_eq!(
                tok.encode(&text, false).unwrap(),
                p.tokens,
                "chat prompt ids"
            );
        }
        // The GGUF says add_bos_token = false, so adding special tokens adds nothing.
        assert_eq!(tok.encode(&p.text, true).unwrap(), p.tokens, "{:?}", p.text);
        assert_eq!(
            tok.encode(&p.text, false).unwrap(),
            p.tokens,
            "{:?}",
            p.text
        );
    }
    assert_eq!(chats, 1, "prompts.json has one chat prompt");
}

#[test]
fn decode_round_trips_every_case() {
    let cases: Cases = read_json("tokenizer_cases.json");
    let tok = tokenizer();
    for c in &cases.cases {
        assert_eq!(
            tok.decode(&c.ids, false).unwrap(),
            c.text,
            "ids {:?}",
            c.ids
        );
    }
    let chat_ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&chat_ids, true).unwrap(), "user\nhi");
    assert_eq!(tok.token_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.vocab_size(), 49152);
}

#[test]
fn decode_rejects_ids_outside_the_vocabulary() {
    let err = tokenizer().decode(&[17, 49152], false).unwrap_err();
    assert!(matches!(err, TokenizerError::Decode { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("id 49152 is not in the vocabulary of 49152"),
        "{err}"
    );
}

/// Streams `ids` and checks the pieces: whole characters only, concatenating to `text`.
/// Returns how many pushes held their text back.
fn stream(ids: &[u32], text: &str) -> usize {
    let tok = tokenizer();
    let mut s = tok.decode_stream(false);
    let (mut out, mut held) = (String::new(), 0);
    for &id in ids {
        match s.push(id).unwrap_or_else(|e| panic!("{e}")) {
            Some(piece) => {
                assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} of {text:?}");
                out.push_str(&piece);
            }
            None => held += 1,
        }
    }
    assert_eq!(s.flush().unwrap(), None, "{text:?}: text left pending");
    assert_eq!(out, text);
    held
}

#[test]
fn streaming_decoder_never_splits_a_character() {
    let cases: Cases = read_json("tokenizer_cases.json");
    let find = |needle: &str| {
        let c = cases.cases.iter().find(|c| c.text.contains(needle));
        c.unwrap_or_else(|| panic!("no case with {needle:?}"))
    };
    // 🙂🚀👍🏽 and 日本語のテキスト each have characters spread over several tokens.
    for needle in ["🙂", "日本語"] {
        let case = find(needle);
        let held = stream(&case.ids, &case.text);
        assert!(held >= 3, "{:?}: only {held} pushes held back", case.text);
    }
    for c in &cases.cases {
        stream(&c.ids, &c.text);
    }
    let prompts: Prompts = read_json("prompts.json");
    for p in &prompts.prompts {
        stream(&p.tokens, &p.text);
    }
}

#[test]
fn streaming_flush_returns_a_partial_character() {
    let tok = tokenizer();
    let ids = tok.encode("a🙂", false).unwrap();
    assert!(ids.len() >= 3, "{ids:?}");
    let mut s = tok.decode_stream(false);
    assert_eq!(s.push(ids[0]).unwrap().as_deref(), Some("a"));
    assert_eq!(s.push(ids[1]).unwrap(), None);
    assert_eq!(s.flush().unwrap().as_deref(), Some("\u{FFFD}"));
    assert_eq!(s.flush().unwrap(), None);
}

#[test]
fn tokenizer_json_is_deterministic_and_matches_transformers() {
    let again = tokenizer_json_from_gguf(gguf()).unwrap();
    assert!(
        again == tokenizer_json(),
        "two builds from the same GGUF differ"
    );
    let v: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(v["pre_tokenizer"]["type"], "ByteLevel");
    assert_eq!(v["added_tokens"].as_array().map(Vec::len), Some(17));
    // The artifact's file is compact; transformers saves it pretty-printed.
    let tok: tokenizers::Tokenizer = again.parse().unwrap();
    let pretty = tok.to_string(true).unwrap();
    let sha = maxc_runtime::schema::sha256_hex(pretty.as_bytes());
    assert_eq!(
        sha, TRANSFORMERS_TOKENIZER_JSON_SHA256,
        "tokenizer.json differs from transformers'"
    );
}

#[test]
fn tokenizer_files_load_and_bad_ones_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("tokenizer.json");
    std::fs::write(&good, tokenizer_json()).unwrap();
    let tok = Tokenizer::from_file(&good).unwrap();
    assert_eq!(
        tok.encode("Hello, world!", false).unwrap(),
        [19556, 28, 905, 17]
    );
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let err = Tokenizer::from_file(&bad).unwrap_err().to_string();
    assert!(err.contains("bad.json"), "{err}");
    let err = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/tokenizer.json"),
        "{err}"
    );
}

#[test]
fn chat_templates_have_python_methods_and_clear_errors() {
    let msgs = [ChatMessage::new("user", "  Hi  ")];
    let t = ChatTemplate::new("{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}")
        .unwrap();
    assert_eq!(t.render(&msgs, false).unwrap(), "HI");
    // transformers renders with trim_blocks and lstrip_blocks.
    let t = ChatTemplate::new(
        "{% for m in messages %}\n    {% if true %}\n[{{ m.role }}]\n    {% endif %}\n{% endfor %}",
    )
    .unwrap();
    assert_eq!(t.render(&msgs, false).unwrap(), "[user]\n");
    let t = ChatTemplate::new(
        "{{ bos_token }}{% if add_generation_prompt %}go{{ eos_token }}{% endif %}",
    )
    .unwrap()
    .with_special_tokens("<s>", "</s>");
    assert_eq!(t.render(&msgs, true).unwrap(), "<s>go</s>");
    assert_eq!(t.render(&msgs, false).unwrap(), "<s>");

    let t = ChatTemplate::new("{{ raise_exception('only user and assistant roles') }}").unwrap();
    let err = t.render(&msgs, false).unwrap_err();
    assert!(matches!(err, ChatTemplateError::Render(_)), "{err:?}");
    assert!(
        err.to_string().contains("only user and assistant roles"),
        "{err}"
    );
    let err = ChatTemplate::new("{% for m in messages %}").unwrap_err();
    assert!(matches!(err, ChatTemplateError::Syntax(_)), "{err:?}");
    assert!(err.to_string().contains("chat_template"), "{err}");
}
