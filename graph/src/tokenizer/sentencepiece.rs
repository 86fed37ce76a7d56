//! SentencePiece BPE (`tokenizer.ggml.model` `llama`: Llama 1/2, Mistral, Gemma, Phi-3), built to
//! encode as llama.cpp's SPM tokenizer and SentencePiece itself do.
//!
//! A GGUF stores such a vocabulary as pieces with scores and no merges. SentencePiece's BPE
//! repeatedly joins the adjacent pair whose joined piece is in the vocabulary with the highest
//! score (the leftmost on ties), and falls back to `<0xXX>` byte pieces for characters outside
//! the vocabulary. That is a BPE whose merges are every split of every normal piece into two
//! pieces, ranked by the joined piece's score: [`merges_from_scores`]. Around it:
//! - the normalizer escapes spaces as `▁` (after a `▁` prefix when
//!   `tokenizer.ggml.add_space_prefix`, llama.cpp's default, is set; Gemma's files clear it);
//! - there is no pre-tokenizer: a piece may span words, as in llama.cpp;
//! - control tokens are added as special tokens and user-defined ones (Gemma's `\n\n`, runs of
//!   spaces, HTML tags) as plain added tokens, matched in the raw text before the BPE, as
//!   llama.cpp matches them;
//! - the decoder turns `▁` back into spaces, byte pieces into bytes, and drops the prefix space;
//! - BOS is added unless `tokenizer.ggml.add_bos_token` is false (llama.cpp's default for SPM).

use super::{add_error, add_named_tokens, post_processor, Meta};
use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED};
use crate::Result;
use std::collections::HashMap;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as Decoders;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as Normalizers};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, Tokenizer};

/// SentencePiece's escaped space.
const SPACE: &str = "\u{2581}";

/// The SentencePiece tokenizer of a `llama` GGUF.
pub(super) fn build(meta: &Meta) -> Result<Tokenizer> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let types = meta.token_types(tokens.len())?;
    let key = "tokenizer.ggml.scores";
    let scores = meta.floats(key)?;
    if scores.len() != tokens.len() {
        return Err(meta.err(
            key,
            format!(
                "has {} entries; expected one per token ({})",
                scores.len(),
                tokens.len()
            ),
        ));
    }
    let special = meta.special_tokens(&tokens)?;
    let space_prefix = meta.flag("tokenizer.ggml.add_space_prefix", true)?;
    let mut vocab = Vocab::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(id as u32);
    }
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges_from_scores(&tokens, &scores, &types))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = &special.unk {
        bpe = bpe.unk_token(unk.text.clone());
    }
    let bpe = bpe.build().map_err(|e| {
        meta.err(
            "tokenizer.ggml.tokens",
            format!("do not make a BPE vocabulary: {e}"),
        )
    })?;
    let mut tok = Tokenizer::new(bpe);
    let bad = |e| meta.err("tokenizer.ggml.tokens", format!("normalizer: {e}"));
    let escape = Replace::new(" ", SPACE).map_err(bad)?;
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if space_prefix {
        normalizers.push(Prepend::new(SPACE.into()).into());
    }
    normalizers.push(escape.into());
    tok.with_normalizer(Some(Normalizers::new(normalizers)))
        .map_err(bad)?;
    let unescape = Replace::new(SPACE, " ").map_err(bad)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        unescape.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(Decoders::new(decoders)));
    tok.with_post_processor(Some(post_processor(meta, &special)?));
    let typed = |ty: u64, special: bool| {
        let pairs = tokens.iter().zip(&types);
        let typed = pairs.filter(move |(_, &t)| t == ty);
        typed
            .map(|(s, _)| AddedToken::from(s.as_str(), special).normalized(false))
            .collect::<Vec<_>>()
    };
    let control = [
        typed(TOKEN_TYPE_CONTROL, true),
        typed(TOKEN_TYPE_UNKNOWN, true),
    ]
    .concat();
    tok.add_special_tokens(control)
        .map_err(|e| add_error(meta, e))?;
    tok.add_tokens(typed(TOKEN_TYPE_USER_DEFINED, false))
        .map_err(|e| add_error(meta, e))?;
    add_named_tokens(&mut tok, meta, &special)?;
    Ok(tok)
}

/// The merges of a SentencePiece BPE vocabulary: every split of a normal piece into two normal
/// pieces, ranked by the joined piece's score (highest first), then by its id and by the
/// split's position, so that equal scores keep a fixed order.
pub fn merges_from_scores(tokens: &[String], scores: &[f64], types: &[u64]) -> Merges {
    let normal: HashMap<&str, usize> = (tokens.iter().enumerate())
        .filter(|(id, _)| types.get(*id) == Some(&TOKEN_TYPE_NORMAL))
        .map(|(id, t)| (t.as_str(), id))
        .collect();
    let mut ranked: Vec<(f64, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if types.get(id) != Some(&TOKEN_TYPE_NORMAL) {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            if normal.contains_key(&t[..at]) && normal.contains_key(&t[at..]) {
                ranked.push((scores[id], id, at));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    (ranked.into_iter())
        .map(|(_, id, at)| (tokens[id][..at].to_owned(), tokens[id][at..].to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_rank_by_the_joined_piece_score() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .map(String::from)
            .to_vec();
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = merges_from_scores(&tokens, &scores, &[TOKEN_TYPE_NORMAL; 6]);
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            merges,
            [
                pair("b", "c"),
                pair("a", "b"),
                pair("a", "bc"),
                pair("ab", "c")
            ]
        );
        // A control piece is never a merge's result.
        let types = [1, 1, 1, 1, 1, TOKEN_TYPE_CONTROL];
        assert_eq!(merges_from_scores(&tokens, &scores, &types).len(), 2);
    }
}
