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

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: String::new(),
            eos_token: String::new(),
        })
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
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        template
            .render(context! {
                messages => Value::from(Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| ChatTemplateError::Render(describe(&e)))
    }
}

/// A minijinja error with its kind, detail, template name and line.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    if let Some(range) = e.range() {
        text.push_str(&format!(" (bytes {}..{})", range.start, range.end));
    }
    text
}
