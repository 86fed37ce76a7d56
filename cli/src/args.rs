//! Arguments shared by several commands: token lists.

use anyhow::{bail, Context, Result};

/// Parses `1,17,42` into token ids.
pub fn parse_tokens(s: &str) -> Result<Vec<i64>> {
    let tokens = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<i64>()
                .with_context(|| format!("--tokens: `{t}` is not an integer token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if tokens.is_empty() {
        bail!("--tokens: expected at least one token id, e.g. --tokens 1,17,42");
    }
    Ok(tokens)
}
