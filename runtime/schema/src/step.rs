//! One step's inputs: a ragged batch of token rows with its paged-cache bookkeeping, and the one
//! check every executor (and the reference interpreter) runs before touching memory.

use crate::kernel::StepDim;

/// A ragged batch: prefill chunks and decode rows of several sequences together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepInputs {
    /// Every sequence's token rows, concatenated.
    pub tokens: Vec<i64>,
    /// Where each sequence's rows start, plus the end: `B + 1` offsets from 0.
    pub input_row_offsets: Vec<i32>,
    /// Tokens already cached, per sequence.
    pub cache_lengths: Vec<i32>,
    /// `[kv_groups, B, pages_per_seq]` cache page ids: one `[B, pages_per_seq]` table per KV
    /// page group, group `g`'s bound to the step input `kv_lookup_input(g)`. Column `j` of a
    /// sequence's row is the page of its positions `j · page_size ..`; unused columns, and the
    /// pages a sliding group has freed before its window, are 0.
    pub kv_lookup_table: Vec<i32>,
    /// Columns of each lookup table.
    pub pages_per_seq: usize,
    /// KV page groups: the lookup tables in `kv_lookup_table` (at least 1).
    pub kv_groups: usize,
    /// The token rows whose logits the step returns, in output order (the `logit_rows` dim):
    /// each in `-1..total_seq_len`, `-1` giving a row of zeros. A step returns what it needs:
    /// each sequence's last row (its next token), the rows before it that verify draft tokens,
    /// or every row of a prompt being scored ([`StepInputs::last_rows`] builds the common case).
    pub logit_indices: Vec<i32>,
}

/// What a step may hold: the bounds of the program that runs it and its cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// The largest value of each step dim, in [`StepDim`] slot order; the `total_num_pages`
    /// slot is the number of pages in the KV cache.
    pub bounds: [u64; StepDim::COUNT],
    /// Token ids lie in `0..vocab_size`.
    pub vocab_size: u64,
    /// Tokens per KV page.
    pub page_size: u64,
    /// Longest context (cached plus new tokens) of a sequence: positions lie below it.
    pub max_seq_len: u64,
    /// Each KV page group's sliding window (`None`: full attention), in lookup-table order:
    /// a sequence's row of a group must name a page in the cache for every position its rows
    /// read.
    pub kv_windows: Vec<Option<u64>>,
}

impl StepInputs {
    /// Sets [`StepInputs::logit_indices`] to the last `n` rows of each sequence in order
    /// (`batch_size × n` rows; `-1`, a row of zeros, in front where a sequence has fewer).
    pub fn last_rows(&mut self, n: usize) {
        let offs = &self.input_row_offsets;
        self.logit_indices = offs
            .windows(2)
            .flat_map(|w| {
                let (start, end) = (w[0], w[1]);
                (0..n as i32).map(move |j| {
                    let row = end - n as i32 + j;
                    if row >= start {
                        row
                    } else {
                        -1
                    }
                })
            })
            .collect();
    }

    /// Group `g`'s `[B, pages_per_seq]` lookup table (empty past the last group).
    pub fn lookup_table(&self, g: usize) -> &[i32] {
        let n = self.batch_size() * self.pages_per_seq;
        self.kv_lookup_table.get(g * n..(g + 1) * n).unwrap_or(&[])
    }
}

