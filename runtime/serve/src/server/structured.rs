//! Where a request asks for structured output, and what it asks for: OpenAI's
//! `response_format` (`text`, `json_object`, `json_schema`) or vLLM's `structured_outputs`
//! object (`json`, `json_object`, `regex`, `choice`, `grammar`), both on both endpoints; at most
//! one constraint per request.

use super::openai::{ApiError, Common};
use crate::constraint::GrammarSpec;
use serde_json::Value;

/// The grammar `c` asks for, with the field that asked; `None` for free text.
pub(super) fn grammar_spec(c: &Common) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let from_format = c
        .response_format
        .as_ref()
        .map(response_format)
        .transpose()?
        .flatten();
    let from_outputs = c
        .structured_outputs
        .as_ref()
        .map(structured_outputs)
        .transpose()?;
    match (from_format, from_outputs) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "structured_outputs",
            "give `response_format` or `structured_outputs`, not both",
        )),
        (Some(s), None) => Ok(Some((s, "response_format"))),
        (None, Some(s)) => Ok(Some((s, "structured_outputs"))),
        (None, None) => Ok(None),
    }
}

fn keys_in(v: &Value, param: &str, known: &[&str]) -> Result<(), ApiError> {
    let Some(o) = v.as_object() else {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be an object"),
        ));
    };
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            param,
            format!(
                "unknown field `{k}` in `{param}`; expected {}",
                known.join(", ")
            ),
        ));
    }
    Ok(())
}

/// OpenAI's `response_format`.
fn response_format(v: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    const P: &str = "response_format";
    keys_in(v, P, &["type", "json_schema"])?;
    match v["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let js = &v["json_schema"];
            keys_in(
                js,
                "response_format.json_schema",
                &["name", "description", "schema", "strict"],
            )?;
            match &js["schema"] {
                s @ Value::Object(_) | s @ Value::Bool(_) => {
                    Ok(Some(GrammarSpec::JsonSchema(s.clone())))
                }
                Value::Null => Err(ApiError::invalid(
                    P,
                    "`response_format.json_schema.schema` is required",
                )),
                _ => Err(ApiError::invalid(
                    P,
                    "`response_format.json_schema.schema` must be a JSON Schema object",
                )),
            }
        }
        other => Err(ApiError::invalid(
            P,
            format!(
                "`response_format.type` is {}; expected text, json_object or json_schema",
                other.map_or_else(|| v["type"].to_string(), |s| format!("`{s}`"))
            ),
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of its constraints.
fn structured_outputs(v: &Value) -> Result<GrammarSpec, ApiError> {
    const P: &str = "structured_outputs";
    keys_in(v, P, &["json", "json_object", "regex", "choice", "grammar"])?;
    let o = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, x)| !x.is_null());
    let given: Vec<(&String, &Value)> = o.collect();
    let [(key, value)] = given.as_slice() else {
        return Err(ApiError::invalid(
            P,
            "`structured_outputs` takes exactly one of json, json_object, regex, choice, grammar",
        ));
    };
    let text = |what: &str| {
        value.as_str().map(str::to_string).ok_or_else(|| {
            ApiError::invalid(
                P,
                format!("`structured_outputs.{key}` must be a string ({what})"),
            )
        })
    };
    match key.as_str() {
        "json" => match value {
            Value::Object(_) | Value::Bool(_) => Ok(GrammarSpec::JsonSchema((*value).clone())),
            // vLLM accepts the schema as a JSON string too.
            Value::String(s) => serde_json::from_str(s)
                .map(GrammarSpec::JsonSchema)
                .map_err(|e| {
                    ApiError::invalid(P, format!("`structured_outputs.json` is not JSON: {e}"))
                }),
            _ => Err(ApiError::invalid(
                P,
                "`structured_outputs.json` must be a JSON Schema",
            )),
        },
        "json_object" => match value.as_bool() {
            Some(true) => Ok(GrammarSpec::JsonObject),
            _ => Err(ApiError::invalid(
                P,
                "`structured_outputs.json_object` must be true",
            )),
        },
        "regex" => Ok(GrammarSpec::Regex(text("a regular expression")?)),
        "grammar" => Ok(GrammarSpec::Lark(text("a Lark grammar")?)),
        "choice" => {
            let choices: Option<Vec<String>> = value
                .as_array()
                .map(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect())
                .unwrap_or(None);
            match choices {
                Some(c) if !c.is_empty() => Ok(GrammarSpec::Choice(c)),
                _ => Err(ApiError::invalid(
                    P,
                    "`structured_outputs.choice` must be a non-empty list of strings",
                )),
            }
        }
        _ => unreachable!("keys checked above"),
    }
}
