//! `POST /v1/chat/completions`: the conversation rendered by the artifact's chat template
//! into one job.

use super::admission::{choices, request_for, tokenizer, Job, Plan, ToolParsing};
use super::choice::ms;
use super::generation::Endpoint;
use super::openai::{self, ApiError, ChatRequest, Content};
use super::tool_choice::{call_grammar, chat_message, tools_of, ToolMode};
use super::{App, Loaded};
use crate::tools::ToolFormat;
use std::time::Instant;

pub(super) fn message_text(m: &openai::Message, i: usize) -> Result<String, ApiError> {
    Ok(match &m.content {
        None => String::new(),
        Some(Content::Text(s)) => s.clone(),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].content"),
                        format!(
                            "content parts of type `{}` are not supported (text only)",
                            p.kind
                        ),
                    ));
                }
                s.push_str(p.text.as_deref().unwrap_or_default());
            }
            s
        }
    })
}

impl Endpoint for ChatRequest {
    /// The request's one job: the conversation rendered and tokenized.
    fn plan(self, app: &App, l: &Loaded) -> Result<Plan, ApiError> {
        let req = self;
        let messages = match &req.messages {
            None => return Err(ApiError::invalid("messages", "`messages` is required")),
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid("messages", "`messages` is empty"))
            }
            Some(m) => m,
        };
        let t = Instant::now();
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Ok(chat_message(m, message_text(m, i)?)))
            .collect::<Result<Vec<_>, ApiError>>()?;
        let (tools, mode) = tools_of(&req)?;
        app.metrics
            .num_input_characters
            .inc_by(msgs.iter().map(|m| m.content.chars().count() as u64).sum());
        let template = l.chat.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "the artifact has no chat template; use /v1/completions",
            )
        })?;
        let tools_value = (mode != ToolMode::None).then(|| serde_json::Value::Array(tools.clone()));
        let text = template
            .render_with(
                &msgs,
                true,
                tools_value.as_ref(),
                req.chat_template_kwargs.as_ref(),
            )
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let format = ToolFormat::of_template(template.source());
        let ids: Vec<i64> = tokenizer(l, "messages")?
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?
            .into_iter()
            .map(i64::from)
            .collect();
        let logprobs = req.logprobs.unwrap_or(false);
        let top = match super::admission::count_in("top_logprobs", req.top_logprobs, 20)? {
            Some(_) if !logprobs => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            k => k.unwrap_or(0),
        };
        let mut request = request_for(l, &req.common, ids, "messages", &app.metrics)?;
        request.logprobs = logprobs.then_some(top);
        if let ToolMode::Required(names) = &mode {
            if request.constraint.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a required tool call and `response_format` cannot both constrain the output",
                ));
            }
            // `required` may call several tools at once (OpenAI's `parallel_tool_calls`, on
            // by default); a named function is called once.
            let parallel = req.parallel_tool_calls.unwrap_or(true)
                && req.tool_choice.as_ref().and_then(|c| c.as_str()) == Some("required");
            let spec = call_grammar(format, &tools, names, parallel);
            let compiled = l.grammars().and_then(|g| g.compile(&spec)).map_err(|e| {
                app.metrics
                    .structured_output_grammar_rejections
                    .get_or_create(&vec![("kind".into(), "tool_grammar".into())])
                    .inc();
                ApiError::invalid(
                    "tools",
                    format!("the tools' call grammar cannot be compiled: {e}"),
                )
            })?;
            request.constraint = Some(compiled);
        }
        app.metrics.input_processing_time.observe(ms(t.elapsed()));
        let jobs = choices(app, l, &req.common, vec![Job::new(request, None)])?;
        let mut plan = Plan::new(&req.common, jobs, true, logprobs);
        // A prompt that ends by opening the thinking section (DeepSeek-R1's template does)
        // starts the answer inside it.
        plan.reasoning = l.reasoning.then(|| text.trim_end().ends_with("<think>"));
        if mode != ToolMode::None {
            plan.tools = Some(ToolParsing {
                format,
                names: tools
                    .iter()
                    .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
                    .collect(),
                params: super::tool_choice::validators(&tools),
                eos: l.eos.clone(),
            });
        }
        Ok(plan)
    }
}