impl StepInputs {
    /// The inputs as bytes, for the ranks that run the step beside the one that scheduled it
    /// ([`StepInputs::from_bytes`] reads them back): little-endian counts and values.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let mut put = |v: u64| b.extend_from_slice(&v.to_le_bytes());
        put(self.pages_per_seq as u64);
        put(self.kv_groups as u64);
        put(self.tokens.len() as u64);
        for &t in &self.tokens {
            put(t as u64);
        }
        for list in [
            &self.input_row_offsets,
            &self.cache_lengths,
            &self.kv_lookup_table,
            &self.logit_indices,
        ] {
            b.extend_from_slice(&(list.len() as u64).to_le_bytes());
            for &v in list {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// Reads [`StepInputs::to_bytes`]; bytes of another shape are an error (the inputs are
    /// then checked as any step's are).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StepError> {
        let bad = || StepError("step inputs: truncated or malformed bytes".into());
        let mut rest = bytes;
        let mut take = |n: usize| -> Result<&[u8], StepError> {
            if n > rest.len() {
                return Err(bad());
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let pages_per_seq = word(take(8)?) as usize;
        let kv_groups = word(take(8)?) as usize;
        let n = word(take(8)?) as usize;
        let raw = take(n.checked_mul(8).ok_or_else(bad)?)?;
        let tokens = raw.chunks_exact(8).map(|c| word(c) as i64).collect();
        let mut lists: Vec<Vec<i32>> = Vec::with_capacity(4);
        for _ in 0..4 {
            let n = word(take(8)?) as usize;
            let raw = take(n.checked_mul(4).ok_or_else(bad)?)?;
            lists.push(
                raw.chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            );
        }
        if !rest.is_empty() {
            return Err(bad());
        }
        let [input_row_offsets, cache_lengths, kv_lookup_table, logit_indices]: [Vec<i32>; 4] =
            lists.try_into().map_err(|_| bad())?;
        Ok(StepInputs {
            tokens,
            input_row_offsets,
            cache_lengths,
            kv_lookup_table,
            pages_per_seq,
            kv_groups,
            logit_indices,
        })
    }
}

/// A step whose inputs do not fit the program or contradict themselves.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StepError(pub String);

impl StepInputs {
    /// Sequences in the step.
    pub fn batch_size(&self) -> usize {
        self.cache_lengths.len()
    }

    /// Each sequence's context after the step: cached plus new tokens (after
    /// [`StepInputs::checked_dims`] succeeded).
    pub fn context_lengths(&self) -> Vec<i32> {
        (0..self.batch_size())
            .map(|i| {
                self.cache_lengths[i] + self.input_row_offsets[i + 1] - self.input_row_offsets[i]
            })
            .collect()
    }

    /// The step's sizes in [`StepDim`] slot order, after checking them against `limits` and the
    /// inputs against themselves: offsets from 0, non-decreasing, ending at the token count;
    /// a lookup table of `B × pages_per_seq`; token ids in the vocabulary; every context within
    /// `max_seq_len` and its pages; every page id it uses inside the cache. Executors compute
    /// addresses from these values only after this check.
    pub fn checked_dims(&self, limits: &StepLimits) -> Result<[u64; StepDim::COUNT], StepError> {
        let b = self.batch_size() as u64;
        let bounds = &limits.bounds;
        if self.logit_indices.is_empty() {
            return Err(StepError(
                "logit_indices is empty; a step returns at least one logit row".into(),
            ));
        }
        let dims = [
            self.tokens.len() as u64,
            b,
            self.pages_per_seq as u64,
            bounds[StepDim::TotalNumPages as usize],
            b + 1,
            self.logit_indices.len() as u64,
        ];
        for d in [
            StepDim::TotalSeqLen,
            StepDim::BatchSize,
            StepDim::MaxNumPages,
            StepDim::InputRowOffsetsLen,
            StepDim::LogitRows,
        ] {
            if dims[d as usize] > bounds[d as usize] {
                return Err(StepError(format!(
                    "{} is {}, above the artifact's bound {}",
                    d.name(),
                    dims[d as usize],
                    bounds[d as usize]
                )));
            }
        }
        self.check(limits)?;
        Ok(dims)
    }

    fn check(&self, limits: &StepLimits) -> Result<(), StepError> {
        let b = self.batch_size();
        let bad = |m: String| Err(StepError(m));
        let offs = &self.input_row_offsets;
        if offs.len() != b + 1 || offs[0] != 0 || offs.windows(2).any(|w| w[0] > w[1]) {
            return bad(format!(
                "input_row_offsets {offs:?} must be B + 1 = {} non-decreasing offsets from 0",
                b + 1
            ));
        }
        if offs[b] as usize != self.tokens.len() {
            return bad(format!(
                "input_row_offsets ends at {}, but there are {} tokens",
                offs[b],
                self.tokens.len()
            ));
        }
        let groups = limits.kv_windows.len().max(1);
        if self.kv_groups != groups {
            return bad(format!(
                "kv_groups is {}, the program's KV cache has {groups} page groups",
                self.kv_groups
            ));
        }
        if Some(self.kv_lookup_table.len())
            != b.checked_mul(self.pages_per_seq)
                .and_then(|n| n.checked_mul(groups))
        {
            return bad(format!(
                "kv_lookup_table has {} entries, expected {groups} × {b} × {}",
                self.kv_lookup_table.len(),
                self.pages_per_seq
            ));
        }
        let rows = self.tokens.len() as i64;
        if let Some(i) = self
            .logit_indices
            .iter()
            .find(|&&i| i < -1 || i64::from(i) >= rows)
        {
            return bad(format!(
                "logit index {i} is outside the step's rows (-1 for zeros, or 0..{rows})"
            ));
        }
        let vocab = limits.vocab_size;
        if let Some(t) = self.tokens.iter().find(|&&t| t < 0 || t as u64 >= vocab) {
            return bad(format!(
                "token id {t} is outside the vocabulary (0..{vocab})"
            ));
        }
        let page_size = limits.page_size.max(1);
        let pages = limits.bounds[StepDim::TotalNumPages as usize];
        for i in 0..b {
            if self.cache_lengths[i] < 0 {
                return bad(format!(
                    "sequence {i} has a negative cache length {}",
                    self.cache_lengths[i]
                ));
            }
            let end = self.cache_lengths[i] as u64 + (offs[i + 1] - offs[i]) as u64;
            if end > self.pages_per_seq as u64 * page_size {
                return bad(format!(
                    "sequence {i} reaches {end} tokens, beyond its {} pages of {page_size}",
                    self.pages_per_seq
                ));
            }
            if end > limits.max_seq_len {
                return bad(format!(
                    "sequence {i} reaches {end} tokens, beyond max_seq_len {}",
                    limits.max_seq_len
                ));
            }
            let used = end.div_ceil(page_size) as usize;
            // A sliding group's rows read from the page of the step's first row's window on.
            for g in 0..groups {
                let first = match limits.kv_windows.get(g).copied().flatten() {
                    Some(w) => {
                        ((self.cache_lengths[i] as u64 + 1).saturating_sub(w) / page_size) as usize
                    }
                    None => 0,
                };
                let row = &self.lookup_table(g)[i * self.pages_per_seq..][..used];
                if let Some(p) = row[first.min(used)..]
                    .iter()
                    .find(|&&p| p < 0 || p as u64 >= pages)
                {
                    return bad(format!(
                        "sequence {i} uses page {p}, but the cache has {pages} pages"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> StepLimits {
        StepLimits {
            bounds: [8, 2, 2, 4, 3, 4],
            vocab_size: 10,
            page_size: 4,
            max_seq_len: 7,
            kv_windows: vec![None],
        }
    }

    fn good() -> StepInputs {
        StepInputs {
            tokens: vec![1, 2, 3],
            input_row_offsets: vec![0, 2, 3],
            cache_lengths: vec![0, 4],
            kv_lookup_table: vec![0, 0, 1, 2],
            pages_per_seq: 2,
            kv_groups: 1,
            logit_indices: vec![1, 2],
        }
    }

    #[test]
    fn inputs_cross_to_other_ranks_as_bytes_and_bad_bytes_are_refused() {
        let s = good();
        let b = s.to_bytes();
        assert_eq!(StepInputs::from_bytes(&b), Ok(s));
        for cut in [0, 7, 24, b.len() - 1] {
            assert!(StepInputs::from_bytes(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(StepInputs::from_bytes(&long).is_err());
        // A count far past the bytes is refused, not allocated.
        let mut huge = b;
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(StepInputs::from_bytes(&huge).is_err());
    }

    #[test]
    fn a_good_step_gives_its_dims() {
        assert_eq!(good().checked_dims(&limits()), Ok([3, 2, 2, 4, 3, 2]));
        let mut two = good();
        two.last_rows(2);
        assert_eq!(two.logit_indices, vec![0, 1, -1, 2]);
        assert_eq!(two.checked_dims(&limits()), Ok([3, 2, 2, 4, 3, 4]));
        assert_eq!(good().context_lengths(), vec![2, 5]);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(StepInputs, &str)> = vec![
            (
                StepInputs {
                    tokens: vec![1, 10, 3],
                    ..good()
                },
                "token id 10",
            ),
            (
                StepInputs {
                    input_row_offsets: vec![0, 2, 2],
                    ..good()
                },
                "ends at 2",
            ),
            (
                StepInputs {
                    input_row_offsets: vec![0, 3, 2],
                    ..good()
                },
                "non-decreasing",
            ),
            (
                StepInputs {
                    input_row_offsets: vec![1, 2, 3],
                    ..good()
                },
                "from 0",
            ),
            (
                StepInputs {
                    kv_lookup_table: vec![0, 0, 1],
                    ..good()
                },
                "kv_lookup_table has 3",
            ),
            (
                StepInputs {
                    kv_lookup_table: vec![0, 0, 1, 4],
                    ..good()
                },
                "page 4",
            ),
            (
                StepInputs {
                    kv_lookup_table: vec![-1, 0, 1, 2],
                    ..good()
                },
                "page -1",
            ),
            (
                StepInputs {
                    cache_lengths: vec![0, -1],
                    ..good()
                },
                "negative cache length",
            ),
            (
                StepInputs {
                    cache_lengths: vec![0, 7],
                    ..good()
                },
                "beyond max_seq_len 7",
            ),
            (
                StepInputs {
                    cache_lengths: vec![0, 8],
                    ..good()
                },
                "beyond its 2 pages",
            ),
            (
                StepInputs {
                    pages_per_seq: 3,
                    kv_lookup_table: vec![0; 6],
                    ..good()
                },
                "max_num_pages is 3",
            ),
            (
                StepInputs {
                    logit_indices: vec![0, 1, 2, 2, 1],
                    ..good()
                },
                "logit_rows is 5",
            ),
            (
                StepInputs {
                    logit_indices: vec![],
                    ..good()
                },
                "logit_indices is empty",
            ),
            (
                StepInputs {
                    logit_indices: vec![3],
                    ..good()
                },
                "logit index 3",
            ),
            (
                StepInputs {
                    logit_indices: vec![-2],
                    ..good()
                },
                "logit index -2",
            ),
        ];
        for (inputs, want) in cases {
            let e = inputs.checked_dims(&limits()).unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        let many = StepInputs {
            tokens: vec![1; 9],
            input_row_offsets: vec![0, 9],
            cache_lengths: vec![0],
            kv_lookup_table: vec![0, 1],
            pages_per_seq: 2,
            kv_groups: 1,
            logit_indices: vec![8],
        };
        let e = many.checked_dims(&limits()).unwrap_err().to_string();
        assert!(e.contains("total_seq_len is 9"), "{e}");
    }
}
