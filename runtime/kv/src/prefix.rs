//! The prefix cache: full KV pages shared between requests whose tokens start the same way.
//!
//! A full page is known by the hash chain of the tokens up to its end (the previous page's hash
//! and its own tokens), and the cache keeps the tokens too, so a hash collision never shares a
//! page. The cache holds one reference on each cached page ([`PageTable::retain`]); a page no
//! sequence uses any more stays cached until it is evicted, least recently used first, when the
//! KV cache runs out of free pages.

use crate::PageTable;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Cached full pages by the hash chain of their tokens.
#[derive(Debug, Default)]
pub struct PrefixCache {
    page_size: usize,
    /// Chain hash → (page, the page's tokens).
    by_hash: HashMap<u64, (u32, Vec<i64>)>,
    /// Page → its chain hash and last use.
    pages: HashMap<u32, (u64, u64)>,
    /// Last use → page, for eviction in LRU order.
    lru: BTreeMap<u64, u32>,
    tick: u64,
}

/// The chain hash of a page with tokens `tokens` after a page with hash `prev`.
fn chain(prev: u64, tokens: &[i64]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// An empty cache for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        PrefixCache {
            page_size: page_size.max(1),
            ..Default::default()
        }
    }

    /// Pages cached.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// The pages cached (in no particular order).
    pub fn pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.pages.keys().copied()
    }

    /// Whether no page is cached.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    fn touch(&mut self, page: u32) {
        self.tick += 1;
        if let Some((_, used)) = self.pages.get_mut(&page) {
            self.lru.remove(used);
            *used = self.tick;
            self.lru.insert(self.tick, page);
        }
    }

    /// The cached pages that hold the longest prefix of `tokens` made of full pages, leaving at
    /// least one token uncached (its logits are needed). Marks them used.
    pub fn lookup(&mut self, tokens: &[i64]) -> Vec<u32> {
        let full = tokens.len().saturating_sub(1) / self.page_size;
        let mut out = Vec::new();
        let mut h = 0u64;
        for i in 0..full {
            let page_tokens = &tokens[i * self.page_size..(i + 1) * self.page_size];
            h = chain(h, page_tokens);
            match self.by_hash.get(&h) {
                Some((page, t)) if t == page_tokens => out.push(*page),
                _ => break,
            }
        }
        for &p in &out {
            self.touch(p);
        }
        out
    }

    /// Caches the full pages of a sequence whose first `tokens.len()` tokens are computed in
    /// `pages` (its pages in order), taking a reference on each page newly cached.
    pub fn insert(&mut self, table: &mut PageTable, tokens: &[i64], pages: &[u32]) {
        let full = (tokens.len() / self.page_size).min(pages.len());
        let mut h = 0u64;
        for (i, &page) in pages.iter().enumerate().take(full) {
            let page_tokens = &tokens[i * self.page_size..(i + 1) * self.page_size];
            h = chain(h, page_tokens);
            if self.by_hash.contains_key(&h) || self.pages.contains_key(&page) {
                continue;
            }
            if table.retain(page).is_ok() {
                self.by_hash.insert(h, (page, page_tokens.to_vec()));
                self.pages.insert(page, (h, 0));
                self.touch(page);
            }
        }
    }

    /// Evicts least recently used cached pages that no sequence holds until `table` has
    /// `free` free pages or nothing more can go; returns the pages evicted.
    pub fn evict(&mut self, table: &mut PageTable, free: usize) -> usize {
        let mut evicted = 0;
        let candidates: Vec<(u64, u32)> = self.lru.iter().map(|(&t, &p)| (t, p)).collect();
        for (used, page) in candidates {
            if table.free_pages() >= free {
                break;
            }
            if table.ref_count(page) != 1 {
                continue;
            }
            if table.release_page(page).is_ok() {
                self.lru.remove(&used);
                if let Some((h, _)) = self.pages.remove(&page) {
                    self.by_hash.remove(&h);
                }
                evicted += 1;
            }
        }
        evicted
    }

    /// Cached pages that only the cache holds (what eviction could free now).
    pub fn evictable(&self, table: &PageTable) -> usize {
        self.pages
            .keys()
            .filter(|&&p| table.ref_count(p) == 1)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_shared_by_exact_prefix_and_evicted_least_recently_used_first() {
        let mut t = PageTable::new(6, 2, 4);
        let mut c = PrefixCache::new(2);
        let a = [1i64, 2, 3, 4, 5];
        let s = t.prepare(&[(1, &a)]).unwrap();
        t.commit(s).unwrap();
        let pages = t.pages(1).to_vec();
        c.insert(&mut t, &a, &pages);
        assert_eq!(c.len(), 2);
        // The same first page, a different second one: one page shared.
        let shared = c.lookup(&[1, 2, 3, 9, 9]);
        assert_eq!(shared, t.pages(1)[..1].to_vec());
        // A prompt that is exactly two cached pages keeps its last token uncached.
        assert_eq!(c.lookup(&[1, 2, 3, 4]).len(), 1);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 7]).len(), 2);
        // Nothing to evict while the sequence holds its pages.
        t.release(1);
        assert_eq!(t.free_pages(), 4);
        assert_eq!(c.evictable(&t), 2);
        assert_eq!(c.evict(&mut t, 5), 1);
        assert_eq!(t.free_pages(), 5);
        assert_eq!(c.len(), 1);
        assert_eq!(c.evict(&mut t, 6), 1);
        assert!(c.is_empty() && t.free_pages() == 6);
    }
}
