//! A chat request's tools: their check, what `tool_choice` asks, the grammar that makes
//! `required` (or a named function) a call of a listed tool with valid arguments, and the
//! conversation's tool calls and results as the chat template takes them.

use super::openai::{ApiError, ChatRequest, Message};
use crate::chat::ChatMessage;
use crate::constraint::GrammarSpec;
use crate::tools::ToolFormat;
use serde_json::{json, Value};

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

/// The grammar of one call of one of `names` among `tools`, in `format`: the call's name
/// fixed and its arguments valid against the tool's parameters.
pub(super) fn call_grammar(format: ToolFormat, tools: &[Value], names: &[String]) -> GrammarSpec {
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
    let call = json!({"anyOf": calls, "x-guidance": {"whitespace_flexible": false}});
    let lark = match format {
        ToolFormat::Hermes => {
            format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {call}")
        }
        ToolFormat::Mistral => format!(
            "start: \"[TOOL_CALLS]\" calls\ncalls: %json {}",
            json!({"type": "array", "items": call, "minItems": 1, "maxItems": 1,
                   "x-guidance": {"whitespace_flexible": false}})
        ),
        ToolFormat::Llama3 | ToolFormat::Json => format!("start: %json {call}"),
    };
    GrammarSpec::Lark(lark)
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
