//! One role's KV cache state, owned in one place: the page table and, where prefix caching is
//! on, the prefix cache holding full pages for reuse. The scheduler owns one per role and does
//! every allocation, eviction and release through it before a step runs, so that the executor
//! is handed a step that fits.

use crate::pages::FREED;
use crate::{PageError, PageTable, PrefixCache, PreparedStep};
use std::collections::BTreeMap;

/// A page table with its prefix cache.
#[derive(Debug)]
pub struct KvCache {
    table: PageTable,
    prefix: Option<PrefixCache>,
}

impl KvCache {
    /// `table` (empty), with a prefix cache where `prefix_caching`.
    pub fn new(table: PageTable, prefix_caching: bool) -> Self {
        let prefix = prefix_caching.then(|| PrefixCache::new(table.page_size()));
        KvCache { table, prefix }
    }

    /// The page table (read-only: changes go through the cache).
    pub fn pages(&self) -> &PageTable {
        &self.table
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.table.page_size()
    }

    /// Whether full pages are shared between sequences.
    pub fn prefix_caching(&self) -> bool {
        self.prefix.is_some()
    }

    /// Pages held by the prefix cache alone (eviction frees them).
    pub fn cached_only_pages(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.evictable(&self.table))
    }

    /// Pages a step could use: free ones and those eviction would free.
    pub fn available_pages(&self) -> usize {
        self.table.free_pages() + self.cached_only_pages()
    }

    /// Pages `seq` needs beyond those it holds to hold `len` tokens, in every page group.
    pub fn pages_needed(&self, seq: u64, len: usize) -> usize {
        self.table.pages_needed(seq, len)
    }

    /// Shares the cached full pages that start `tokens` with the new sequence `seq` (leaving at
    /// least one token to compute); returns the tokens they hold (0 without a cache or a hit).
    pub fn attach_cached_prefix(&mut self, seq: u64, tokens: &[i64]) -> usize {
        let Some(cache) = self.prefix.as_mut() else {
            return 0;
        };
        let pages = cache.lookup(&self.table, tokens);
        let n = pages.first().map_or(0, Vec::len);
        if n == 0 || self.table.attach_prefix_groups(seq, &pages).is_err() {
            return 0;
        }
        n * self.table.page_size()
    }

    /// Starts the new sequence `seq` from the full pages of `parent` that hold the start of
    /// `tokens` (the same prompt: a choice of `n > 1` forked from the first), leaving at least
    /// one token to compute, in every page group (a sliding group needs only what its window
    /// reads from there). Returns the tokens shared (0 where none could be).
    pub fn fork_prefix(&mut self, parent: u64, seq: u64, tokens: &[i64]) -> usize {
        let ps = self.table.page_size().max(1);
        let most = (tokens.len().saturating_sub(1) / ps).min(self.table.len(parent) / ps);
        for k in (1..=most).rev() {
            let t = &self.table;
            let pages: Vec<Vec<u32>> = (0..t.groups())
                .map(|g| {
                    let first = t.first_read_page(g, k * ps);
                    t.group_pages(parent, g)[..k]
                        .iter()
                        .enumerate()
                        .map(|(i, &p)| if i < first { FREED } else { p })
                        .collect()
                })
                .collect();
            // Refused where a sliding group freed a page the fork's next row reads.
            if self.table.attach_prefix_groups(seq, &pages).is_ok() {
                return k * ps;
            }
        }
        0
    }

    /// Evicts unreferenced cached pages, least recently used first, until `free` pages are
    /// free; returns whether they are.
    pub fn make_room(&mut self, free: usize) -> bool {
        if self.table.free_pages() < free {
            if let Some(cache) = self.prefix.as_mut() {
                cache.evict(&mut self.table, free);
            }
        }
        self.table.free_pages() >= free
    }

    /// [`PageTable::prepare`]: the step's inputs, its pages allocated.
    pub fn prepare(&mut self, chunks: &[(u64, &[i64])]) -> Result<PreparedStep, PageError> {
        self.table.prepare(chunks)
    }

    /// [`PageTable::commit`].
    pub fn commit(&mut self, step: PreparedStep) -> Result<(), PageError> {
        self.table.commit(step)
    }

    /// [`PageTable::rollback`].
    pub fn rollback(&mut self, step: PreparedStep) -> Result<(), PageError> {
        self.table.rollback(step)
    }

    /// Keeps the first `len` cached tokens of `seq` (rejected draft tokens leave this way).
    pub fn truncate(&mut self, seq: u64, len: usize) -> Result<(), PageError> {
        self.table.truncate(seq, len)
    }

    /// Caches the full pages of `seq`, whose cached tokens start with `tokens`.
    pub fn cache_prefix(&mut self, seq: u64, tokens: &[i64]) {
        if let Some(cache) = self.prefix.as_mut() {
            let n = tokens.len().min(self.table.len(seq));
            cache.insert(&mut self.table, seq, &tokens[..n]);
        }
    }

    /// Hands back the pages `seq`'s sliding page groups no longer read ([`PageTable::slide`]),
    /// caching its full pages first where prefix caching is on (`tokens` are its cached
    /// tokens), so that a later request sharing the prefix still finds them. Returns the pages
    /// the sequence let go. Call it once a step's lengths are final.
    pub fn slide(&mut self, seq: u64, tokens: &[i64]) -> usize {
        if self.table.out_of_window(seq) == 0 {
            return 0;
        }
        self.cache_prefix(seq, tokens);
        self.table.slide(seq)
    }

    /// Frees `seq`'s pages (those the prefix cache holds stay cached).
    pub fn release(&mut self, seq: u64) {
        self.table.release(seq);
    }

    /// Checks the bookkeeping: in every page group each sequence has `ceil(len / page_size)`
    /// entries, of distinct pages, freed only where a sliding group's next row reads nothing;
    /// a shared page is full in every sequence holding it; each page's reference count is its
    /// holders plus its external holds, the prefix cache's pages are exactly the external
    /// holds, and used and free pages add up. Returns what is wrong.
    pub fn audit(&self) -> Result<(), String> {
        let t = &self.table;
        let ps = t.page_size();
        let mut holders = vec![0u32; t.total_pages()];
        for seq in t.sequences() {
            let mut seen = std::collections::BTreeSet::new();
            for g in 0..t.groups() {
                let pages = t.group_pages(seq, g);
                if pages.len() != t.len(seq).div_ceil(ps) {
                    return Err(format!(
                        "sequence {seq}, group {g}: {} tokens in {} pages of {ps}",
                        t.len(seq),
                        pages.len()
                    ));
                }
                let first = t.first_read_page(g, t.len(seq));
                for (i, &p) in pages.iter().enumerate() {
                    if p == FREED {
                        if i >= first {
                            return Err(format!(
                                "sequence {seq}, group {g}: page {i} is freed but read next"
                            ));
                        }
                        continue;
                    }
                    if !seen.insert(p) {
                        return Err(format!("sequence {seq} holds page {p} twice"));
                    }
                    match holders.get_mut(p as usize) {
                        Some(h) => *h += 1,
                        None => return Err(format!("sequence {seq} holds page {p}, out of range")),
                    }
                }
            }
        }
        for seq in t.sequences() {
            for g in 0..t.groups() {
                for (i, &p) in t.group_pages(seq, g).iter().enumerate() {
                    if p != FREED && holders[p as usize] > 1 && (i + 1) * ps > t.len(seq) {
                        return Err(format!(
                            "page {p} is shared but partly filled in sequence {seq}"
                        ));
                    }
                }
            }
        }
        let cached: BTreeMap<u32, ()> = self
            .prefix
            .as_ref()
            .map(|c| c.pages().map(|p| (p, ())).collect())
            .unwrap_or_default();
        let mut used = 0;
        for (p, &h) in holders.iter().enumerate() {
            let p = p as u32;
            let (rc, ext) = (t.ref_count(p), t.external_holds(p));
            if rc != h + ext {
                return Err(format!(
                    "page {p}: reference count {rc}, {h} sequences and {ext} external holds"
                ));
            }
            if ext != u32::from(cached.contains_key(&p)) {
                return Err(format!(
                    "page {p}: {ext} external holds, cached by the prefix cache: {}",
                    cached.contains_key(&p)
                ));
            }
            used += usize::from(rc > 0);
        }
        if used + t.free_pages() != t.total_pages() {
            return Err(format!(
                "{used} pages used and {} free of {}",
                t.free_pages(),
                t.total_pages()
            ));
        }
        Ok(())
    }
}
