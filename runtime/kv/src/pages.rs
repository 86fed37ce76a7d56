//! The page table of a paged KV cache: which cache pages each sequence's
//! tokens live in, with reference counts so that full pages can be shared.
//!
//! The cache holds `num_pages` pages of `page_size` token slots each; a page
//! is named by its id, a `u32` in `0..num_pages`. A sequence (a `u64` id)
//! owns an ordered list of pages: token `i` of the sequence lives in slot
//! `i % page_size` of its page `i / page_size`, so a sequence of `len` tokens
//! holds exactly `ceil(len / page_size)` pages, and at most `pages_per_seq`.
//!
//! A step runs in two phases. [`PageTable::prepare`] takes the tokens every
//! sequence of the step appends, allocates the pages they need and returns the
//! [`StepInputs`] for the model; it either succeeds whole or leaves the table
//! untouched. After the model ran, [`PageTable::commit`] advances the
//! sequences' lengths; if the step is abandoned instead,
//! [`PageTable::rollback`] returns the table exactly to its state before
//! `prepare`.
//!
//! Sharing: a page may be held by several sequences (through
//! [`PageTable::attach_prefix`]) and by external holders such as a prefix
//! cache (through [`PageTable::retain`]). Only full pages are ever shared:
//! a page that is some sequence's partly filled last page has exactly one
//! holder, so appending tokens never writes into a page anyone else reads.
//! A page returns to the free list when its last holder lets it go.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

use maxc_schema::StepInputs;

/// Page ids must fit the `i32` entries of [`StepInputs::kv_lookup_table`],
/// so a table has at most `2^31` pages.
const MAX_PAGES: usize = i32::MAX as usize + 1;

/// Source of unique ids for prepared steps, shared by all tables so that a
/// step can only be committed to the table (or a clone of the table) that
/// prepared it.
static NEXT_STEP_ID: AtomicU64 = AtomicU64::new(1);

/// Why a page-table operation was refused. A refused operation leaves the
/// table unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// A step named the same sequence twice.
    #[error("sequence {seq} appears more than once in one step")]
    DuplicateSequence {
        /// The repeated sequence.
        seq: u64,
    },
    /// A sequence would grow past the longest sequence the table can hold.
    #[error(
        "sequence {seq} would reach {len} tokens, beyond max_seq_len {max_seq_len} \
         ({pages_per_seq} pages of {page_size})"
    )]
    TooLong {
        /// The sequence.
        seq: u64,
        /// The length it would reach.
        len: usize,
        /// The longest sequence the table holds ([`PageTable::max_seq_len`]).
        max_seq_len: usize,
        /// Pages a sequence may hold.
        pages_per_seq: usize,
        /// Token slots per page.
        page_size: usize,
    },
    /// The step needs more pages than are free. The step can be retried once
    /// enough pages were freed (by releasing or truncating sequences).
    #[error(
        "the KV cache needs {needed} more {}, {free} {} free",
        page_word(*.needed),
        is_are(*.free)
    )]
    OutOfPages {
        /// Pages the whole step needs.
        needed: usize,
        /// Pages free now.
        free: usize,
    },
    /// The step has more token rows than the `i32` offsets of
    /// [`StepInputs`] can address.
    #[error("the step has {rows} token rows, beyond the i32 offsets of StepInputs")]
    TooManyRows {
        /// Token rows of the whole step.
        rows: usize,
    },
    /// The sequence is not in the table.
    #[error("sequence {seq} is not in the page table")]
    UnknownSequence {
        /// The sequence.
        seq: u64,
    },
    /// The sequence is already in the table.
    #[error("sequence {seq} is already in the page table")]
    SequenceExists {
        /// The sequence.
        seq: u64,
    },
    /// A truncation asked to keep more tokens than the sequence has.
    #[error("cannot truncate sequence {seq} to {len} tokens: it has only {current}")]
    TruncateBeyond {
        /// The sequence.
        seq: u64,
        /// The length asked for.
        len: usize,
        /// Its committed length.
        current: usize,
    },
    /// A truncation would leave a shared page partly filled, so that the
    /// sequence's next tokens would overwrite what another holder reads.
    #[error(
        "cannot truncate sequence {seq} to {len} tokens: its last page {page} would be \
         partly filled but is shared (ref count {ref_count})"
    )]
    SharedPartialPage {
        /// The sequence.
        seq: u64,
        /// The length asked for.
        len: usize,
        /// The page that would be left partly filled.
        page: u32,
        /// The page's reference count.
        ref_count: u32,
    },
    /// A page id is not below the number of pages.
    #[error("page {page} is out of range: the KV cache has {total} pages")]
    PageOutOfRange {
        /// The page.
        page: u32,
        /// Pages in the table.
        total: usize,
    },
    /// A page is free, so there is nothing in it to share or hold.
    #[error("page {page} is free, so it cannot be shared or held")]
    PageNotInUse {
        /// The page.
        page: u32,
    },
    /// A prefix listed a page twice.
    #[error("page {page} appears twice in the prefix given for sequence {seq}")]
    DuplicatePage {
        /// The sequence being attached.
        seq: u64,
        /// The repeated page.
        page: u32,
    },
    /// A page is a sequence's partly filled last page (or a page prepared
    /// for tokens not yet committed), whose contents are still being written.
    #[error(
        "page {page} is the partly filled last page of sequence {holder}, \
         so it cannot be shared or held"
    )]
    PartialPage {
        /// The page.
        page: u32,
        /// The sequence still writing into it.
        holder: u64,
    },
    /// A page has no external hold to drop: all its references belong to
    /// sequences, which let go through [`PageTable::truncate`] or
    /// [`PageTable::release`].
    #[error(
        "page {page} has no external hold to release \
         (its {ref_count} references belong to sequences)"
    )]
    NoExternalHold {
        /// The page.
        page: u32,
        /// The page's reference count.
        ref_count: u32,
    },
    /// A page's reference count would overflow `u32`.
    #[error("page {page} already has the most references a page can have")]
    RefCountOverflow {
        /// The page.
        page: u32,
    },
    /// The prepared step no longer matches the table: the table was changed
    /// after `prepare` (by another `prepare`, `commit`, `rollback`,
    /// `truncate`, `release`, `attach_prefix`, `retain` or `release_page`),
    /// or the step came from another table.
    #[error(
        "the prepared step is stale: the page table changed after it was prepared, \
         or it came from another table"
    )]
    StaleStep,
    /// A sliding group already freed a page that a row at the sequence's next position
    /// would read.
    #[error(
        "sequence {seq} at {len} tokens would read a page that page group {group}'s sliding \
         window already freed"
    )]
    WindowFreed {
        /// The sequence.
        seq: u64,
        /// The length asked for.
        len: usize,
        /// The page group.
        group: usize,
    },
    /// Pages were given for another number of page groups than the table has, or the
    /// groups' lists differ in length.
    #[error(
        "pages given for {given} page groups of unequal or wrong length; the table has {groups}"
    )]
    GroupCount {
        /// Lists given.
        given: usize,
        /// Page groups in the table.
        groups: usize,
    },
}

fn page_word(n: usize) -> &'static str {
    if n == 1 {
        "page"
    } else {
        "pages"
    }
}

fn is_are(n: usize) -> &'static str {
    if n == 1 {
        "is"
    } else {
        "are"
    }
}

/// Pages needed for `len` tokens: `ceil(len / page_size)`. With a page size
/// of 0 no token fits, so no length above 0 ever reaches this.
fn pages_for(len: usize, page_size: usize) -> usize {
    if page_size == 0 {
        0
    } else {
        len.div_ceil(page_size)
    }
}

/// The entry of a sliding group's page that its window has left and that was freed: such a
/// page is never read again, and the lookup table shows it as page 0.
pub const FREED: u32 = u32::MAX;

/// One sequence's committed length and pages.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sequence {
    /// Committed tokens.
    len: usize,
    /// Its pages in each group, in token order. Normally `ceil(len / page_size)` of them;
    /// more while a prepared step that appends to it is open. A sliding group's pages before
    /// its window may be [`FREED`].
    pages: Vec<Vec<u32>>,
}

