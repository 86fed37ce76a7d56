//! Chat templates: a model's Jinja template turning chat messages into prompt text, rendered
//! the way transformers' `apply_chat_template` renders it.
//!
//! The environment matches transformers': blocks trim their trailing newline and strip leading
//! blanks (`trim_blocks`, `lstrip_blocks`), `{% break %}`/`{% continue %}` work, strings have
//! Python's methods (`.strip()`, `.startswith()`, ... from `minijinja-contrib`'s pycompat),
//! `tojson` is a filter and `raise_exception(msg)` fails the render with `msg`.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value};
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

/// The name the template is registered under, shown in errors.
const TEMPLATE_NAME: &str = "chat_template";

/// A chat template error: the template's syntax, or a failure while rendering it.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The template does not parse.
    #[error("chat template does not parse: {0}")]
    Syntax(String),
    /// The template failed while rendering (an undefined function, `raise_exception`, ...).
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// One chat message, as transformers hands it to a template: an assistant's `tool_calls`
/// (OpenAI's shape, `function.arguments` as an object, as templates expect) and a tool
/// result's `tool_call_id` and `name` only where the message has them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// The calls an assistant made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The participant's or the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message from `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A compiled chat template with the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    source: String,
}

impl ChatTemplate {
    /// `artifact`'s chat template with its BOS and EOS token texts (from `tokenizer`), where
    /// it has one.
    pub fn of_artifact(
        artifact: &maxc_runtime::Artifact,
        tokenizer: &crate::tokenizer::Tokenizer,
    ) -> maxc_runtime::Result<Option<ChatTemplate>> {
        let Some(source) = &artifact.manifest.chat_template else {
            return Ok(None);
        };
        let text = |id: Option<i64>| {
            id.and_then(|i| u32::try_from(i).ok())
                .and_then(|i| tokenizer.token(i))
                .unwrap_or_default()
        };
        let template = ChatTemplate::new(source).map_err(|e| {
            maxc_runtime::RuntimeError::artifact(
                artifact.dir.join(maxc_runtime::schema::MANIFEST_FILE),
                format!("chat_template: {e}"),
            )
        })?;
        Ok(Some(template.with_special_tokens(
            text(artifact.manifest.bos_token_id),
            text(artifact.manifest.eos_token_ids.first().copied()),
        )))
    }

    /// Compiles `source` (a `tokenizer.chat_template` / `chat_template` string); `bos_token`
    /// and `eos_token` start empty (see [`ChatTemplate::with_special_tokens`]).
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: String::new(),
            eos_token: String::new(),
            source: source.to_owned(),
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Sets the `bos_token` and `eos_token` the template sees.
    pub fn with_special_tokens(mut self, bos: impl Into<String>, eos: impl Into<String>) -> Self {
        self.bos_token = bos.into();
        self.eos_token = eos.into();
        self
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends with the opening of
    /// the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// Whether the template writes a thinking section (`<think>` ... `</think>`, as Qwen 3
    /// and DeepSeek-R1's distills do) or takes `enable_thinking`.
    pub fn thinks(&self) -> bool {
        self.source.contains("<think>") || self.source.contains("enable_thinking")
    }

    /// [`ChatTemplate::render`] with the tools the model may call (OpenAI's `tools` list, as
    /// transformers' `apply_chat_template(tools=...)` passes it; `None` leaves `tools`
    /// undefined).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        self.render_with(messages, add_generation_prompt, tools, None)
    }

    /// [`ChatTemplate::render_with_tools`] with the request's `chat_template_kwargs` as more
    /// variables (`enable_thinking`, say), which never replace the ones above.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        let ctx = context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        let ctx = match tools {
            Some(t) => context! { tools => Value::from(Serde(t)), ..ctx },
            None => ctx,
        };
        let ctx = match kwargs {
            Some(k) => context! { ..ctx, ..Value::from(Serde(k)) },
            None => ctx,
        };
        template
            .render(ctx)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))
    }
}

/// transformers' `strftime_now(format)`: the date and time now (UTC), with `%Y %y %m %d %e
/// %B %b %H %M %S %%` (the directives chat templates use); other directives stay as written.
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_time(format, secs)
}

/// `format` (see [`strftime_now`]) of `secs` seconds after the Unix epoch, UTC.
fn format_time(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Howard Hinnant's civil_from_days.
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(name),
            Some('b') => out.push_str(&name[..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// A minijinja error with its kind, detail, template name and line.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    if let Some(range) = e.range() {
        text.push_str(&format!(" (bytes {}..{})", range.start, range.end));
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn strftime_formats_a_date_as_python_does() {
        // 2026-12-05 04:34:52 UTC.
        let t = 1_796_445_292;
        assert_eq!(super::format_time("%Y-%m-%d", t), "2026-12-05");
        assert_eq!(super::format_time("%d %b %Y", t), "05 Dec 2026");
        assert_eq!(
            super::format_time("%B %e, %y %H:%M:%S %% %q", t),
            "December  5, 26 04:34:52 % %q"
        );
        assert_eq!(super::format_time("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
