//! Tool calls in a model's output: the format a chat template teaches its model (read from the
//! template's source), the calls parsed out of a finished output, and whether a partial output
//! may still become a call (streamed text that might open one is held back, never sent as
//! content).
//!
//! Formats, as the families' templates write them:
//! - [`ToolFormat::Hermes`]: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
//!   block per call (Qwen 2.5 and 3, Hermes 2 Pro and 3).
//! - [`ToolFormat::Llama3`]: a JSON object `{"name": ..., "parameters": {...}}`, after
//!   `<|python_tag|>` or alone, several separated by `;` (Llama 3.1 to 3.3).
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or
//!   `[TOOL_CALLS]name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) per call (Mistral Small
//!   3.2 and later).
//! - [`ToolFormat::Json`]: any other template: the whole output a JSON call object or a list
//!   of them.

use serde_json::Value;

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>` blocks of JSON.
    Hermes,
    /// JSON objects with `parameters`, optionally after `<|python_tag|>`.
    Llama3,
    /// `[TOOL_CALLS]` followed by a JSON list, or by `name[ARGS]{...}` per call.
    Mistral,
    /// The whole output one JSON call or a list of them.
    Json,
}

/// One call parsed out of an output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as a JSON object's text (OpenAI sends them as a string).
    pub arguments: String,
}

/// An output split into text and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// The text outside the calls (trimmed); all of it where no call parsed.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ToolCall>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";

impl ToolFormat {
    /// The format the chat template `source` teaches (what it writes for an assistant's
    /// `tool_calls`, or asks of the model).
    pub fn of_template(source: &str) -> ToolFormat {
        if source.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if source.contains(MISTRAL_CALLS) {
            ToolFormat::Mistral
        } else if source.contains(PYTHON_TAG) || source.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Json
        }
    }

    /// Whether `text`, the output so far, may be or become a tool call, so that it must not be
    /// streamed as content yet: it starts (after blanks) with the format's opening, a prefix of
    /// it, or (JSON formats) a `{` or `[`.
    pub fn may_open_call(self, text: &str) -> bool {
        let t = text.trim_start();
        if t.is_empty() {
            return true;
        }
        let opens = |marker: &str| t.starts_with(marker) || marker.starts_with(t);
        match self {
            ToolFormat::Hermes => opens(HERMES_OPEN),
            ToolFormat::Mistral => opens(MISTRAL_CALLS),
            ToolFormat::Llama3 => opens(PYTHON_TAG) || t.starts_with('{'),
            ToolFormat::Json => t.starts_with('{') || t.starts_with('['),
        }
    }

    /// The calls in a finished `output`, with the text around them. Output that does not
    /// parse as the format's calls (bad JSON, no name) is all content, no call.
    pub fn parse(self, output: &str) -> Parsed {
        let calls = match self {
            ToolFormat::Hermes => return hermes(output),
            ToolFormat::Llama3 => {
                let body = output.trim_start();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body);
                body.split(';')
                    .map(|c| call_of_json(c.trim()))
                    .collect::<Option<Vec<_>>>()
            }
            ToolFormat::Mistral => output
                .trim_start()
                .strip_prefix(MISTRAL_CALLS)
                .and_then(mistral),
            ToolFormat::Json => calls_of_json(output.trim()),
        };
        match calls {
            Some(calls) if !calls.is_empty() => Parsed {
                content: String::new(),
                calls,
            },
            _ => Parsed {
                content: output.trim().to_string(),
                calls: Vec::new(),
            },
        }
    }
}

/// `<tool_call>` blocks: each a JSON call, the last one's closing tag optional (generation may
/// stop at it); text between blocks is content. A block that does not parse makes the whole
/// output content.
fn hermes(output: &str) -> Parsed {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = output;
    while let Some(open) = rest.find(HERMES_OPEN) {
        content.push_str(&rest[..open]);
        let after = &rest[open + HERMES_OPEN.len()..];
        let (body, next) = match after.find(HERMES_CLOSE) {
            Some(close) => (&after[..close], &after[close + HERMES_CLOSE.len()..]),
            None => (after, ""),
        };
        match call_of_json(body.trim()) {
            Some(c) => calls.push(c),
            None => {
                return Parsed {
                    content: output.trim().to_string(),
                    calls: Vec::new(),
                }
            }
        }
        rest = next;
    }
    content.push_str(rest);
    Parsed {
        content: content.trim().to_string(),
        calls,
    }
}

/// After `[TOOL_CALLS]`: a JSON list of calls, or `name[ARGS]{...}` repeated (each later call
/// after its own `[TOOL_CALLS]`).
fn mistral(body: &str) -> Option<Vec<ToolCall>> {
    let body = body.trim_start();
    if body.starts_with('[') {
        return calls_of_json(body.trim());
    }
    body.split(MISTRAL_CALLS)
        .map(|one| {
            let (name, args) = one.split_once(MISTRAL_ARGS)?;
            let args: Value = serde_json::from_str(args.trim()).ok()?;
            // `name[CALL_ID]id[ARGS]...`, as Mistral Small 3.2's template writes a call it
            // gives an id.
            let name = name.split(MISTRAL_CALL_ID).next().unwrap_or(name).trim();
            (!name.is_empty() && args.is_object()).then(|| ToolCall {
                name: name.to_string(),
                arguments: args.to_string(),
            })
        })
        .collect()
}

/// A JSON call object, or a list of them.
fn calls_of_json(text: &str) -> Option<Vec<ToolCall>> {
    match serde_json::from_str::<Value>(text).ok()? {
        Value::Array(items) => items.iter().map(call_of_value).collect(),
        v => call_of_value(&v).map(|c| vec![c]),
    }
}

fn call_of_json(text: &str) -> Option<ToolCall> {
    call_of_value(&serde_json::from_str(text).ok()?)
}

/// `{"name": ..., "arguments" | "parameters": {...} | "<json text>"}`, or OpenAI's own
/// `{"function": {"name", "arguments"}}`.
fn call_of_value(v: &Value) -> Option<ToolCall> {
    let v = v.get("function").unwrap_or(v);
    let name = v.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let args = match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?,
        a => a,
    };
    args.is_object().then(|| ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn the_format_comes_from_the_template() {
        assert_eq!(
            ToolFormat::of_template("{{- '<tool_call>\\n{\"name\": ' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::of_template("{{- '[TOOL_CALLS]' + name }}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::of_template("{{- '<|python_tag|>' }}"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::of_template("{{ messages }}"), ToolFormat::Json);
    }

    #[test]
    fn hermes_blocks_parse_with_the_text_around_them() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}";
        let p = ToolFormat::Hermes.parse(out);
        assert_eq!(p.content, "Let me check.");
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", r#"{"city":"Paris"}"#),
                call("get_time", "{}")
            ]
        );
        // Arguments given as a JSON string are parsed into the same text.
        let p = ToolFormat::Hermes
            .parse("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>");
        assert_eq!(p.calls, vec![call("f", r#"{"x":1}"#)]);
    }

    #[test]
    fn text_that_only_looks_like_a_call_stays_content() {
        for (format, out) in [
            (ToolFormat::Hermes, "<tool_call> is how I would call a tool"),
            (
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"f\", \"arguments\": {",
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>{\"arguments\": {}}</tool_call>",
            ),
            (ToolFormat::Llama3, "{not json}"),
            (ToolFormat::Llama3, "{\"city\": \"Paris\"}"),
            (ToolFormat::Mistral, "[TOOL_CALLS] none today"),
            (ToolFormat::Json, "[1, 2, 3]"),
            (ToolFormat::Json, "Just text."),
        ] {
            let p = format.parse(out);
            assert!(p.calls.is_empty(), "{format:?} {out}: {p:?}");
            assert_eq!(p.content, out.trim(), "{format:?}");
        }
    }

    #[test]
    fn llama3_calls_with_and_without_the_python_tag() {
        let p = ToolFormat::Llama3.parse(
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lima\"}}",
        );
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Lima"}"#)]);
        let p = ToolFormat::Llama3.parse(
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": [1]}}",
        );
        assert_eq!(p.calls, vec![call("a", "{}"), call("b", r#"{"k":[1]}"#)]);
        assert_eq!(p.content, "");
    }

    #[test]
    fn mistral_calls_in_both_dialects() {
        let p = ToolFormat::Mistral.parse(
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}, {\"name\": \"get_time\", \"arguments\": {}}]",
        );
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", r#"{"city":"Tokyo"}"#),
                call("get_time", "{}")
            ]
        );
        let p = ToolFormat::Mistral.parse(
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Tokyo\"}[TOOL_CALLS]get_time[ARGS]{}",
        );
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", r#"{"city":"Tokyo"}"#),
                call("get_time", "{}")
            ]
        );
    }

    #[test]
    fn generic_json_and_openai_shapes() {
        let p = ToolFormat::Json.parse(
            "[{\"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}, {\"name\": \"g\", \"arguments\": {\"a\": 1}}]",
        );
        assert_eq!(p.calls, vec![call("f", "{}"), call("g", r#"{"a":1}"#)]);
    }

    #[test]
    fn what_may_still_become_a_call_is_held_back() {
        for (format, text, held) in [
            (ToolFormat::Hermes, "", true),
            (ToolFormat::Hermes, " <tool", true),
            (ToolFormat::Hermes, "<tool_call>{\"na", true),
            (ToolFormat::Hermes, "<tools are fun", false),
            (ToolFormat::Hermes, "Sure", false),
            (ToolFormat::Mistral, "[TOOL_", true),
            (ToolFormat::Mistral, "[Tips]", false),
            (ToolFormat::Llama3, "<|python", true),
            (ToolFormat::Llama3, "{\"name\"", true),
            (ToolFormat::Llama3, "Hello", false),
            (ToolFormat::Json, "[", true),
            (ToolFormat::Json, "Hello", false),
        ] {
            assert_eq!(format.may_open_call(text), held, "{format:?} {text:?}");
        }
    }
}
