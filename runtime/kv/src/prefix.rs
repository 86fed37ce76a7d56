//! The prefix cache: full KV pages shared between requests whose tokens start the same way.
//!
//! A full page is known by the hash chain of the tokens up to its end (the previous page's hash
//! and its own tokens), and the cache keeps the tokens too, so a hash collision never shares a
//! page. Each entry holds that position's page in every page group where it has one: a
//! sliding group's pages may be missing where its window had left them before they were
//! cached, or where they were evicted. The cache holds one reference on each cached page
//! ([`PageTable::retain`]); a page no sequence uses any more stays cached until it is evicted,
//! least recently used first, when the KV cache runs out of free pages.

use crate::pages::FREED;
use crate::PageTable;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// One cached page position: its tokens and its page in each group ([`FREED`] where none).
#[derive(Debug)]
struct Entry {
    tokens: Vec<i64>,
    pages: Vec<u32>,
}

/// Cached full pages by the hash chain of their tokens.
#[derive(Debug, Default)]
pub struct PrefixCache {
    page_size: usize,
    /// Chain hash → the position's tokens and pages.
    by_hash: HashMap<u64, Entry>,
    /// Page → its chain hash, its group and its last use.
    pages: HashMap<u32, (u64, usize, u64)>,
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
        if let Some((_, _, used)) = self.pages.get_mut(&page) {
            self.lru.remove(used);
            *used = self.tick;
            self.lru.insert(self.tick, page);
        }
    }

    /// The cached pages that hold the longest prefix of `tokens` made of full pages, leaving at
    /// least one token uncached (its logits are needed), that every group of `table` can
    /// serve: a full-attention group needs all its pages, a sliding group those its window
    /// reaches from the first position after the prefix. Per group, the prefix's pages in
    /// order, [`FREED`] where a sliding group needs none (all empty on a miss). Marks them
    /// used.
    pub fn lookup(&mut self, table: &PageTable, tokens: &[i64]) -> Vec<Vec<u32>> {
        let groups = table.groups();
        let full = tokens.len().saturating_sub(1) / self.page_size;
        let mut entries: Vec<&Entry> = Vec::new();
        let mut h = 0u64;
        for i in 0..full {
            let page_tokens = &tokens[i * self.page_size..(i + 1) * self.page_size];
            h = chain(h, page_tokens);
            match self.by_hash.get(&h) {
                Some(e) if e.tokens == page_tokens && e.pages.len() == groups => entries.push(e),
                _ => break,
            }
        }
        // The longest prefix every group can serve.
        let serves = |k: usize| {
            (0..groups).all(|g| {
                let first = table.first_read_page(g, k * self.page_size);
                entries[first.min(k)..k].iter().all(|e| e.pages[g] != FREED)
            })
        };
        let Some(k) = (1..=entries.len()).rev().find(|&k| serves(k)) else {
            return vec![Vec::new(); groups];
        };
        let out: Vec<Vec<u32>> = (0..groups)
            .map(|g| {
                let first = table.first_read_page(g, k * self.page_size);
                (0..k)
                    .map(|i| {
                        if i < first {
                            FREED
                        } else {
                            entries[i].pages[g]
                        }
                    })
                    .collect()
            })
            .collect();
        for &p in out.iter().flatten() {
            if p != FREED {
                self.touch(p);
            }
        }
        out
    }

    /// Caches the full pages of sequence `seq` of `table`, whose first `tokens.len()` tokens
    /// are computed, in every group where it still holds them, taking a reference on each
    /// page newly cached.
    pub fn insert(&mut self, table: &mut PageTable, seq: u64, tokens: &[i64]) {
        let groups = table.groups();
        let held: Vec<Vec<u32>> = (0..groups)
            .map(|g| table.group_pages(seq, g).to_vec())
            .collect();
        let full = tokens.len() / self.page_size;
        let mut h = 0u64;
        for i in 0..full {
            let page_tokens = &tokens[i * self.page_size..(i + 1) * self.page_size];
            h = chain(h, page_tokens);
            let entry = self.by_hash.entry(h).or_insert_with(|| Entry {
                tokens: page_tokens.to_vec(),
                pages: vec![FREED; groups],
            });
            if entry.tokens != page_tokens || entry.pages.len() != groups {
                // A hash collision: this chain cannot be cached past it.
                break;
            }
            for (g, held) in held.iter().enumerate() {
                let Some(&page) = held.get(i) else { continue };
                if page == FREED || entry.pages[g] != FREED || self.pages.contains_key(&page) {
                    continue;
                }
                if table.retain(page).is_ok() {
                    entry.pages[g] = page;
                    self.tick += 1;
                    self.pages.insert(page, (h, g, self.tick));
                    self.lru.insert(self.tick, page);
                }
            }
            if entry.pages.iter().all(|&p| p == FREED) {
                self.by_hash.remove(&h);
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
                if let Some((h, g, _)) = self.pages.remove(&page) {
                    if let Some(e) = self.by_hash.get_mut(&h) {
                        e.pages[g] = FREED;
                        if e.pages.iter().all(|&p| p == FREED) {
                            self.by_hash.remove(&h);
                        }
                    }
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
        c.insert(&mut t, 1, &a);
        assert_eq!(c.len(), 2);
        // The same first page, a different second one: one page shared.
        let shared = c.lookup(&t, &[1, 2, 3, 9, 9]);
        assert_eq!(shared, vec![t.pages(1)[..1].to_vec()]);
        // A prompt that is exactly two cached pages keeps its last token uncached.
        assert_eq!(c.lookup(&t, &[1, 2, 3, 4])[0].len(), 1);
        assert_eq!(c.lookup(&t, &[1, 2, 3, 4, 7])[0].len(), 2);
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

    #[test]
    fn a_sliding_group_serves_a_prefix_from_the_pages_its_window_reaches() {
        // Group 0 full, group 1 a window of 3 over pages of 2 tokens.
        let mut t = PageTable::with_groups(20, 2, 8, vec![None, Some(3)]);
        let mut c = PrefixCache::new(2);
        let a: Vec<i64> = (1..=9).collect();
        let s = t.prepare(&[(1, &a)]).unwrap();
        t.commit(s).unwrap();
        // Cached before the window moves on: every full page of both groups.
        c.insert(&mut t, 1, &a);
        assert_eq!(c.len(), 8);
        // The next row (position 9) reads positions 7..=9: pages 3 and 4 of the sliding group.
        assert_eq!(t.slide(1), 3);
        let [full, sliding] = [t.group_pages(1, 0).to_vec(), t.group_pages(1, 1).to_vec()];
        assert_eq!(&sliding[..3], &[FREED; 3]);
        // A prompt sharing three pages: its first new row (position 6) reads positions 4..=6,
        // so the sliding group needs page 2 only, which the cache still holds.
        let mut b = a[..6].to_vec();
        b.push(99);
        let hit = c.lookup(&t, &b);
        assert_eq!(hit[0], full[..3].to_vec());
        assert_eq!(hit[1][..2], [FREED, FREED]);
        assert_ne!(hit[1][2], FREED);
        t.attach_prefix_groups(2, &hit).unwrap();
        assert_eq!(t.len(2), 6);
        // Without the cache's copy of a sliding page the hit is shorter.
        t.release(2);
        let dropped = hit[1][2];
        t.release(1);
        let before = c.len();
        while c.pages.contains_key(&dropped) {
            let want = t.free_pages() + 1;
            c.evict(&mut t, want);
        }
        assert!(c.len() < before);
        let hit = c.lookup(&t, &b);
        assert!(hit[0].len() < 3, "{hit:?}");
    }
}
