//! A Hugging Face `tokenizer.json` built from a GGUF file's tokenizer metadata.
//!
//! A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, the token types and
//! the special token ids under llama.cpp's `tokenizer.ggml.*` keys. [`tokenizer_json_from_gguf`]
//! rebuilds from them the tokenizer that transformers' GGUF loader builds (the byte-level BPE of
//! `GPT2Tokenizer`, control tokens added as special tokens, user-defined tokens as plain added
//! tokens, a split regex for the `tokenizer.ggml.pre` values transformers knows) and serializes it
//! as the `tokenizers` crate does. Only the `gpt2` tokenizer model (byte-level BPE) is supported.

use crate::weights::gguf::{GgufFile, GgufValue};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// GGUF token type of a control token (`<|endoftext|>`), added as a special token.
const TOKEN_TYPE_CONTROL: u64 = 3;
/// GGUF token type of a user-defined token (`<think>`), added as a plain added token.
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex transformers puts before byte-level BPE for a `tokenizer.ggml.pre` value.
/// Values not listed (`gpt-2`, `smollm`, ...) get GPT-2's own byte-level regex, as in
/// transformers.
pub fn pre_tokenizer_split(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

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
    /// `tokenizer.ggml.add_bos_token` (false when absent).
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

/// `tokenizer.json` text for the tokenizer `gguf` describes, as transformers builds it from
/// the same file and the `tokenizers` crate serializes it (pretty-printed). Deterministic.
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
    let model = meta.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(meta.err(
            "tokenizer.ggml.model",
            format!("is `{model}`; maxc builds tokenizers for `gpt2` (byte-level BPE) only"),
        ));
    }
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let token_types = match metadata.get("tokenizer.ggml.token_type") {
        Some(_) => meta.ints("tokenizer.ggml.token_type")?,
        None => Vec::new(),
    };
    let special = meta.special_tokens(&tokens)?;
    let vocab: Vocab = (tokens.iter().enumerate())
        .map(|(id, t)| (respell(t), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, meta.merges()?)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .build()
        .map_err(|e| {
            meta.err(
                "tokenizer.ggml.merges",
                format!("do not fit the vocabulary: {e}"),
            )
        })?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer(&meta)?));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(post_processor(&meta, &special)?));
    add_tokens(&mut tok, &meta, &tokens, &token_types, &special)?;
    tok.to_string(true).map_err(|e| {
        meta.err(
            "tokenizer.ggml.tokens",
            format!("cannot serialize the tokenizer: {e}"),
        )
    })
}

/// Byte-level BPE's pre-tokenizer: GPT-2's regex, or the split transformers uses for
/// `tokenizer.ggml.pre` followed by a regex-less byte-level step.
fn pre_tokenizer(meta: &Meta) -> Result<PreTokenizerWrapper> {
    let key = "tokenizer.ggml.pre";
    let pre = meta
        .map
        .get(key)
        .and_then(GgufValue::as_str)
        .unwrap_or("default");
    let Some(regex) = pre_tokenizer_split(pre) else {
        return Ok(ByteLevel::new(false, true, true).into());
    };
    let split = Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| meta.err(key, format!("`{pre}`: split regex does not compile: {e}")))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into())
}

/// Adds, in transformers' order, control tokens as special tokens, user-defined tokens as plain
/// added tokens, then the BOS/EOS/UNK/PAD tokens as special tokens.
fn add_tokens(
    tok: &mut Tokenizer,
    meta: &Meta,
    tokens: &[String],
    token_types: &[u64],
    special: &GgufSpecialTokens,
) -> Result<()> {
    let typed = |ty: u64| {
        let pairs = tokens.iter().zip(token_types);
        pairs.filter(move |(_, &t)| t == ty).map(|(s, _)| s)
    };
    // A control token outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
    let control = typed(TOKEN_TYPE_CONTROL)
        .filter(|s| s.chars().all(in_byte_alphabet))
        .map(|s| AddedToken::from(s.as_str(), true).normalized(false));
    let added = |e| meta.err("tokenizer.ggml.tokens", format!("cannot add token: {e}"));
    tok.add_special_tokens(control.collect::<Vec<_>>())
        .map_err(added)?;
    let vocab = tok.get_vocab(true);
    let user = typed(TOKEN_TYPE_USER_DEFINED)
        .filter(|s| vocab.contains_key(s.as_str()))
        .map(|s| AddedToken::from(s.as_str(), false).normalized(false));
    tok.add_tokens(user.collect::<Vec<_>>()).map_err(added)?;
    let named = [&special.bos, &special.eos, &special.unk, &special.pad];
    let named = (named.into_iter().flatten())
        .map(|t| AddedToken::from(t.text.as_str(), true).normalized(false));
    tok.add_special_tokens(named.collect::<Vec<_>>())
        .map_err(added)?;
    Ok(())
}

/// The template transformers sets: BOS before and EOS after the text where the file asks.
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

/// Whether GPT-2's byte-level table prints a byte as itself (the other 68 bytes map to
/// U+0100..U+0143, in byte order).
fn printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Whether `c` is one of the 256 characters GPT-2's byte-level table spells bytes with.
fn in_byte_alphabet(c: char) -> bool {
    u8::try_from(c).map_or(('\u{100}'..='\u{143}').contains(&c), printable)
}

/// The character GPT-2's byte-level table spells byte `b` with.
fn byte_char(b: u8) -> char {
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// A token as the byte-level vocabulary spells it: unchanged when it already uses only the byte
/// alphabet, otherwise its UTF-8 bytes spelled in that alphabet.
fn respell(token: &str) -> String {
    if token.chars().all(in_byte_alphabet) {
        token.to_owned()
    } else {
        token.bytes().map(byte_char).collect()
    }
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
    fn merges(&self) -> Result<Merges> {
        let key = "tokenizer.ggml.merges";
        let merges = self.strings(key)?;
        let pair = |(i, m): (usize, &String)| {
            let (a, b) = m
                .split_once(' ')
                .filter(|(_, b)| !b.contains(' '))
                .ok_or_else(|| {
                    self.err(
                        key,
                        format!("merge {i} is {m:?}, expected two tokens separated by one space"),
                    )
                })?;
            Ok((a.to_owned(), b.to_owned()))
        };
        merges.iter().enumerate().map(pair).collect()
    }
    fn flag(&self, key: &str) -> Result<bool> {
        match self.map.get(key) {
            None => Ok(false),
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
        Ok(GgufSpecialTokens {
            bos: token("bos")?,
            eos: token("eos")?,
            unk: token("unknown")?,
            pad: token("padding")?,
            add_bos: self.flag("tokenizer.ggml.add_bos_token")?,
            add_eos: self.flag("tokenizer.ggml.add_eos_token")?,
        })
    }
}
