//! A size-bounded least-recently-used index shared by the blob backends.
//!
//! Every operation is O(1) per blob (a hash map plus an intrusive list), so touching a
//! blob costs the same in a store of a thousand blobs as in one of a hundred million.

use gantry_core::Digest;
use lru::LruCache;

pub struct LruIndex<V> {
    map: LruCache<Digest, (u64, V)>,
    used: u64,
    max: u64,
}

impl<V> LruIndex<V> {
    pub fn new(max_bytes: u64) -> Self {
        LruIndex { map: LruCache::unbounded(), used: 0, max: max_bytes }
    }

    pub fn max_bytes(&self) -> u64 {
        self.max
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Returns the entry and marks it most recently used.
    pub fn touch(&mut self, d: &Digest) -> Option<&V> {
        self.map.get(d).map(|(_, v)| v)
    }

    pub fn peek(&self, d: &Digest) -> Option<&V> {
        self.map.peek(d).map(|(_, v)| v)
    }

    /// Inserts (or refreshes) an entry as most recently used, then evicts least recently
    /// used entries until the index fits. The entry just inserted is never evicted by its
    /// own insertion; callers reject blobs larger than the whole store beforehand.
    pub fn insert(&mut self, d: Digest, size: u64, v: V) -> Vec<(Digest, V)> {
        if let Some((old, _)) = self.map.put(d, (size, v)) {
            self.used -= old;
        }
        self.used += size;
        let mut evicted = Vec::new();
        while self.used > self.max && self.map.len() > 1 {
            // peek first so the newest entry survives even when it alone is over budget
            match self.map.peek_lru() {
                Some((k, _)) if *k == d => break,
                None => break,
                _ => {}
            }
            let (k, (sz, v)) = self.map.pop_lru().expect("non-empty");
            self.used -= sz;
            evicted.push((k, v));
        }
        evicted
    }

    /// Removes least recently used entries, of those `takes` accepts, until at least
    /// `bytes` are freed or none is left (a disk that filled up before the store's budget
    /// did); the others keep their place. O(entries passed over).
    pub fn evict_bytes_where(&mut self, bytes: u64, mut takes: impl FnMut(&Digest) -> bool) -> Vec<(Digest, V)> {
        let mut freed = 0;
        let mut chosen = Vec::new();
        for (k, (sz, _)) in self.map.iter().rev() {
            if freed >= bytes {
                break;
            }
            if takes(k) {
                freed += sz;
                chosen.push(*k);
            }
        }
        chosen.into_iter().filter_map(|k| self.remove(&k).map(|v| (k, v))).collect()
    }

    pub fn remove(&mut self, d: &Digest) -> Option<V> {
        self.map.pop(d).map(|(sz, v)| {
            self.used -= sz;
            v
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::DigestFunction;

    fn d(i: u32) -> Digest {
        DigestFunction::Sha256.digest_of(&i.to_le_bytes())
    }

    #[test]
    fn evicting_by_a_predicate_skips_what_it_refuses() {
        let mut idx = LruIndex::new(100);
        for i in 0..5 {
            idx.insert(d(i), 10, ());
        }
        // 1 and 3 refused: the oldest accepted ones go, oldest first, until 20 bytes.
        let gone: Vec<Digest> =
            idx.evict_bytes_where(20, |k| *k != d(1) && *k != d(3)).into_iter().map(|e| e.0).collect();
        assert_eq!(gone, vec![d(0), d(2)]);
        assert_eq!((idx.len(), idx.used_bytes()), (3, 30));
        assert!(idx.peek(&d(1)).is_some() && idx.peek(&d(4)).is_some());
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut idx = LruIndex::new(30);
        for i in 0..3 {
            assert!(idx.insert(d(i), 10, ()).is_empty());
        }
        // touching 0 makes 1 the oldest
        assert!(idx.touch(&d(0)).is_some());
        let ev: Vec<_> = idx.insert(d(3), 10, ()).into_iter().map(|e| e.0).collect();
        assert_eq!(ev, vec![d(1)]);
        let ev: Vec<_> = idx.insert(d(4), 15, ()).into_iter().map(|e| e.0).collect();
        assert_eq!(ev, vec![d(2), d(0)]);
        assert_eq!(idx.used_bytes(), 25);
        assert!(idx.peek(&d(3)).is_some() && idx.peek(&d(4)).is_some());
    }

    #[test]
    fn reinsert_does_not_double_count() {
        let mut idx = LruIndex::new(100);
        idx.insert(d(1), 40, ());
        idx.insert(d(1), 40, ());
        assert_eq!(idx.used_bytes(), 40);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.remove(&d(1)), Some(()));
        assert_eq!(idx.used_bytes(), 0);
    }

    #[test]
    fn newest_entry_survives_even_if_over_budget() {
        let mut idx = LruIndex::new(10);
        idx.insert(d(1), 5, ());
        let ev = idx.insert(d(2), 20, ());
        assert_eq!(ev.len(), 1);
        assert!(idx.peek(&d(2)).is_some());
    }
}
