//! Tools through real chat templates (`tests/templates/`, from llama.cpp's collection): a
//! conversation with tools, an assistant's call and the tool's result renders in each family's
//! format, and the call a template writes for the assistant parses back (with the format read
//! from the template) to the same call.

use maxc_serve::chat::{ChatMessage, ChatTemplate};
use maxc_serve::tools::{ToolCall, ToolFormat};
use serde_json::{json, Value};
use std::path::PathBuf;

fn templates() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "jinja").then(|| {
                let name = p.file_stem().unwrap().to_string_lossy().to_string();
                (name, std::fs::read_to_string(&p).unwrap())
            })
        })
        .collect();
    out.sort();
    assert_eq!(out.len(), 6);
    out
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}])
}

fn user() -> ChatMessage {
    ChatMessage::new("user", "What is the weather in Paris?")
}

/// An assistant's call, as transformers passes it to templates (arguments as an object; a
/// 9-character id, which Mistral's templates require).
fn call() -> ChatMessage {
    ChatMessage {
        tool_calls: Some(json!([{"id": "abc123xyz", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])),
        ..ChatMessage::new("assistant", "")
    }
}

fn result() -> ChatMessage {
    ChatMessage {
        tool_call_id: Some("abc123xyz".into()),
        name: Some("get_weather".into()),
        ..ChatMessage::new("tool", "{\"temperature_c\": 21}")
    }
}

fn template(source: &str) -> ChatTemplate {
    ChatTemplate::new(source)
        .unwrap()
        .with_special_tokens("<s>", "</s>")
}

#[test]
fn a_conversation_with_tools_renders_through_every_family() {
    let tools = tools();
    for (name, source) in templates() {
        let t = template(&source);
        let text = t
            .render_with_tools(&[user(), call(), result()], true, Some(&tools))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for want in [
            "get_weather",
            "The weather in a city",
            "Paris",
            "temperature_c",
        ] {
            assert!(text.contains(want), "{name}: no {want:?} in\n{text}");
        }
    }
}

#[test]
fn the_call_a_template_writes_parses_back() {
    let tools = tools();
    for (name, source) in templates() {
        let t = template(&source);
        let format = ToolFormat::of_template(&source);
        let prompt = t.render_with_tools(&[user()], true, Some(&tools)).unwrap();
        let full = t
            .render_with_tools(&[user(), call()], false, Some(&tools))
            .unwrap();
        let Some(written) = full.strip_prefix(&prompt) else {
            panic!(
                "{name}: the call's rendering does not extend the prompt:\n{prompt}\n---\n{full}"
            );
        };
        let mut written = written.trim_end();
        for end in ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>"] {
            written = written.strip_suffix(end).unwrap_or(written).trim_end();
        }
        let parsed = format.parse(written);
        assert_eq!(
            parsed.calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }],
            "{name} ({format:?}) wrote {written:?}"
        );
        // The call's first characters (after an empty thinking section, which Qwen 3 writes)
        // are held back as a possible call.
        let call_text = written
            .split_once("</think>")
            .map_or(written, |(_, rest)| rest.trim_start());
        assert!(
            format.may_open_call(&call_text[..call_text.len().min(6)]),
            "{name}: {call_text:?}"
        );
    }
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let (_, source) = templates()
        .into_iter()
        .find(|(n, _)| n == "Qwen-Qwen3-0.6B")
        .unwrap();
    let t = template(&source);
    assert!(t.thinks());
    let off: serde_json::Map<String, Value> =
        serde_json::from_value(json!({"enable_thinking": false})).unwrap();
    let quiet = t.render_with(&[user()], true, None, Some(&off)).unwrap();
    assert!(quiet.ends_with("<think>\n\n</think>\n\n"), "{quiet}");
    let thinking = t.render_with(&[user()], true, None, None).unwrap();
    assert!(!thinking.contains("</think>"), "{thinking}");
    // A variable of the template's own wins over a kwarg of the same name.
    let sneaky: serde_json::Map<String, Value> =
        serde_json::from_value(json!({"add_generation_prompt": false})).unwrap();
    assert_eq!(
        t.render_with(&[user()], true, None, Some(&sneaky)).unwrap(),
        thinking
    );
}
