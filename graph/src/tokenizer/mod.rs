//! A Hugging Face `tokenizer.json` built from a GGUF file's tokenizer metadata.
//!
//! A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges or scores, the token
//! types and the special token ids under llama.cpp's `tokenizer.ggml.*` keys.
//! [`tokenizer_json_from_gguf`] rebuilds from them, per `tokenizer.ggml.model`:
//! - `gpt2`: byte-level BPE, as transformers' GGUF loader builds it ([`byte_level`]);
//! - `llama`: SentencePiece BPE, encoding as llama.cpp's SPM tokenizer does ([`sentencepiece`]).
//!
//! and serializes it as the `tokenizers` crate does, so that the runtime needs nothing else.

pub mod byte_level;
pub mod sentencepiece;

pub use byte_level::pre_tokenizer_split;

use crate::weights::gguf::{GgufFile, GgufValue};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::Tokenizer;

/// The `tokenizer.ggml.model` values maxc builds a tokenizer for.
pub const TOKENIZER_MODELS: [&str; 2] = ["gpt2", "llama"];

/// GGUF token type of a normal token.
const TOKEN_TYPE_NORMAL: u64 = 1;
/// GGUF token type of the unknown token.
const TOKEN_TYPE_UNKNOWN: u64 = 2;
/// GGUF token type of a control token (`<|endoftext|>`, `<start_of_turn>`), added as a special
/// token.
const TOKEN_TYPE_CONTROL: u64 = 3;
/// GGUF token type of a user-defined token (`<think>`), added as a plain added token.
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// A special token a GGUF names by id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufToken {
    /// The token id.
    pub id: u32,
    /// The token text, as `tokenizer.ggml.tokens` spells it.
    pub text: String,
}