/// The inputs of one prepared step, and what [`PageTable::commit`] or
/// [`PageTable::rollback`] need to finish it. Exactly one of the two must
/// follow, before any other change to the table.
#[must_use = "a prepared step must be committed or rolled back"]
#[derive(Debug)]
pub struct PreparedStep {
    /// The model inputs of the step.
    pub inputs: StepInputs,
    /// Matches the table's open step while the step is still valid.
    id: u64,
    /// Each sequence of the step, with the number of tokens it appends.
    chunks: Vec<(u64, usize)>,
    /// The pages `prepare` took, in allocation order, with their sequence and group.
    allocated: Vec<(u64, usize, u32)>,
    /// Sequences `prepare` created.
    created: Vec<u64>,
}

/// The page table of a paged KV cache: each sequence's pages in each page group, every page's
/// reference count, and the free list.
///
/// Page groups: every group (a set of layers attending alike, see `maxc_schema::KvLayout`)
/// keeps its own list of pages per sequence, drawn from the one pool. A full-attention group
/// holds a page for every `page_size` positions; a sliding group with window `w` gives back,
/// through [`PageTable::slide`], the pages before the one holding position `len + 1 - w`,
/// which no later row reads.
///
/// Allocation is deterministic: a new table hands out the lowest free page
/// first, and after that the most recently freed page first.
///
/// Two tables compare equal when they have the same shape, the same
/// sequences with the same lengths and pages, the same reference counts and
/// external holds, and the same free list in the same order. Which prepared
/// step is open does not take part in the comparison.
#[derive(Clone, Debug)]
pub struct PageTable {
    page_size: usize,
    pages_per_seq: usize,
    max_seq_len: usize,
    /// Each group's sliding window (`None`: full attention); at least one group.
    windows: Vec<Option<usize>>,
    /// Free pages; the next one handed out is at the end.
    free: Vec<u32>,
    /// References to each page: sequences holding it plus external holds.
    ref_counts: Vec<u32>,
    /// External holds on each page (from [`PageTable::retain`]).
    external: Vec<u32>,
    seqs: BTreeMap<u64, Sequence>,
    /// The id of the prepared step that may still be committed or rolled back.
    open_step: Option<u64>,
}

impl PartialEq for PageTable {
    fn eq(&self, other: &Self) -> bool {
        self.page_size == other.page_size
            && self.pages_per_seq == other.pages_per_seq
            && self.windows == other.windows
            && self.free == other.free
            && self.ref_counts == other.ref_counts
            && self.external == other.external
            && self.seqs == other.seqs
    }
}

impl Eq for PageTable {}

impl PageTable {
    /// A table of `num_pages` free pages of `page_size` token slots, where a
    /// sequence may hold at most `pages_per_seq` pages, with one full-attention group.
    ///
    /// `num_pages` is capped at `2^31` so that every page id fits the `i32`
    /// entries of [`StepInputs::kv_lookup_table`]. With a `page_size` or
    /// `pages_per_seq` of 0 no token fits, and every non-empty append fails
    /// with [`PageError::TooLong`].
    pub fn new(num_pages: usize, page_size: usize, pages_per_seq: usize) -> Self {
        Self::with_groups(num_pages, page_size, pages_per_seq, vec![None])
    }

    /// [`PageTable::new`] with one page group per entry of `windows`, each that group's
    /// sliding window (`None`: full attention; a window of 0 is read as 1). No entry means one
    /// full-attention group.
    pub fn with_groups(
        num_pages: usize,
        page_size: usize,
        pages_per_seq: usize,
        windows: Vec<Option<usize>>,
    ) -> Self {
        let num_pages = num_pages.min(MAX_PAGES);
        let max_seq_len = pages_per_seq
            .saturating_mul(page_size)
            .min(i32::MAX as usize);
        let mut windows: Vec<Option<usize>> =
            windows.into_iter().map(|w| w.map(|w| w.max(1))).collect();
        if windows.is_empty() {
            windows.push(None);
        }
        PageTable {
            page_size,
            pages_per_seq,
            max_seq_len,
            windows,
            // `num_pages <= 2^31`, so every id fits `u32`.
            free: (0..num_pages as u32).rev().collect(),
            ref_counts: vec![0; num_pages],
            external: vec![0; num_pages],
            seqs: BTreeMap::new(),
            open_step: None,
        }
    }

    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages a sequence may hold in one group (the columns of the lookup table).
    pub fn pages_per_seq(&self) -> usize {
        self.pages_per_seq
    }

    /// The longest sequence the table holds: `pages_per_seq * page_size`,
    /// but at most `i32::MAX` so that lengths fit [`StepInputs`].
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Each page group's sliding window (`None`: full attention).
    pub fn windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    /// Page groups.
    pub fn groups(&self) -> usize {
        self.windows.len()
    }

