//! Text to token ids and back, over a Hugging Face `tokenizer.json`.
//!
//! [`Tokenizer`] wraps the `tokenizers` crate; [`DecodeStream`] turns generated ids into text one
//! id at a time without ever cutting a character in two.

use std::path::{Path, PathBuf};

/// Result with [`TokenizerError`].
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A tokenizer error; each names the file, the text or the ids it concerns.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A `tokenizer.json` file could not be read or is not a tokenizer.
    #[error("{}: cannot load the tokenizer: {message}", path.display())]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// `tokenizer.json` text is not a tokenizer.
    #[error("tokenizer.json text is not a tokenizer: {0}")]
    Parse(String),
    /// Text could not be encoded.
    #[error("cannot encode {text}: {message}")]
    Encode {
        /// The start of the text, quoted.
        text: String,
        /// What went wrong.
        message: String,
    },
    /// Ids could not be decoded (for instance an id outside the vocabulary).
    #[error("cannot decode ids {ids}: {message}")]
    Decode {
        /// The ids, or the first of them.
        ids: String,
        /// What went wrong.
        message: String,
    },
}

/// A loaded tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// The tokenizer `artifact` carries, where it has one.
    pub fn of_artifact(
        artifact: &maxc_runtime::Artifact,
    ) -> maxc_runtime::Result<Option<Tokenizer>> {
        use maxc_runtime::schema::TOKENIZER_FILE;
        if !artifact.manifest.files.contains_key(TOKENIZER_FILE) {
            return Ok(None);
        }
        let path = artifact.dir.join(TOKENIZER_FILE);
        Tokenizer::from_file(&path)
            .map(Some)
            .map_err(|e| maxc_runtime::RuntimeError::artifact(&path, e.to_string()))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::from_json_str(&text).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            message: match e {
                TokenizerError::Parse(m) => m,
                other => other.to_string(),
            },
        })
    }

    /// Parses `tokenizer.json` text.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| TokenizerError::Parse(format!("{e}")))?;
        Ok(Tokenizer { inner })
    }

    /// The ids of `text`; with `add_special_tokens` the tokenizer's post-processor adds its
    /// special tokens (a BOS, for instance) as `transformers` does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode {
                text: preview(text),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`; every id must be in the vocabulary (added tokens included).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::Decode {
                ids: id_list(ids),
                message: format!(
                    "id {bad} is not in the vocabulary of {} tokens",
                    self.vocab_size()
                ),
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                ids: id_list(ids),
                message: e.to_string(),
            })
    }

    /// The id of the token spelled `token` (in the vocabulary's own spelling, e.g. `Ġthe`, or an
    /// added token such as `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token spelled by `id`, in the vocabulary's own spelling.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A streaming decoder over this tokenizer.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream {
            tokenizer: self,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// Decodes ids one at a time into text pieces whose concatenation is the decoding of all ids.
///
/// A piece is emitted only once the ids so far decode to whole characters: a character whose
/// UTF-8 bytes span several byte-level tokens comes out with the token that completes it. The
/// ids after the last emitted piece and the one before it (context for decoders that treat the
/// first token specially) are all it keeps.
#[derive(Debug)]
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// The ids kept: `ids[..read]` were emitted, `ids[prefix..read]` is the context.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl DecodeStream<'_> {
    /// Adds `id`; returns the new text if the ids so far end on a whole character.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let skip = self.skip_special_tokens;
        let before = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], skip)?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..], skip)?;
        if now.len() <= before.len() || now.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let Some(new) = now.strip_prefix(before.as_str()) else {
            return Err(TokenizerError::Decode {
                ids: id_list(&self.ids),
                message: format!(
                    "streaming: the text {before:?} decoded so far became {now:?} with id {id}"
                ),
            });
        };
        let new = new.to_owned();
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(Some(new))
    }

    /// The text of the ids pushed since the last piece, even if it ends on a partial character
    /// (then with U+FFFD in its place); `None` when nothing is pending. Ends the stream's
    /// pending state: later pushes start after these ids.
    pub fn flush(&mut self) -> Result<Option<String>> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let skip = self.skip_special_tokens;
        let before = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], skip)?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..], skip)?;
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(now
            .strip_prefix(before.as_str())
            .map(str::to_owned)
            .filter(|s| !s.is_empty()))
    }
}

/// The start of `text`, quoted, for error messages.
fn preview(text: &str) -> String {
    const MAX: usize = 60;
    match text.char_indices().nth(MAX) {
        Some((i, _)) => format!("{:?}... ({} bytes)", &text[..i], text.len()),
        None => format!("{text:?}"),
    }
}

/// `ids` for error messages, shortened when long.
fn id_list(ids: &[u32]) -> String {
    const MAX: usize = 16;
    if ids.len() <= MAX {
        format!("{ids:?}")
    } else {
        format!("{:?}... ({} ids)", &ids[..MAX], ids.len())
    }
}