/// The special tokens a GGUF names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GgufSpecialTokens {
    /// `tokenizer.ggml.bos_token_id`'s token.
    pub bos: Option<GgufToken>,
    /// `tokenizer.ggml.eos_token_id`'s token.
    pub eos: Option<GgufToken>,
    /// `tokenizer.ggml.unknown_token_id`'s token.
    pub unk: Option<GgufToken>,
    /// `tokenizer.ggml.padding_token_id`'s token.
    pub pad: Option<GgufToken>,
    /// `tokenizer.ggml.add_bos_token`; when absent, llama.cpp's default for the tokenizer model
    /// (true for `llama`, false for `gpt2`).
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token` (false when absent).
    pub add_eos: bool,
}

/// The chat template a GGUF carries (`tokenizer.chat_template`), if any.
pub fn chat_template_from_gguf(gguf: &GgufFile) -> Option<String> {
    gguf.get("tokenizer.chat_template")
        .and_then(GgufValue::as_str)
        .map(str::to_owned)
}

/// The special tokens of `gguf`; an id outside the vocabulary is an error naming its key.
pub fn special_tokens_from_gguf(gguf: &GgufFile) -> Result<GgufSpecialTokens> {
    let meta = Meta {
        path: &gguf.path,
        map: &gguf.metadata,
    };
    meta.special_tokens(&meta.strings("tokenizer.ggml.tokens")?)
}

/// `tokenizer.json` text for the tokenizer `gguf` describes, compact (pretty-printing more than
/// doubles a large vocabulary's merges). Deterministic.
pub fn tokenizer_json_from_gguf(gguf: &GgufFile) -> Result<String> {
    tokenizer_json_from_metadata(&gguf.path, &gguf.metadata)
}

/// [`tokenizer_json_from_gguf`] over GGUF metadata read from `path` (named in errors).
pub fn tokenizer_json_from_metadata(
    path: &Path,
    metadata: &BTreeMap<String, GgufValue>,
) -> Result<String> {
    let meta = Meta {
        path,
        map: metadata,
    };
    let tok = match meta.string("tokenizer.ggml.model")? {
        "gpt2" => byte_level::build(&meta)?,
        "llama" => sentencepiece::build(&meta)?,
        other => {
            return Err(meta.err(
                "tokenizer.ggml.model",
                format!(
                    "is `{other}`; maxc builds tokenizers for {}",
                    TOKENIZER_MODELS.join(", ")
                ),
            ))
        }
    };
    tok.to_string(false).map_err(|e| {
        meta.err(
            "tokenizer.ggml.tokens",
            format!("cannot serialize the tokenizer: {e}"),
        )
    })
}

/// The template llama.cpp and transformers apply: BOS before and EOS after the text where the
/// file asks.
fn post_processor(meta: &Meta, special: &GgufSpecialTokens) -> Result<TemplateProcessing> {
    let bos = special.bos.as_ref().filter(|_| special.add_bos);
    let eos = special.eos.as_ref().filter(|_| special.add_eos);
    let piece = |t: Option<&GgufToken>, seq: u8| t.map(|t| format!("{}:{seq}", t.text));
    let join =
        |parts: Vec<Option<String>>| parts.into_iter().flatten().collect::<Vec<_>>().join(" ");
    let single = join(vec![piece(bos, 0), Some("$A:0".into()), piece(eos, 0)]);
    let pair = join(vec![
        Some(single.clone()),
        piece(bos, 1),
        Some("$B:1".into()),
        piece(eos, 1),
    ]);
    let tokens: Vec<(String, u32)> = bos
        .into_iter()
        .chain(eos)
        .map(|t| (t.text.clone(), t.id))
        .collect();
    let bad = |e: String| {
        meta.err(
            "tokenizer.ggml.add_bos_token",
            format!("post-processor template: {e}"),
        )
    };
    TemplateProcessing::builder()
        .try_single(single.as_str())
        .map_err(bad)?
        .try_pair(pair.as_str())
        .map_err(bad)?
        .special_tokens(tokens)
        .build()
        .map_err(|e| bad(e.to_string()))
}

/// The error of a token that cannot be added to a tokenizer.
fn add_error(meta: &Meta, e: impl std::fmt::Display) -> Error {
    meta.err("tokenizer.ggml.tokens", format!("cannot add token: {e}"))
}

/// The BOS/EOS/UNK/PAD tokens added as special tokens.
fn add_named_tokens(tok: &mut Tokenizer, meta: &Meta, special: &GgufSpecialTokens) -> Result<()> {
    let named = [&special.bos, &special.eos, &special.unk, &special.pad];
    let named = (named.into_iter().flatten())
        .map(|t| tokenizers::AddedToken::from(t.text.as_str(), true).normalized(false));
    tok.add_special_tokens(named.collect::<Vec<_>>())
        .map_err(|e| add_error(meta, e))?;
    Ok(())
}

/// GGUF metadata with the file it came from, for errors.
struct Meta<'a> {
    path: &'a Path,
    map: &'a BTreeMap<String, GgufValue>,
}

impl Meta<'_> {
    fn err(&self, key: &str, message: impl Into<String>) -> Error {
        Error::config(self.path, key, message)
    }
    fn get(&self, key: &str) -> Result<&GgufValue> {
        self.map
            .get(key)
            .ok_or_else(|| self.err(key, "missing from the GGUF metadata"))
    }
    fn string(&self, key: &str) -> Result<&str> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| self.err(key, format!("expected a string, found {v:?}")))
    }
    fn array(&self, key: &str) -> Result<&[GgufValue]> {
        let v = self.get(key)?;
        v.as_array()
            .ok_or_else(|| self.err(key, "expected an array"))
    }
    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let items = self.array(key)?.iter().enumerate();
        items
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| self.err(key, format!("item {i} is {v:?}, expected a string")))
            })
            .collect()
    }
    fn ints(&self, key: &str) -> Result<Vec<u64>> {
        let items = self.array(key)?.iter().enumerate();
        items
            .map(|(i, v)| {
                v.as_u64()
                    .ok_or_else(|| self.err(key, format!("item {i} is {v:?}, expected an integer")))
            })
            .collect()
    }
    fn floats(&self, key: &str) -> Result<Vec<f64>> {
        let items = self.array(key)?.iter().enumerate();
        items
            .map(|(i, v)| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| self.err(key, format!("item {i} is {v:?}, expected a number")))
            })
            .collect()
    }
    /// `tokenizer.ggml.token_type`, one per token (all normal when absent).
    fn token_types(&self, tokens: usize) -> Result<Vec<u64>> {
        let key = "tokenizer.ggml.token_type";
        if !self.map.contains_key(key) {
            return Ok(vec![TOKEN_TYPE_NORMAL; tokens]);
        }
        let types = self.ints(key)?;
        if types.len() != tokens {
            return Err(self.err(
                key,
                format!(
                    "has {} entries; expected one per token ({tokens})",
                    types.len()
                ),
            ));
        }
        Ok(types)
    }
    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None => Ok(default),
            Some(GgufValue::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(key, format!("expected a boolean, found {v:?}"))),
        }
    }
    fn special_tokens(&self, tokens: &[String]) -> Result<GgufSpecialTokens> {
        let token = |name: &str| -> Result<Option<GgufToken>> {
            let key = format!("tokenizer.ggml.{name}_token_id");
            let Some(v) = self.map.get(&key) else {
                return Ok(None);
            };
            let id = v
                .as_u64()
                .ok_or_else(|| self.err(&key, format!("expected a token id, found {v:?}")))?;
            let t = tokens.get(id as usize).ok_or_else(|| {
                self.err(
                    &key,
                    format!("is {id}, outside the vocabulary of {} tokens", tokens.len()),
                )
            })?;
            Ok(Some(GgufToken {
                id: id as u32,
                text: t.clone(),
            }))
        };
        let spm = self
            .map
            .get("tokenizer.ggml.model")
            .and_then(GgufValue::as_str)
            == Some("llama");
        Ok(GgufSpecialTokens {
            bos: token("bos")?,
            eos: token("eos")?,
            unk: token("unknown")?,
            pad: token("padding")?,
            add_bos: self.flag("tokenizer.ggml.add_bos_token", spm)?,
            add_eos: self.flag("tokenizer.ggml.add_eos_token", false)?,
        })
    }
}
