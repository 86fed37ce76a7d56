//! A chat request's tools: their check, what `tool_choice` asks, the grammar that makes
//! `required` (or a named function) a call of a listed tool with valid arguments, and the
//! conversation's tool calls and results as the chat template takes them.

use super::openai::{ApiError, ChatRequest, Message};
use crate::chat::ChatMessage;
use crate::constraint::GrammarSpec;
use crate::tools::ToolFormat;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What the answer may do with the tools.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum ToolMode {
    /// No tools: plain text.
    None,
    /// The model chooses: its text is read for calls.
    Auto,
    /// One call of one of these tools (all listed ones for `required`).
    Required(Vec<String>),
}

/// The request's tools, checked: each a function with a name (its parameters a schema
/// object, `{}` where absent); returns them and what `tool_choice` asks.
pub(super) fn tools_of(req: &ChatRequest) -> Result<(Vec<Value>, ToolMode), ApiError> {
    let tools = req.tools.clone().unwrap_or_default();
    let mut names = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let f = &t["function"];
        let name = f["name"].as_str().unwrap_or_default();
        if t["type"].as_str() != Some("function") || name.is_empty() {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
        if !(f["parameters"].is_null() || f["parameters"].is_object()) {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools[{i}].function.parameters` must be a JSON Schema object"),
            ));
        }
        names.push(name.to_string());
    }
    let bad = |m: String| Err(ApiError::invalid("tool_choice", m));
    let mode = match &req.tool_choice {
        None if tools.is_empty() => ToolMode::None,
        None => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::None,
            "auto" if !tools.is_empty() => ToolMode::Auto,
            "required" if !tools.is_empty() => ToolMode::Required(names.clone()),
            "auto" | "required" => {
                return bad(format!("`tool_choice` is `{s}` but `tools` is empty"))
            }
            other => {
                return bad(format!(
                    "`tool_choice` is `{other}`; expected none, auto, required or a named function"
                ))
            }
        },
        Some(v) => {
            let name = v["function"]["name"].as_str().unwrap_or_default();
            if v["type"].as_str() != Some("function") || name.is_empty() {
                return bad(
                    "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into(),
                );
            }
            if !names.iter().any(|n| n == name) {
                return bad(format!(
                    "`tool_choice` names `{name}`, which is not in `tools` ({})",
                    names.join(", ")
                ));
            }
            ToolMode::Required(vec![name.to_string()])
        }
    };
    Ok((tools, mode))
}

/// The grammar of one call of one of `names` among `tools`, in `format`, or with `parallel`
/// (`parallel_tool_calls`, OpenAI's default) one or more calls as the format writes several:
/// each call's name fixed and its arguments valid against the tool's parameters.
pub(super) fn call_grammar(
    format: ToolFormat,
    tools: &[Value],
    names: &[String],
    parallel: bool,
) -> GrammarSpec {
    let args_key = if format == ToolFormat::Llama3 {
        "parameters"
    } else {
        "arguments"
    };
    let calls: Vec<Value> = tools
        .iter()
        .filter(|t| {
            names
                .iter()
                .any(|n| t["function"]["name"].as_str() == Some(n))
        })
        .map(|t| {
            let f = &t["function"];
            let mut params = match &f["parameters"] {
                Value::Null => json!({"type": "object"}),
                p => p.clone(),
            };
            crate::constraint::close_objects(&mut params);
            json!({
                "type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": false
            })
        })
        .collect();
    // Compact JSON, as structured outputs generate it.
    let compact = json!({"whitespace_flexible": false});
    let call = json!({"anyOf": calls, "x-guidance": compact});
    let mut array = json!({"type": "array", "items": call, "minItems": 1, "x-guidance": compact});
    if !parallel {
        array["maxItems"] = json!(1);
    }
    // Several calls as each format writes them: Hermes blocks on lines of their own, Llama 3's
    // calls joined by `;`, Mistral's array, or the generic format's array.
    let more = |sep: &str| {
        if parallel {
            format!(" ({sep} one)*")
        } else {
            String::new()
        }
    };
    let lark = match format {
        ToolFormat::Hermes => format!(
            "start: one{}\none: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {call}",
            more("\"\\n\"")
        ),
        ToolFormat::Mistral => format!("start: \"[TOOL_CALLS]\" calls\ncalls: %json {array}"),
        ToolFormat::Llama3 => format!("start: one{}\none: %json {call}", more("\";\"")),
        ToolFormat::Json if parallel => {
            format!(
                "start: %json {}",
                json!({"anyOf": [call, array], "x-guidance": compact})
            )
        }
        ToolFormat::Json => format!("start: %json {call}"),
    };
    GrammarSpec::Lark(lark)
}

/// Each tool's parameters compiled to a JSON Schema validator (a tool without parameters takes
/// any object; one whose parameters do not compile is not checked).
pub(super) fn validators(tools: &[Value]) -> BTreeMap<String, Arc<jsonschema::Validator>> {
    tools
        .iter()
        .filter_map(|t| {
            let f = &t["function"];
            let name = f["name"].as_str()?.to_string();
            let params = match &f["parameters"] {
                Value::Null => json!({"type": "object"}),
                p => p.clone(),
            };
            let v = jsonschema::validator_for(&params).ok()?;
            Some((name, Arc::new(v)))
        })
        .collect()
}

/// A request message as the template takes it: an assistant's `tool_calls` with their
/// arguments as objects (OpenAI sends them as JSON text; templates write them as JSON),
/// a tool result's id and name.
pub(super) fn chat_message(m: &Message, content: String) -> ChatMessage {
    let tool_calls = m.tool_calls.clone().map(|mut calls| {
        for c in calls.as_array_mut().into_iter().flatten() {
            let args = &mut c["function"]["arguments"];
            if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str(s).ok()) {
                *args = parsed;
            }
        }
        calls
    });
    ChatMessage {
        tool_calls,
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
        ..ChatMessage::new(m.role.clone(), content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constraint::Grammars;
    use crate::tokenizer::Tokenizer;
    use maxc_graph::tokenizer::tokenizer_json_from_gguf;
    use maxc_graph::weights::gguf::GgufFile;
    use std::path::PathBuf;

    /// Grammars over SmolLM2's tokenizer (scripts/fetch-smollm2.sh fetches the GGUF), and
    /// the tokenizer.
    fn grammars() -> (Grammars, &'static Tokenizer) {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let path = root.join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !path.is_file() {
            let ok = std::process::Command::new("bash")
                .arg("scripts/fetch-smollm2.sh")
                .current_dir(&root)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "scripts/fetch-smollm2.sh failed");
        }
        let json = tokenizer_json_from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let tok: &'static Tokenizer = Box::leak(Box::new(Tokenizer::from_json_str(&json).unwrap()));
        let eos = [i64::from(tok.token_id("<|im_end|>").unwrap())];
        (
            Grammars::new(&json, tok, tok.vocab_size(), &eos).unwrap(),
            tok,
        )
    }

    /// Whether `text` (tokenized) is a whole output the grammar accepts.
    fn accepts((g, tok): &(Grammars, &Tokenizer), spec: &GrammarSpec, text: &str) -> bool {
        let mut c = g.compile(spec).unwrap();
        let ids = tok.encode(text, false).unwrap();
        // Every token taken (none after the grammar ended), the end a whole match.
        ids.iter()
            .all(|&t| !c.is_complete() && c.consume(i64::from(t)).is_ok())
            && c.is_accepting()
    }

    #[test]
    fn required_calls_are_one_or_several_as_each_format_writes_them() {
        let g = grammars();
        let tools = vec![
            json!({"type": "function", "function": {"name": "add", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ];
        let names = vec!["add".to_string(), "now".to_string()];
        let add = r#"{"name":"add","arguments":{"a":1,"b":2}}"#;
        let now = r#"{"name":"now","arguments":{}}"#;
        let bad = r#"{"name":"add","arguments":{"a":1}}"#;
        let cases = [
            (
                ToolFormat::Hermes,
                format!("<tool_call>\n{add}\n</tool_call>"),
                format!("<tool_call>\n{add}\n</tool_call>\n<tool_call>\n{now}\n</tool_call>"),
                format!("<tool_call>\n{bad}\n</tool_call>"),
            ),
            (
                ToolFormat::Mistral,
                format!("[TOOL_CALLS][{add}]"),
                format!("[TOOL_CALLS][{add},{now}]"),
                format!("[TOOL_CALLS][{bad}]"),
            ),
            (
                ToolFormat::Json,
                add.to_string(),
                format!("[{add},{now}]"),
                bad.to_string(),
            ),
        ];
        for (format, one, two, wrong) in cases {
            let parallel = call_grammar(format, &tools, &names, true);
            let single = call_grammar(format, &tools, &names, false);
            assert!(accepts(&g, &parallel, &one), "{format:?} one call");
            assert!(accepts(&g, &parallel, &two), "{format:?} two calls");
            assert!(
                accepts(&g, &single, &one),
                "{format:?} one call, not parallel"
            );
            assert!(
                !accepts(&g, &single, &two),
                "{format:?} two calls, not parallel"
            );
            assert!(
                !accepts(&g, &parallel, &wrong),
                "{format:?} arguments off the schema"
            );
        }
    }
}