    /// Pages in the cache, free or not.
    pub fn total_pages(&self) -> usize {
        self.ref_counts.len()
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Committed tokens of `seq`; 0 for a sequence not in the table.
    pub fn len(&self, seq: u64) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// Whether `seq` is in the table.
    pub fn contains(&self, seq: u64) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Whether the table has no sequence (pages may still be held
    /// externally).
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The pages of `seq` in the first group, in token order; empty for a sequence not in the
    /// table. While a prepared step is open this includes the pages it allocated for the
    /// sequence.
    pub fn pages(&self, seq: u64) -> &[u32] {
        self.group_pages(seq, 0)
    }

    /// [`PageTable::pages`] of group `group`: a sliding group's entries before its window may
    /// be [`FREED`]. Empty for a sequence not in the table or a group past the last.
    pub fn group_pages(&self, seq: u64, group: usize) -> &[u32] {
        self.seqs
            .get(&seq)
            .and_then(|s| s.pages.get(group))
            .map_or(&[], Vec::as_slice)
    }

    /// Pages `seq` holds in every group (freed entries not counted).
    pub fn held_pages(&self, seq: u64) -> usize {
        self.seqs.get(&seq).map_or(0, |s| {
            s.pages.iter().flatten().filter(|&&p| p != FREED).count()
        })
    }

    /// The pages of `seq` in the first group wholly covered by its committed tokens: the first
    /// `len / page_size`. These are the pages that may be shared with
    /// [`PageTable::attach_prefix`] and [`PageTable::retain`]. Empty for a
    /// sequence not in the table.
    pub fn full_pages(&self, seq: u64) -> &[u32] {
        match self.seqs.get(&seq) {
            Some(s) if self.page_size > 0 => {
                let full = (s.len / self.page_size).min(s.pages[0].len());
                &s.pages[0][..full]
            }
            _ => &[],
        }
    }

    /// References to `page`: the sequences holding it plus its external
    /// holds; 0 for a free page or an id out of range.
    pub fn ref_count(&self, page: u32) -> u32 {
        self.ref_counts.get(page as usize).copied().unwrap_or(0)
    }

    /// External holds on `page` (from [`PageTable::retain`]); 0 for an id
    /// out of range.
    pub fn external_holds(&self, page: u32) -> u32 {
        self.external.get(page as usize).copied().unwrap_or(0)
    }

    /// The sequences in the table, in ascending id order.
    pub fn sequences(&self) -> impl Iterator<Item = u64> + '_ {
        self.seqs.keys().copied()
    }

    /// The first page of group `group` that a row at position `pos` reads: 0 for a
    /// full-attention group, the page of position `pos + 1 - window` for a sliding one.
    pub fn first_read_page(&self, group: usize, pos: usize) -> usize {
        match (self.windows.get(group).copied().flatten(), self.page_size) {
            (Some(w), ps) if ps > 0 => (pos + 1).saturating_sub(w) / ps,
            _ => 0,
        }
    }

    /// Pages the sequence `seq` needs beyond those it holds to hold `len` tokens, in every
    /// group.
    pub fn pages_needed(&self, seq: u64, len: usize) -> usize {
        let want = pages_for(len, self.page_size);
        (0..self.groups())
            .map(|g| want.saturating_sub(self.group_pages(seq, g).len()))
            .sum()
    }

    /// Builds the model inputs of one step, in which each `(seq, tokens)`
    /// appends `tokens` to `seq` (a prefill chunk or a decode row; empty
    /// slices are allowed, and a sequence not in the table starts empty),
    /// and allocates the pages the new tokens need in every group.
    ///
    /// The inputs list the chunks in the order given: `tokens` concatenated,
    /// `input_row_offsets` from 0, `cache_lengths` the committed lengths, and
    /// per group one `kv_lookup_table` row per chunk holding the sequence's pages
    /// (including the new ones; freed ones as 0), padded with 0 to `pages_per_seq`.
    ///
    /// Lengths do not advance here: follow with [`PageTable::commit`], or with
    /// [`PageTable::rollback`] to undo the step. A new `prepare` makes any
    /// earlier open step stale.
    ///
    /// # Errors
    ///
    /// [`PageError::DuplicateSequence`] if a sequence appears twice,
    /// [`PageError::TooLong`] if a sequence would pass
    /// [`PageTable::max_seq_len`], [`PageError::TooManyRows`] if the step's
    /// rows overflow `i32`, and [`PageError::OutOfPages`] if the whole step
    /// needs more pages than are free. On any error the table is unchanged.
    pub fn prepare(&mut self, chunks: &[(u64, &[i64])]) -> Result<PreparedStep, PageError> {
        // Check everything first, so that the changes below cannot fail.
        let mut seen = BTreeSet::new();
        let mut needed = 0usize;
        let mut rows = 0usize;
        for &(seq, tokens) in chunks {
            if !seen.insert(seq) {
                return Err(PageError::DuplicateSequence { seq });
            }
            let new_len = self.len(seq).saturating_add(tokens.len());
            if new_len > self.max_seq_len {
                return Err(self.too_long(seq, new_len));
            }
            needed = needed.saturating_add(self.pages_needed(seq, new_len));
            rows = rows.saturating_add(tokens.len());
        }
        if rows > i32::MAX as usize {
            return Err(PageError::TooManyRows { rows });
        }
        if needed > self.free.len() {
            return Err(PageError::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }

        let id = NEXT_STEP_ID.fetch_add(1, Ordering::Relaxed);
        let width = self.pages_per_seq;
        let groups = self.groups();
        let mut inputs = StepInputs {
            tokens: Vec::with_capacity(rows),
            input_row_offsets: Vec::with_capacity(chunks.len() + 1),
            cache_lengths: Vec::with_capacity(chunks.len()),
            kv_lookup_table: Vec::new(),
            pages_per_seq: width,
            kv_groups: groups,
            logit_indices: Vec::new(),
        };
        let mut tables: Vec<Vec<i32>> =
            vec![Vec::with_capacity(chunks.len().saturating_mul(width)); groups];
        inputs.input_row_offsets.push(0);
        let mut step_chunks = Vec::with_capacity(chunks.len());
        let mut allocated = Vec::with_capacity(needed);
        let mut created = Vec::new();
        for &(seq, tokens) in chunks {
            if !self.seqs.contains_key(&seq) {
                created.push(seq);
            }
            let entry = self.seqs.entry(seq).or_insert_with(|| Sequence {
                len: 0,
                pages: vec![Vec::new(); groups],
            });
            let want = pages_for(entry.len + tokens.len(), self.page_size);
            for (g, (pages, table)) in entry.pages.iter_mut().zip(&mut tables).enumerate() {
                while pages.len() < want {
                    // Enough pages are free: checked above.
                    let Some(page) = self.free.pop() else { break };
                    if let Some(count) = self.ref_counts.get_mut(page as usize) {
                        *count = 1;
                    }
                    pages.push(page);
                    allocated.push((seq, g, page));
                }
                let row_start = table.len();
                // Page ids are below `2^31`; freed entries read as page 0.
                table.extend(pages.iter().map(|&p| if p == FREED { 0 } else { p as i32 }));
                table.resize(row_start + width, 0);
            }
            inputs.tokens.extend_from_slice(tokens);
            // Rows fit `i32` (checked above), lengths are at most
            // `max_seq_len <= i32::MAX`.
            inputs.input_row_offsets.push(inputs.tokens.len() as i32);
            inputs.cache_lengths.push(entry.len as i32);
            step_chunks.push((seq, tokens.len()));
        }
        inputs.kv_lookup_table = tables.concat();
        // Each sequence's next-token row; the caller asks for more where it needs them.
        inputs.last_rows(1);
        self.open_step = Some(id);
        Ok(PreparedStep {
            inputs,
            id,
            chunks: step_chunks,
            allocated,
            created,
        })
    }

    /// Finishes a prepared step: each of its sequences' committed length
    /// grows by the tokens the step appended to it. Sliding groups keep their pages until
    /// [`PageTable::slide`].
    ///
    /// # Errors
    ///
    /// [`PageError::StaleStep`] if the table changed after `step` was
    /// prepared or `step` came from another table; the table is then
    /// unchanged.
    pub fn commit(&mut self, step: PreparedStep) -> Result<(), PageError> {
        self.close_step(step.id)?;
        for (seq, appended) in step.chunks {
            if let Some(entry) = self.seqs.get_mut(&seq) {
                entry.len += appended;
            }
        }
        Ok(())
    }

    /// Undoes a prepared step: returns the pages it allocated to the free
    /// list and removes the sequences it created. Afterwards the table equals
    /// the table before `prepare`, free-list order included.
    ///
    /// # Errors
    ///
    /// [`PageError::StaleStep`] if the table changed after `step` was
    /// prepared or `step` came from another table; the table is then
    /// unchanged.
    pub fn rollback(&mut self, step: PreparedStep) -> Result<(), PageError> {
        self.close_step(step.id)?;
        for &(seq, g, page) in step.allocated.iter().rev() {
            if let Some(pages) = self.seqs.get_mut(&seq).and_then(|e| e.pages.get_mut(g)) {
                if pages.last() == Some(&page) {
                    pages.pop();
                }
            }
            self.drop_ref(page);
        }
        for seq in step.created {
            self.seqs.remove(&seq);
        }
        Ok(())
    }

    /// The pages of `seq` that [`PageTable::slide`] would free now: in each sliding group,
    /// those before the first page its next row (at position `len`) reads.
    pub fn out_of_window(&self, seq: u64) -> usize {
        let Some(entry) = self.seqs.get(&seq) else {
            return 0;
        };
        (0..self.groups())
            .map(|g| {
                let first = self.first_read_page(g, entry.len);
                entry.pages[g]
                    .iter()
                    .take(first)
                    .filter(|&&p| p != FREED)
                    .count()
            })
            .sum()
    }

    /// Drops `seq`'s references to the pages its sliding groups' windows have left: those
    /// before the first page its next row (at position `len`) reads. Their entries become
    /// [`FREED`]; a page whose last reference goes returns to the free list. Returns the pages
    /// let go. Call it once a step's lengths are final (after any truncation), so that no row
    /// reads a freed page. Makes any open prepared step stale where it frees a page.
    pub fn slide(&mut self, seq: u64) -> usize {
        let Some(len) = self.seqs.get(&seq).map(|e| e.len) else {
            return 0;
        };
        let mut dropped = Vec::new();
        for g in 0..self.groups() {
            let first = self.first_read_page(g, len);
            if let Some(pages) = self.seqs.get_mut(&seq).map(|e| &mut e.pages[g]) {
                for p in pages.iter_mut().take(first) {
                    if *p != FREED {
                        dropped.push(*p);
                        *p = FREED;
                    }
                }
            }
        }
        for &page in &dropped {
            self.drop_ref(page);
        }
        if !dropped.is_empty() {
            self.open_step = None;
        }
        dropped.len()
    }

    /// Keeps the first `len` committed tokens of `seq` and drops its
    /// references to the pages past `ceil(len / page_size)` in every group; a page whose
    /// last reference goes returns to the free list. Makes any open prepared
    /// step stale.
    ///
    /// # Errors
    ///
    /// [`PageError::UnknownSequence`] if `seq` is not in the table,
    /// [`PageError::TruncateBeyond`] if `len` exceeds its committed length,
    /// [`PageError::SharedPartialPage`] if the page that would become the
    /// sequence's partly filled last page is shared (its next tokens would
    /// overwrite what the other holders read), and [`PageError::WindowFreed`] if a sliding
    /// group already freed a page the next row would read. On any error the table is
    /// unchanged.
    pub fn truncate(&mut self, seq: u64, len: usize) -> Result<(), PageError> {
        let entry = self
            .seqs
            .get(&seq)
            .ok_or(PageError::UnknownSequence { seq })?;
        if len > entry.len {
            return Err(PageError::TruncateBeyond {
                seq,
                len,
                current: entry.len,
            });
        }
        let want = pages_for(len, self.page_size);
        for (g, pages) in entry.pages.iter().enumerate() {
            let keep = want.min(pages.len());
            let first = self.first_read_page(g, len);
            if pages[first.min(keep)..keep].contains(&FREED) {
                return Err(PageError::WindowFreed { seq, len, group: g });
            }
            if self.page_size > 0 && !len.is_multiple_of(self.page_size) {
                if let Some(&page) = keep.checked_sub(1).and_then(|i| pages.get(i)) {
                    let ref_count = self.ref_count(page);
                    if ref_count > 1 {
                        return Err(PageError::SharedPartialPage {
                            seq,
                            len,
                            page,
                            ref_count,
                        });
                    }
                }
            }
        }
        let dropped: Vec<Vec<u32>> = match self.seqs.get_mut(&seq) {
            Some(entry) => {
                entry.len = len;
                entry
                    .pages
                    .iter_mut()
                    .map(|pages| pages.split_off(want.min(pages.len())))
                    .collect()
            }
            None => Vec::new(),
        };
        // Free the last page first, so that the pages come back in their old
        // order if the sequence grows again.
        for &page in dropped.iter().rev().flat_map(|d| d.iter().rev()) {
            if page != FREED {
                self.drop_ref(page);
            }
        }
        self.open_step = None;
        Ok(())
    }

    /// Removes `seq` and drops its references to its pages; a page whose last
    /// reference goes returns to the free list. Does nothing for a sequence
    /// not in the table; otherwise makes any open prepared step stale.
    pub fn release(&mut self, seq: u64) {
        if let Some(entry) = self.seqs.remove(&seq) {
            for &page in entry.pages.iter().rev().flat_map(|p| p.iter().rev()) {
                if page != FREED {
                    self.drop_ref(page);
                }
            }
            self.open_step = None;
        }
    }

    /// Starts the new sequence `seq` whose context is the full pages `pages`
    /// (so its length is `pages.len() * page_size`), adding a reference to
    /// each page, in a table of one page group ([`PageTable::attach_prefix_groups`] for
    /// more). Makes any open prepared step stale.
    ///
    /// # Errors
    ///
    /// Those of [`PageTable::attach_prefix_groups`].
    pub fn attach_prefix(&mut self, seq: u64, pages: &[u32]) -> Result<(), PageError> {
        self.attach_prefix_groups(seq, &[pages.to_vec()])
    }

    /// Starts the new sequence `seq` whose context is `n` full pages, given per group (`n`
    /// entries each), adding a reference to each page. The pages are typically full pages of
    /// other sequences (see [`PageTable::full_pages`]) or pages held by a prefix cache (see
    /// [`PageTable::retain`]). A sliding group's entries before the first page its next row
    /// (at position `n · page_size`) reads may be [`FREED`]. Makes any open prepared step
    /// stale.
    ///
    /// # Errors
    ///
    /// [`PageError::SequenceExists`] if `seq` is in the table; [`PageError::GroupCount`]
    /// unless there is one list per group, each as long as the first;
    /// for a page, [`PageError::PageOutOfRange`], [`PageError::PageNotInUse`]
    /// (free), [`PageError::DuplicatePage`] (listed twice),
    /// [`PageError::PartialPage`] (some sequence is still writing into it) or
    /// [`PageError::RefCountOverflow`]; [`PageError::WindowFreed`] for a freed entry the
    /// next row reads; [`PageError::TooLong`] if the pages
    /// are more than `pages_per_seq`. On any error the table is unchanged.
    pub fn attach_prefix_groups(&mut self, seq: u64, pages: &[Vec<u32>]) -> Result<(), PageError> {
        if self.seqs.contains_key(&seq) {
            return Err(PageError::SequenceExists { seq });
        }
        let n = pages.first().map_or(0, Vec::len);
        if pages.len() != self.groups() || pages.iter().any(|p| p.len() != n) {
            return Err(PageError::GroupCount {
                given: pages.len(),
                groups: self.groups(),
            });
        }
        let len = n.saturating_mul(self.page_size);
        let partial = self.partial_pages();
        let mut seen = BTreeSet::new();
        for (g, group) in pages.iter().enumerate() {
            let first = self.first_read_page(g, len);
            for (i, &page) in group.iter().enumerate() {
                if page == FREED {
                    if i >= first {
                        return Err(PageError::WindowFreed { seq, len, group: g });
                    }
                    continue;
                }
                self.check_shareable(page, &partial)?;
                if !seen.insert(page) {
                    return Err(PageError::DuplicatePage { seq, page });
                }
            }
        }
        if n > self.pages_per_seq || len > self.max_seq_len {
            return Err(self.too_long(seq, len));
        }
        for &page in pages.iter().flatten() {
            if let Some(count) = self.ref_counts.get_mut(page as usize) {
                *count += 1;
            }
        }
        self.seqs.insert(
            seq,
            Sequence {
                len,
                pages: pages.to_vec(),
            },
        );
        self.open_step = None;
        Ok(())
    }

    /// Adds an external hold on the in-use full page `page` (for example by a
    /// prefix cache): the page stays allocated, with its contents, until the
    /// hold is dropped with [`PageTable::release_page`], even after every
    /// sequence let it go. Makes any open prepared step stale.
    ///
    /// # Errors
    ///
    /// [`PageError::PageOutOfRange`], [`PageError::PageNotInUse`] (free),
    /// [`PageError::PartialPage`] (some sequence is still writing into it) or
    /// [`PageError::RefCountOverflow`]. On any error the table is unchanged.
    pub fn retain(&mut self, page: u32) -> Result<(), PageError> {
        let partial = self.partial_pages();
        self.check_shareable(page, &partial)?;
        let i = page as usize;
        if let (Some(count), Some(external)) =
            (self.ref_counts.get_mut(i), self.external.get_mut(i))
        {
            *count += 1;
            *external += 1;
        }
        self.open_step = None;
        Ok(())
    }

    /// Drops one external hold on `page` (taken with [`PageTable::retain`]);
    /// the page returns to the free list if that was its last reference.
    /// Makes any open prepared step stale.
    ///
    /// # Errors
    ///
    /// [`PageError::PageOutOfRange`], or [`PageError::NoExternalHold`] if the
    /// page has no external hold (references held by sequences are dropped
    /// through [`PageTable::truncate`] and [`PageTable::release`]). On any
    /// error the table is unchanged.
    pub fn release_page(&mut self, page: u32) -> Result<(), PageError> {
        let Some(external) = self.external.get_mut(page as usize) else {
            return Err(self.out_of_range(page));
        };
        if *external == 0 {
            return Err(PageError::NoExternalHold {
                page,
                ref_count: self.ref_count(page),
            });
        }
        *external -= 1;
        self.drop_ref(page);
        self.open_step = None;
        Ok(())
    }

    /// Ends the open step if it is `id`.
    fn close_step(&mut self, id: u64) -> Result<(), PageError> {
        if self.open_step != Some(id) {
            return Err(PageError::StaleStep);
        }
        self.open_step = None;
        Ok(())
    }

    /// Drops one reference to `page`, freeing it at zero.
    fn drop_ref(&mut self, page: u32) {
        if let Some(count) = self.ref_counts.get_mut(page as usize) {
            if *count > 0 {
                *count -= 1;
                if *count == 0 {
                    self.free.push(page);
                }
            }
        }
    }

    /// Pages that some sequence is still writing into (its partly filled last
    /// page, and pages prepared for uncommitted tokens, in any group), with that sequence.
    fn partial_pages(&self) -> BTreeMap<u32, u64> {
        let mut partial = BTreeMap::new();
        for (&seq, entry) in &self.seqs {
            let full = match self.page_size {
                0 => 0,
                size => entry.len / size,
            };
            for pages in &entry.pages {
                for &page in pages.iter().skip(full) {
                    partial.insert(page, seq);
                }
            }
        }
        partial
    }

    /// Checks that `page` may get one more reference.
    fn check_shareable(&self, page: u32, partial: &BTreeMap<u32, u64>) -> Result<(), PageError> {
        let Some(&count) = self.ref_counts.get(page as usize) else {
            return Err(self.out_of_range(page));
        };
        if count == 0 {
            return Err(PageError::PageNotInUse { page });
        }
        if let Some(&holder) = partial.get(&page) {
            return Err(PageError::PartialPage { page, holder });
        }
        if count == u32::MAX {
            return Err(PageError::RefCountOverflow { page });
        }
        Ok(())
    }

    fn out_of_range(&self, page: u32) -> PageError {
        PageError::PageOutOfRange {
            page,
            total: self.total_pages(),
        }
    }

    fn too_long(&self, seq: u64, len: usize) -> PageError {
        PageError::TooLong {
            seq,
            len,
            max_seq_len: self.max_seq_len,
            pages_per_seq: self.pages_per_seq,
            page_size: self.page_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const PAGES: usize = 12;
    const PAGE_SIZE: usize = 4;
    const PER_SEQ: usize = 5;
    const SEQS: u64 = 6;
    /// Page ids the random operations use: a few past the end, for errors.
    const PAGE_IDS: u32 = PAGES as u32 + 2;

    fn small_table() -> PageTable {
        PageTable::new(PAGES, PAGE_SIZE, PER_SEQ)
    }

    /// Prepares and commits one step.
    fn step(t: &mut PageTable, chunks: &[(u64, &[i64])]) {
        let prepared = t.prepare(chunks).expect("prepare");
        t.commit(prepared).expect("commit");
    }

    /// Appends `n` tokens to `seq`.
    fn grow(t: &mut PageTable, seq: u64, n: usize) {
        let tokens = vec![1; n];
        step(t, &[(seq, &tokens)]);
    }

    // ---- random operations -------------------------------------------------

    #[derive(Clone, Debug)]
    enum Op {
        /// Append `n` tokens to each `seq`, then commit or roll back.
        Step {
            chunks: Vec<(u64, usize)>,
            commit: bool,
        },
        /// Truncate to `len % (current + 2)` (so sometimes one too many).
        Truncate {
            seq: u64,
            len: usize,
        },
        Release {
            seq: u64,
        },
        /// Attach `count` full pages of `src` from its full page `start` on.
        AttachFull {
            seq: u64,
            src: u64,
            start: usize,
            count: usize,
        },
        /// Attach arbitrary page ids (mostly refused).
        AttachRaw {
            seq: u64,
            pages: Vec<u32>,
        },
        /// Retain `page`, or with `pick` the `page`-th page in use.
        Retain {
            page: u32,
            pick: bool,
        },
        /// Release a hold on `page`, or with `pick` on the `page`-th page
        /// that has one.
        ReleasePage {
            page: u32,
            pick: bool,
        },
    }

    /// Up to four chunks of distinct sequences in any order, and now and
    /// then a repeated one.
    fn chunks() -> impl Strategy<Value = Vec<(u64, usize)>> {
        let distinct = prop::collection::btree_map(0..SEQS, 0..=9usize, 0..=4)
            .prop_map(|m| m.into_iter().collect::<Vec<_>>())
            .prop_shuffle();
        (distinct, 0..10u8).prop_map(|(mut chunks, dup)| {
            if dup == 0 && !chunks.is_empty() {
                chunks.push((chunks[0].0, 1));
            }
            chunks
        })
    }

    /// Operations; `sharing` weighs attaching, truncating and holds up.
    fn op(sharing: u32) -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (chunks(), any::<bool>()).prop_map(|(chunks, commit)| Op::Step { chunks, commit }),
            2 + sharing => (0..SEQS, 0..=21usize).prop_map(|(seq, len)| Op::Truncate { seq, len }),
            1 => (0..SEQS).prop_map(|seq| Op::Release { seq }),
            2 + 2 * sharing => (0..SEQS, 0..SEQS, 0..=4usize, 0..=5usize).prop_map(
                |(seq, src, start, count)| Op::AttachFull { seq, src, start, count }
            ),
            1 => (0..SEQS, prop::collection::vec(0..PAGE_IDS, 0..=3))
                .prop_map(|(seq, pages)| Op::AttachRaw { seq, pages }),
            1 + sharing => (0..PAGE_IDS, any::<bool>())
                .prop_map(|(page, pick)| Op::Retain { page, pick }),
            1 + sharing => (0..PAGE_IDS, any::<bool>())
                .prop_map(|(page, pick)| Op::ReleasePage { page, pick }),
        ]
    }

    /// A table under random operations, with the test's own model of it.
    struct Harness {
        t: PageTable,
        /// External holds, as the test counts them.
        external: Vec<u32>,
        /// The tokens each sequence should read back.
        contents: BTreeMap<u64, Vec<i64>>,
        /// The token written last into each (page, slot) of the cache.
        shadow: HashMap<(u32, usize), i64>,
        /// Tokens are numbered uniquely, so a wrong read cannot pass.
        next_token: i64,
    }

    impl Harness {
        fn new() -> Self {
            Harness {
                t: small_table(),
                external: vec![0; PAGES],
                contents: BTreeMap::new(),
                shadow: HashMap::new(),
                next_token: 0,
            }
        }

        /// Pages some sequence is still writing into, with that sequence.
        fn partial(&self) -> BTreeMap<u32, u64> {
            let mut partial = BTreeMap::new();
            for seq in self.t.sequences() {
                let full = self.t.len(seq) / PAGE_SIZE;
                for &p in &self.t.pages(seq)[full..] {
                    partial.insert(p, seq);
                }
            }
            partial
        }

        /// `page`, or with `pick` the `page`-th (cyclically) of the pages
        /// that pass `filter`, if any do.
        fn pick(&self, page: u32, pick: bool, filter: impl Fn(&Self, u32) -> bool) -> u32 {
            let candidates: Vec<u32> = (0..PAGES as u32).filter(|&p| filter(self, p)).collect();
            if pick && !candidates.is_empty() {
                candidates[page as usize % candidates.len()]
            } else {
                page
            }
        }

        /// The error a page check should give, in the table's order.
        fn shareable(&self, page: u32) -> Result<(), PageError> {
            if page as usize >= PAGES {
                return Err(PageError::PageOutOfRange { page, total: PAGES });
            }
            if self.t.ref_count(page) == 0 {
                return Err(PageError::PageNotInUse { page });
            }
            if let Some(&holder) = self.partial().get(&page) {
                return Err(PageError::PartialPage { page, holder });
            }
            Ok(())
        }

        fn apply(&mut self, op: &Op) {
            let before = self.t.clone();
            match op {
                Op::Step { chunks, commit } => self.step(chunks, *commit),
                &Op::Truncate { seq, len } => {
                    let current = before.len(seq);
                    let len = len % (current + 2);
                    let expected = if !before.contains(seq) {
                        Err(PageError::UnknownSequence { seq })
                    } else if len > current {
                        Err(PageError::TruncateBeyond { seq, len, current })
                    } else if !len.is_multiple_of(PAGE_SIZE)
                        && before.ref_count(before.pages(seq)[len / PAGE_SIZE]) > 1
                    {
                        let page = before.pages(seq)[len / PAGE_SIZE];
                        Err(PageError::SharedPartialPage {
                            seq,
                            len,
                            page,
                            ref_count: before.ref_count(page),
                        })
                    } else {
                        Ok(())
                    };
                    assert_eq!(self.t.truncate(seq, len), expected);
                    if expected.is_ok() {
                        let keep = len.div_ceil(PAGE_SIZE);
                        assert_eq!(self.t.pages(seq), &before.pages(seq)[..keep]);
                        if let Some(tokens) = self.contents.get_mut(&seq) {
                            tokens.truncate(len);
                        }
                    } else {
                        assert_eq!(self.t, before);
                    }
                }
                &Op::Release { seq } => {
                    self.t.release(seq);
                    self.contents.remove(&seq);
                    assert!(!self.t.contains(seq));
                    if !before.contains(seq) {
                        assert_eq!(self.t, before);
                    }
                }
                &Op::AttachFull {
                    seq,
                    src,
                    start,
                    count,
                } => {
                    let full = before.full_pages(src);
                    let start = start.min(full.len());
                    let end = (start + count).min(full.len());
                    let pages = &full[start..end];
                    let got = self.t.attach_prefix(seq, pages);
                    if before.contains(seq) {
                        assert_eq!(got, Err(PageError::SequenceExists { seq }));
                        assert_eq!(self.t, before);
                    } else {
                        // Full pages of a sequence can always be shared.
                        assert_eq!(got, Ok(()));
                        let tokens = self.contents.get(&src).map_or(Vec::new(), |c| {
                            c[start * PAGE_SIZE..end * PAGE_SIZE].to_vec()
                        });
                        self.contents.insert(seq, tokens);
                        assert_eq!(self.t.full_pages(seq), pages);
                    }
                }
                Op::AttachRaw { seq, pages } => {
                    let seq = *seq;
                    let expected = if before.contains(seq) {
                        Err(PageError::SequenceExists { seq })
                    } else {
                        let mut seen = BTreeSet::new();
                        pages.iter().try_for_each(|&page| {
                            self.shareable(page)?;
                            if seen.insert(page) {
                                Ok(())
                            } else {
                                Err(PageError::DuplicatePage { seq, page })
                            }
                        })
                    };
                    assert_eq!(self.t.attach_prefix(seq, pages), expected);
                    if expected.is_ok() {
                        // The pages are full: every slot holds a token.
                        let tokens = pages
                            .iter()
                            .flat_map(|&p| (0..PAGE_SIZE).map(move |s| (p, s)))
                            .map(|at| *self.shadow.get(&at).expect("slot never written"))
                            .collect();
                        self.contents.insert(seq, tokens);
                    } else {
                        assert_eq!(self.t, before);
                    }
                }
                &Op::Retain { page, pick } => {
                    let page = self.pick(page, pick, |h, p| h.t.ref_count(p) > 0);
                    let expected = self.shareable(page);
                    assert_eq!(self.t.retain(page), expected);
                    if expected.is_ok() {
                        self.external[page as usize] += 1;
                    } else {
                        assert_eq!(self.t, before);
                    }
                }
                &Op::ReleasePage { page, pick } => {
                    let page = self.pick(page, pick, |h, p| h.external[p as usize] > 0);
                    let expected = if page as usize >= PAGES {
                        Err(PageError::PageOutOfRange { page, total: PAGES })
                    } else if self.external[page as usize] == 0 {
                        Err(PageError::NoExternalHold {
                            page,
                            ref_count: before.ref_count(page),
                        })
                    } else {
                        Ok(())
                    };
                    assert_eq!(self.t.release_page(page), expected);
                    if expected.is_ok() {
                        self.external[page as usize] -= 1;
                    } else {
                        assert_eq!(self.t, before);
                    }
                }
            }
        }

        fn step(&mut self, chunks: &[(u64, usize)], commit: bool) {
            let before = self.t.clone();
            let tokens: Vec<(u64, Vec<i64>)> = chunks
                .iter()
                .map(|&(seq, n)| {
                    let start = self.next_token;
                    self.next_token += n as i64;
                    (seq, (start..self.next_token).collect())
                })
                .collect();
            let refs: Vec<(u64, &[i64])> = tokens.iter().map(|(s, v)| (*s, v.as_slice())).collect();

            // What prepare should say, from the public view of the table.
            let mut seen = BTreeSet::new();
            let mut needed = 0;
            let mut expected = None;
            for &(seq, n) in chunks {
                let len = before.len(seq) + n;
                if !seen.insert(seq) {
                    expected = Some(PageError::DuplicateSequence { seq });
                } else if len > PER_SEQ * PAGE_SIZE {
                    expected = Some(PageError::TooLong {
                        seq,
                        len,
                        max_seq_len: PER_SEQ * PAGE_SIZE,
                        pages_per_seq: PER_SEQ,
                        page_size: PAGE_SIZE,
                    });
                } else {
                    needed += len.div_ceil(PAGE_SIZE) - before.pages(seq).len();
                    continue;
                }
                break;
            }
            if expected.is_none() && needed > before.free_pages() {
                expected = Some(PageError::OutOfPages {
                    needed,
                    free: before.free_pages(),
                });
            }

            let prepared = match self.t.prepare(&refs) {
                Err(e) => {
                    assert_eq!(Some(e), expected);
                    assert_eq!(self.t, before, "a failed prepare changed the table");
                    return;
                }
                Ok(prepared) => prepared,
            };
            assert_eq!(expected, None);
            check_inputs(&before, &self.t, &refs, &prepared.inputs);
            assert_eq!(self.t.free_pages(), before.free_pages() - needed);
            if !commit {
                self.t.rollback(prepared).expect("rollback");
                assert_eq!(self.t, before, "rollback did not restore the table");
                return;
            }
            self.t.commit(prepared).expect("commit");
            for (seq, toks) in &tokens {
                let start = before.len(*seq);
                assert_eq!(self.t.len(*seq), start + toks.len());
                let pages = self.t.pages(*seq);
                for (i, &tok) in toks.iter().enumerate() {
                    let pos = start + i;
                    self.shadow
                        .insert((pages[pos / PAGE_SIZE], pos % PAGE_SIZE), tok);
                }
                self.contents.entry(*seq).or_default().extend(toks);
            }
        }

        /// The table's bookkeeping.
        fn check_invariants(&self) {
            let t = &self.t;
            assert_eq!(t.total_pages(), PAGES);
            assert_eq!(t.open_step, None);
            let mut in_free = [false; PAGES];
            for &p in &t.free {
                assert!(
                    (p as usize) < PAGES,
                    "page {p} on the free list is out of range"
                );
                assert!(!in_free[p as usize], "page {p} is twice on the free list");
                in_free[p as usize] = true;
                assert_eq!(t.ref_count(p), 0, "page {p} is free but referenced");
            }
            let mut holders = [0u32; PAGES];
            for seq in t.sequences() {
                let (len, pages) = (t.len(seq), t.pages(seq));
                assert!(len <= t.max_seq_len());
                assert_eq!(pages.len(), len.div_ceil(PAGE_SIZE), "sequence {seq}");
                let mut seen = BTreeSet::new();
                for &p in pages {
                    assert!(seen.insert(p), "sequence {seq} holds page {p} twice");
                    holders[p as usize] += 1;
                }
                assert_eq!(t.full_pages(seq), &pages[..len / PAGE_SIZE]);
                if len % PAGE_SIZE != 0 {
                    let last = pages[pages.len() - 1];
                    assert_eq!(t.ref_count(last), 1, "partly filled page {last} is shared");
                }
            }
            let mut used = 0;
            for p in 0..PAGES as u32 {
                let count = t.ref_count(p);
                if count == 0 {
                    assert!(in_free[p as usize], "page {p} is unreferenced but not free");
                } else {
                    used += 1;
                }
                let external = self.external[p as usize];
                assert_eq!(t.external_holds(p), external, "page {p}");
                assert_eq!(count, holders[p as usize] + external, "page {p}");
            }
            assert_eq!(t.free_pages() + used, PAGES);
            assert_eq!(t.is_empty(), t.sequences().next().is_none());
        }

        /// Every sequence reads back exactly its own tokens through its pages.
        fn check_contents(&self) {
            let seqs: Vec<u64> = self.t.sequences().collect();
            let modelled: Vec<u64> = self.contents.keys().copied().collect();
            assert_eq!(seqs, modelled);
            for (&seq, tokens) in &self.contents {
                assert_eq!(self.t.len(seq), tokens.len(), "sequence {seq}");
                let pages = self.t.pages(seq);
                for (pos, &token) in tokens.iter().enumerate() {
                    let at = (pages[pos / PAGE_SIZE], pos % PAGE_SIZE);
                    assert_eq!(
                        self.shadow.get(&at),
                        Some(&token),
                        "sequence {seq} token {pos} (page {}, slot {})",
                        at.0,
                        at.1
                    );
                }
            }
        }

        /// Lets everything go and checks that every page comes back.
        fn drain(&mut self) {
            let seqs: Vec<u64> = self.t.sequences().collect();
            for seq in seqs {
                self.t.release(seq);
                self.contents.remove(&seq);
            }
            for p in 0..PAGES as u32 {
                while self.external[p as usize] > 0 {
                    self.t.release_page(p).expect("release_page");
                    self.external[p as usize] -= 1;
                }
            }
            self.check_invariants();
            assert!(self.t.is_empty());
            assert_eq!(self.t.free_pages(), PAGES);
        }
    }

    /// Checks the inputs of a step prepared from `before`, with `after` the
    /// table holding it.
    fn check_inputs(
        before: &PageTable,
        after: &PageTable,
        chunks: &[(u64, &[i64])],
        inputs: &StepInputs,
    ) {
        let expected_tokens: Vec<i64> =
            chunks.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        assert_eq!(inputs.tokens, expected_tokens);
        assert_eq!(inputs.pages_per_seq, PER_SEQ);
        assert_eq!(inputs.input_row_offsets.len(), chunks.len() + 1);
        assert_eq!(inputs.cache_lengths.len(), chunks.len());
        assert_eq!(inputs.kv_lookup_table.len(), chunks.len() * PER_SEQ);
        assert_eq!(inputs.input_row_offsets[0], 0);
        let mut offset = 0;
        for (i, &(seq, tokens)) in chunks.iter().enumerate() {
            offset += tokens.len();
            assert_eq!(inputs.input_row_offsets[i + 1] as usize, offset);
            let len = before.len(seq);
            assert_eq!(inputs.cache_lengths[i] as usize, len);
            assert_eq!(after.len(seq), len, "prepare advanced sequence {seq}");
            let pages = after.pages(seq);
            let old = before.pages(seq);
            assert_eq!(pages.len(), (len + tokens.len()).div_ceil(PAGE_SIZE));
            assert_eq!(&pages[..old.len()], old);
            for &p in &pages[old.len()..] {
                assert_eq!(
                    (before.ref_count(p), after.ref_count(p)),
                    (0, 1),
                    "page {p}"
                );
            }
            let row = &inputs.kv_lookup_table[i * PER_SEQ..(i + 1) * PER_SEQ];
            let ids: Vec<i32> = pages.iter().map(|&p| p as i32).collect();
            assert_eq!(&row[..pages.len()], ids.as_slice());
            assert!(row[pages.len()..].iter().all(|&c| c == 0));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(384))]

        /// Free list, reference counts and page counts stay consistent, and
        /// every refused or rolled-back operation leaves the table as it was.
        #[test]
        fn random_operations_keep_the_bookkeeping(ops in prop::collection::vec(op(0), 40..=60)) {
            let mut h = Harness::new();
            for op in &ops {
                h.apply(op);
                h.check_invariants();
            }
            h.drain();
        }

        /// With much sharing and truncation, every sequence still reads back
        /// exactly the tokens committed to it (or to the prefix it attached).
        #[test]
        fn sequences_read_back_their_own_tokens(ops in prop::collection::vec(op(2), 40..=60)) {
            let mut h = Harness::new();
            for op in &ops {
                h.apply(op);
                h.check_invariants();
                h.check_contents();
            }
            h.drain();
        }
    }

    // ---- unit tests --------------------------------------------------------

    #[test]
    fn allocation_is_lowest_first_then_lifo() {
        let mut t = PageTable::new(4, 2, 4);
        grow(&mut t, 1, 3);
        assert_eq!(t.pages(1), &[0, 1]);
        grow(&mut t, 2, 1);
        assert_eq!(t.pages(2), &[2]);
        t.release(1);
        assert_eq!(t.free_pages(), 3);
        grow(&mut t, 3, 5);
        assert_eq!(t.pages(3), &[0, 1, 3]);
        assert_eq!(t.sequences().collect::<Vec<_>>(), vec![2, 3]);
    }

    #[test]
    fn prepare_builds_the_step_inputs_and_commit_advances() {
        let mut t = PageTable::new(8, 2, 3);
        grow(&mut t, 5, 3);
        let prepared = t.prepare(&[(9, &[7, 8, 9]), (5, &[4]), (6, &[])]).unwrap();
        assert_eq!(
            prepared.inputs,
            StepInputs {
                tokens: vec![7, 8, 9, 4],
                input_row_offsets: vec![0, 3, 4, 4],
                cache_lengths: vec![0, 3, 0],
                kv_lookup_table: vec![2, 3, 0, 0, 1, 0, 0, 0, 0],
                pages_per_seq: 3,
                kv_groups: 1,
                logit_indices: vec![2, 3, -1],
            }
        );
        assert_eq!((t.len(9), t.len(5)), (0, 3));
        t.commit(prepared).unwrap();
        assert_eq!((t.len(9), t.len(5), t.len(6)), (3, 4, 0));
        assert!(t.contains(6));
        assert_eq!(t.full_pages(5), &[0, 1]);
        assert_eq!(t.full_pages(9), &[2]);
    }

    #[test]
    fn rollback_restores_the_table() {
        let mut t = PageTable::new(8, 2, 3);
        grow(&mut t, 1, 3);
        grow(&mut t, 2, 2);
        t.release(1);
        let before = t.clone();
        let prepared = t.prepare(&[(2, &[1, 2, 3]), (3, &[4])]).unwrap();
        assert_ne!(t, before);
        t.rollback(prepared).unwrap();
        assert_eq!(t, before);
        assert!(!t.contains(3));
    }

    #[test]
    fn duplicate_sequence_is_refused() {
        let mut t = small_table();
        let before = t.clone();
        let err = t.prepare(&[(3, &[1]), (4, &[2]), (3, &[3])]).unwrap_err();
        assert_eq!(err, PageError::DuplicateSequence { seq: 3 });
        assert_eq!(
            err.to_string(),
            "sequence 3 appears more than once in one step"
        );
        assert_eq!(t, before);
    }

    #[test]
    fn too_long_names_the_numbers() {
        let mut t = PageTable::new(8, 128, 2);
        grow(&mut t, 7, 200);
        let before = t.clone();
        let err = t.prepare(&[(7, &[0; 100])]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sequence 7 would reach 300 tokens, beyond max_seq_len 256 (2 pages of 128)"
        );
        assert_eq!(t, before);
        // Exactly full is fine.
        grow(&mut t, 7, 56);
        assert_eq!(t.len(7), 256);
    }

    #[test]
    fn out_of_pages_counts_the_whole_step() {
        let mut t = PageTable::new(4, 4, 8);
        grow(&mut t, 0, 12);
        let before = t.clone();
        let err = t.prepare(&[(1, &[0; 12])]).unwrap_err();
        assert_eq!(err, PageError::OutOfPages { needed: 3, free: 1 });
        assert_eq!(
            err.to_string(),
            "the KV cache needs 3 more pages, 1 is free"
        );
        // Each chunk alone fits; together they do not.
        let err = t.prepare(&[(0, &[1]), (2, &[1])]).unwrap_err();
        assert_eq!(err, PageError::OutOfPages { needed: 2, free: 1 });
        assert_eq!(t, before);
        grow(&mut t, 0, 4);
        let err = t.prepare(&[(1, &[1])]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the KV cache needs 1 more page, 0 are free"
        );
        assert_eq!(
            PageError::OutOfPages { needed: 2, free: 2 }.to_string(),
            "the KV cache needs 2 more pages, 2 are free"
        );
    }

    #[test]
    fn truncate_drops_pages_and_refuses_bad_lengths() {
        let mut t = small_table();
        grow(&mut t, 1, 10);
        assert_eq!(t.pages(1), &[0, 1, 2]);
        assert_eq!(t.truncate(9, 0), Err(PageError::UnknownSequence { seq: 9 }));
        let err = t.truncate(1, 11).unwrap_err();
        assert_eq!(
            err,
            PageError::TruncateBeyond {
                seq: 1,
                len: 11,
                current: 10
            }
        );
        assert_eq!(
            err.to_string(),
            "cannot truncate sequence 1 to 11 tokens: it has only 10"
        );
        t.truncate(1, 5).unwrap();
        assert_eq!((t.len(1), t.pages(1)), (5, &[0, 1][..]));
        assert_eq!(t.ref_count(2), 0);
        t.truncate(1, 0).unwrap();
        assert_eq!(t.pages(1), &[] as &[u32]);
        assert_eq!(t.free_pages(), PAGES);
        assert!(t.contains(1));
    }

    #[test]
    fn truncate_refuses_to_leave_a_shared_page_partly_filled() {
        let mut t = small_table();
        grow(&mut t, 1, 9);
        t.attach_prefix(2, t.full_pages(1).to_vec().as_slice())
            .unwrap();
        assert_eq!((t.len(2), t.pages(2)), (8, &[0, 1][..]));
        assert_eq!(t.ref_count(1), 2);
        let before = t.clone();
        let err = t.truncate(1, 6).unwrap_err();
        assert_eq!(
            err,
            PageError::SharedPartialPage {
                seq: 1,
                len: 6,
                page: 1,
                ref_count: 2
            }
        );
        assert_eq!(
            err.to_string(),
            "cannot truncate sequence 1 to 6 tokens: its last page 1 would be partly filled \
             but is shared (ref count 2)"
        );
        assert_eq!(t.truncate(2, 3).unwrap_err().to_string(), "cannot truncate sequence 2 to 3 tokens: its last page 0 would be partly filled but is shared (ref count 2)");
        assert_eq!(t, before);
        // At a page boundary the shared pages stay full.
        t.truncate(1, 4).unwrap();
        assert_eq!(t.ref_count(1), 1);
        // Now sequence 2 is page 1's only holder.
        t.truncate(2, 6).unwrap();
        assert_eq!(t.pages(2), &[0, 1]);
    }

    #[test]
    fn release_frees_pages_once_unreferenced() {
        let mut t = small_table();
        grow(&mut t, 1, 8);
        t.attach_prefix(2, &[0]).unwrap();
        t.release(1);
        assert_eq!((t.ref_count(0), t.ref_count(1)), (1, 0));
        t.release(1);
        t.release(2);
        assert!(t.is_empty());
        assert_eq!(t.free_pages(), PAGES);
    }

    #[test]
    fn attach_prefix_errors() {
        let mut t = small_table();
        grow(&mut t, 1, 6);
        grow(&mut t, 2, 24 - 4);
        let before = t.clone();
        assert_eq!(
            t.attach_prefix(1, &[]),
            Err(PageError::SequenceExists { seq: 1 })
        );
        let err = t.attach_prefix(3, &[0, 12]).unwrap_err();
        assert_eq!(
            err,
            PageError::PageOutOfRange {
                page: 12,
                total: 12
            }
        );
        assert_eq!(
            err.to_string(),
            "page 12 is out of range: the KV cache has 12 pages"
        );
        let err = t.attach_prefix(3, &[0, 11]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "page 11 is free, so it cannot be shared or held"
        );
        let err = t.attach_prefix(3, &[0, 2, 0]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "page 0 appears twice in the prefix given for sequence 3"
        );
        let err = t.attach_prefix(3, &[0, 1]).unwrap_err();
        assert_eq!(err, PageError::PartialPage { page: 1, holder: 1 });
        assert_eq!(
            err.to_string(),
            "page 1 is the partly filled last page of sequence 1, so it cannot be shared or held"
        );
        assert_eq!(t, before);
        let mut wide = PageTable::new(8, 1, 2);
        grow(&mut wide, 1, 2);
        grow(&mut wide, 2, 1);
        let err = wide.attach_prefix(3, &[0, 1, 2]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sequence 3 would reach 3 tokens, beyond max_seq_len 2 (2 pages of 1)"
        );
        t.attach_prefix(3, &[2, 0]).unwrap();
        assert_eq!((t.len(3), t.pages(3), t.ref_count(0)), (8, &[2, 0][..], 2));
        assert_eq!(t.full_pages(3), &[2, 0]);
    }

    #[test]
    fn external_holds_keep_pages_alive() {
        let mut t = small_table();
        grow(&mut t, 1, 6);
        assert_eq!(
            t.retain(12),
            Err(PageError::PageOutOfRange {
                page: 12,
                total: 12
            })
        );
        assert_eq!(t.retain(5), Err(PageError::PageNotInUse { page: 5 }));
        assert_eq!(
            t.retain(1),
            Err(PageError::PartialPage { page: 1, holder: 1 })
        );
        let err = t.release_page(0).unwrap_err();
        assert_eq!(
            err,
            PageError::NoExternalHold {
                page: 0,
                ref_count: 1
            }
        );
        assert_eq!(
            err.to_string(),
            "page 0 has no external hold to release (its 1 references belong to sequences)"
        );
        assert_eq!(
            t.release_page(99),
            Err(PageError::PageOutOfRange {
                page: 99,
                total: 12
            })
        );
        t.retain(0).unwrap();
        t.retain(0).unwrap();
        assert_eq!((t.ref_count(0), t.external_holds(0)), (3, 2));
        t.release(1);
        assert_eq!(t.ref_count(0), 2);
        assert_eq!(t.free_pages(), PAGES - 1);
        // The cached page can start a new sequence.
        t.attach_prefix(2, &[0]).unwrap();
        assert_eq!(t.len(2), 4);
        t.release(2);
        t.release_page(0).unwrap();
        t.release_page(0).unwrap();
        assert_eq!(t.ref_count(0), 0);
        assert_eq!(t.free_pages(), PAGES);
        assert!(t.release_page(0).is_err());
    }

    #[test]
    fn stale_steps_are_refused() {
        let mut t = small_table();
        let first = t.prepare(&[(1, &[1, 2])]).unwrap();
        let second = t.prepare(&[(2, &[3])]).unwrap();
        let before = t.clone();
        assert_eq!(t.commit(first), Err(PageError::StaleStep));
        assert_eq!(t, before);
        t.commit(second).unwrap();

        let mut other = small_table();
        let foreign = other.prepare(&[(1, &[1])]).unwrap();
        let before = t.clone();
        assert_eq!(t.rollback(foreign), Err(PageError::StaleStep));
        assert_eq!(t, before);

        let prepared = t.prepare(&[(2, &[4])]).unwrap();
        t.release(1);
        assert_eq!(t.commit(prepared), Err(PageError::StaleStep));
        assert!(PageError::StaleStep.to_string().contains("stale"));
    }

    #[test]
    fn zero_sized_tables_hold_nothing() {
        let mut t = PageTable::new(4, 0, 4);
        assert_eq!(t.max_seq_len(), 0);
        assert!(matches!(
            t.prepare(&[(1, &[1])]),
            Err(PageError::TooLong { .. })
        ));
        grow(&mut t, 1, 0);
        assert_eq!(
            (t.len(1), t.pages(1), t.full_pages(1)),
            (0, &[][..], &[][..])
        );
        assert_eq!(
            t.attach_prefix(2, &[0]),
            Err(PageError::PageNotInUse { page: 0 })
        );
        t.truncate(1, 0).unwrap();

        let mut empty = PageTable::new(0, 4, 4);
        assert_eq!(
            empty.prepare(&[(1, &[1])]).unwrap_err(),
            PageError::OutOfPages { needed: 1, free: 0 }
        );
        assert_eq!(empty.ref_count(0), 0);
    }

    #[test]
    fn a_sliding_group_frees_the_pages_its_window_left_and_the_lookup_shows_them_as_0() {
        // Group 0 full, group 1 a window of 5, pages of 4 tokens.
        let mut t = PageTable::with_groups(20, 4, 6, vec![None, Some(5)]);
        let p = t.prepare(&[(1, &[1; 10])]).unwrap();
        assert_eq!(p.inputs.kv_groups, 2);
        assert_eq!(p.inputs.kv_lookup_table.len(), 2 * 6);
        t.commit(p).unwrap();
        assert_eq!(t.held_pages(1), 6);
        // The next row (position 10) reads positions 6..=10: pages 1 and 2 of group 1.
        assert_eq!(t.out_of_window(1), 1);
        assert_eq!(t.slide(1), 1);
        assert_eq!(t.group_pages(1, 1)[0], FREED);
        assert_eq!(t.free_pages(), 15);
        assert_eq!(t.pages_needed(1, 13), 2);
        let p = t.prepare(&[(1, &[1; 3])]).unwrap();
        let g1 = p.inputs.lookup_table(1);
        assert_eq!(g1[0], 0, "a freed page reads as 0");
        assert_eq!(
            &g1[1..4],
            t.group_pages(1, 1)[1..4]
                .iter()
                .map(|&p| p as i32)
                .collect::<Vec<_>>()
                .as_slice()
        );
        t.commit(p).unwrap();
        // Back to 11 tokens reads from position 7 (page 1): allowed. Back to 3 is not.
        assert_eq!(
            t.truncate(1, 3),
            Err(PageError::WindowFreed {
                seq: 1,
                len: 3,
                group: 1
            })
        );
        t.truncate(1, 11).unwrap();
        assert_eq!(t.slide(1), 0);
        t.release(1);
        assert_eq!(t.free_pages(), 20);
    }

    #[test]
    fn attaching_groups_checks_their_lists() {
        let mut t = PageTable::with_groups(20, 2, 8, vec![None, Some(3)]);
        let p = t.prepare(&[(1, &[1; 8])]).unwrap();
        t.commit(p).unwrap();
        let full = t.group_pages(1, 0)[..3].to_vec();
        let sliding = t.group_pages(1, 1)[..3].to_vec();
        assert!(matches!(
            t.attach_prefix_groups(2, std::slice::from_ref(&full)),
            Err(PageError::GroupCount {
                given: 1,
                groups: 2
            })
        ));
        // At 6 tokens the next row reads positions 4..=6: page 2 only.
        let freed_read = vec![sliding[0], sliding[1], FREED];
        assert!(matches!(
            t.attach_prefix_groups(2, &[full.clone(), freed_read]),
            Err(PageError::WindowFreed { .. })
        ));
        t.attach_prefix_groups(2, &[full, vec![FREED, FREED, sliding[2]]])
            .unwrap();
        assert_eq!(t.len(2), 6);
        assert_eq!(t.held_pages(2), 4);
    }
}
