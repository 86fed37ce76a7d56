//! Structured outputs: a grammar (JSON Schema, any JSON object, a regex, a list of choices or a
//! Lark grammar) compiled by llguidance into a matcher that gives, before each token is chosen,
//! the mask of the tokens that keep the output inside the grammar.
//!
//! [`Grammars`] is built once per tokenizer: llguidance's token trie over the bytes of every
//! token of the artifact's `tokenizer.json` (special tokens marked, so plain text never matches
//! them), padded to the width of the model's logits. [`Grammars::compile`] turns a
//! [`GrammarSpec`] into a [`Constraint`], or an error naming what is wrong with it: a request's
//! grammar is compiled before it is admitted.

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format` `json_object`).
    JsonObject,
    /// A JSON Schema (`response_format` `json_schema`, `structured_outputs.json`).
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// One of these strings, exactly.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect), from its `start` rule.
    Lark(String),
}

impl GrammarSpec {
    /// The kind, as `maxserve_structured_output_grammar_rejections_total{kind}` names it.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_) => "json_schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// The grammar in llguidance's terms. JSON is generated compact (no free whitespace
    /// between tokens) unless the schema's own `x-guidance` options say otherwise.
    fn grammar(&self) -> TopLevelGrammar {
        let compact = |mut schema: Value| {
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance")
                    .or_insert_with(|| json!({"whitespace_flexible": false}));
            }
            schema
        };
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(s) => {
                let mut s = s.clone();
                close_objects(&mut s);
                TopLevelGrammar::from_json_schema(compact(s))
            }
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Choice(c) => {
                // Lark string literals are JSON strings.
                let alts: Vec<String> = c
                    .iter()
                    .map(|s| serde_json::to_string(s).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// Closes every object schema that lists its `properties` but says nothing of others
/// (`additionalProperties`, `patternProperties`, `unevaluatedProperties`): as OpenAI's strict
/// mode and xgrammar (vLLM's default) read such schemas, the object holds its listed
/// properties only. A free-form object (no `properties`) stays open.
pub(crate) fn close_objects(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let open_said = [
                "additionalProperties",
                "patternProperties",
                "unevaluatedProperties",
            ]
            .iter()
            .any(|k| o.contains_key(*k));
            if o.get("properties").is_some_and(Value::is_object) && !open_said {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (k, x) in o.iter_mut() {
                match k.as_str() {
                    // Maps of names to schemas: each schema, not the map.
                    "properties" | "$defs" | "definitions" | "patternProperties"
                    | "dependentSchemas" => {
                        if let Value::Object(m) = x {
                            m.values_mut().for_each(close_objects);
                        }
                    }
                    // Values, not schemas.
                    "enum" | "const" | "examples" | "default" => {}
                    _ => close_objects(x),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// The token environment llguidance sees: the trie of every token's bytes, and the artifact's
/// tokenizer for the text a grammar forces.
struct Env {
    trie: TokTrie,
    tokenizer: &'static crate::tokenizer::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// Grammar compilation for one tokenizer and one width of logits.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    eos: Vec<TokenId>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars {{ vocab: {} }}", self.vocab)
    }
}

impl Grammars {
    /// Grammars over `tokenizer` (whose `tokenizer.json` text is `json`), for logits of
    /// `vocab` columns, ending at any of `eos` (the first is the one a finished grammar
    /// allows). The error says why the tokenizer's token bytes cannot be read.
    pub fn new(
        json: &str,
        tokenizer: &'static crate::tokenizer::Tokenizer,
        vocab: usize,
        eos: &[i64],
    ) -> Result<Self, String> {
        let value: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| format!("cannot read the token bytes of tokenizer.json: {e}"))?;
        // Ids past the tokenizer's (padding of the embedding) are never allowed.
        words.resize(vocab.max(words.len()), Vec::new());
        words.truncate(vocab);
        let eos: Vec<TokenId> = eos
            .iter()
            .filter_map(|&t| u32::try_from(t).ok())
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let Some(&first) = eos.first() else {
            return Err("the model has no end-of-sequence token in its vocabulary".into());
        };
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| e.to_string())?;
        factory.set_stderr_log_level(0);
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory,
            vocab,
            eos,
        })
    }

    /// The constraint of `spec`, or why it cannot be compiled (llguidance's message: an
    /// invalid schema, a `$ref` to nowhere, a bad regex or grammar).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        if let GrammarSpec::Choice(c) = spec {
            if c.is_empty() {
                return Err("the list of choices is empty".into());
            }
        }
        let parser = self
            .factory
            .create_parser(spec.grammar())
            .map_err(|e| e.to_string())?;
        Ok(Constraint {
            spec: spec.clone(),
            matcher: Matcher::new(Ok(parser)),
            mask: None,
            eos: self.eos.clone(),
        })
    }
}

/// A request's grammar as its output grows: the mask of the next token, and the tokens
/// chosen so far consumed. A clone runs on its own (`n > 1` choices each have one).
pub struct Constraint {
    spec: GrammarSpec,
    matcher: Matcher,
    /// The mask of the next token, where computed ahead (during the forward pass).
    mask: Option<SimpleVob>,
    /// The end-of-sequence tokens (the first is allowed where the matcher failed).
    eos: Vec<TokenId>,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            spec: self.spec.clone(),
            // Its own parser and lexer caches, not shared with the original's.
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
            eos: self.eos.clone(),
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({:?})", self.spec)
    }
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl Constraint {
    /// What the output must match.
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// Computes the next token's mask now (the scheduler calls it while the forward pass
    /// runs), unless it is computed already.
    pub fn prepare(&mut self) {
        if self.mask.is_none() && !self.matcher.is_stopped() {
            self.mask = self.matcher.compute_mask().ok();
        }
    }

    /// Whether the next token's mask is computed.
    pub fn is_prepared(&self) -> bool {
        self.mask.is_some()
    }

    /// Sets every token the grammar does not allow next to -inf in `logits` (the end of
    /// sequence only once the output is complete). A matcher in error allows nothing but the
    /// end of sequence, so the request ends.
    pub fn apply(&mut self, logits: &mut [f32]) {
        self.prepare();
        match &self.mask {
            Some(mask) => {
                for (t, l) in logits.iter_mut().enumerate() {
                    if !mask.is_allowed(t as TokenId) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            None => {
                let eos = self.eos.first().map_or(usize::MAX, |&e| e as usize);
                for (t, l) in logits.iter_mut().enumerate() {
                    if t != eos {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Takes the chosen `token` (one the mask allowed); the next mask is computed afresh.
    /// An end-of-sequence token is not consumed: it ends the request.
    pub fn consume(&mut self, token: i64) -> Result<(), String> {
        self.mask = None;
        let Ok(t) = u32::try_from(token) else {
            return Err(format!("token {token} is not a token id"));
        };
        if self.eos.contains(&t) || self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(t).map_err(|e| e.to_string())
    }

    /// Whether the output is complete and nothing can follow it: the request ends here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output so far is a whole match (more may still follow it).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_with_listed_properties_are_closed_and_free_ones_stay_open() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "free": {"type": "object"},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
                "e": {"enum": [{"properties": {}}]}
            },
            "$defs": {"d": {"properties": {"x": {}}}}
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], false);
        let p = &s["properties"];
        assert!(p.get("additionalProperties").is_none(), "{p}");
        assert_eq!(p["properties"]["additionalProperties"], false);
        assert!(p["free"].get("additionalProperties").is_none());
        assert_eq!(p["open"]["additionalProperties"], true);
        assert_eq!(p["e"]["enum"], json!([{"properties": {}}]));
        assert_eq!(s["$defs"]["d"]["additionalProperties"], false);
    }
}
