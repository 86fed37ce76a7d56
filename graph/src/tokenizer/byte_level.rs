//! Byte-level BPE (`tokenizer.ggml.model` `gpt2`) as transformers' GGUF loader builds it: the
//! byte-level BPE of `GPT2Tokenizer`, control tokens added as special tokens, user-defined tokens
//! as plain added tokens, a split regex for the `tokenizer.ggml.pre` values transformers knows.

use super::{add_error, add_named_tokens, post_processor, Meta};
use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};
use crate::weights::gguf::GgufValue;
use crate::Result;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

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

/// The byte-level BPE tokenizer of a `gpt2` GGUF, as transformers' GGUF loader builds it.
pub(super) fn build(meta: &Meta) -> Result<Tokenizer> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let token_types = meta.token_types(tokens.len())?;
    let special = meta.special_tokens(&tokens)?;
    let vocab: Vocab = (tokens.iter().enumerate())
        .map(|(id, t)| (respell(t), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges(meta)?)
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
    tok.with_pre_tokenizer(Some(pre_tokenizer(meta)?));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(post_processor(meta, &special)?));
    add_tokens(&mut tok, meta, &tokens, &token_types)?;
    add_named_tokens(&mut tok, meta, &special)?;
    Ok(tok)
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

/// Adds, in transformers' order, control tokens as special tokens and user-defined tokens as
/// plain added tokens (the BOS/EOS/UNK/PAD tokens follow: [`add_named_tokens`]).
fn add_tokens(
    tok: &mut Tokenizer,
    meta: &Meta,
    tokens: &[String],
    token_types: &[u64],
) -> Result<()> {
    let typed = |ty: u64| {
        let pairs = tokens.iter().zip(token_types);
        pairs.filter(move |(_, &t)| t == ty).map(|(s, _)| s)
    };
    // A control token outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
    let control = typed(TOKEN_TYPE_CONTROL)
        .filter(|s| s.chars().all(in_byte_alphabet))
        .map(|s| AddedToken::from(s.as_str(), true).normalized(false));
    let added = |e| add_error(meta, e);
    tok.add_special_tokens(control.collect::<Vec<_>>())
        .map_err(added)?;
    let vocab = tok.get_vocab(true);
    let user = typed(TOKEN_TYPE_USER_DEFINED)
        .filter(|s| vocab.contains_key(s.as_str()))
        .map(|s| AddedToken::from(s.as_str(), false).normalized(false));
    tok.add_tokens(user.collect::<Vec<_>>()).map_err(added)?;
    Ok(())
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

/// `tokenizer.ggml.merges` as pairs; a merge that is not two tokens is an error naming it.
fn merges(meta: &Meta) -> Result<Merges> {
    let key = "tokenizer.ggml.merges";
    let merges = meta.strings(key)?;
    let pair = |(i, m): (usize, &String)| {
        let (a, b) = m
            .split_once(' ')
            .filter(|(_, b)| !b.contains(' '))
            .ok_or_else(|| {
                meta.err(
                    key,
                    format!("merge {i} is {m:?}, expected two tokens separated by one space"),
                )
            })?;
        Ok((a.to_owned(), b.to_owned()))
    };
    merges.iter().enumerate().map(pair).collect()
}
