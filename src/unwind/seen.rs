//! Whole stacks the pipeline has seen, and what became of them: a program
//! makes the same few stacks over and over, and a call whose return
//! addresses were seen before costs one hash of them, not a check and a
//! lookup per frame. A hash is only a key: an entry serves a call only
//! when everything it was made from is equal.

use super::WalkEnd;

/// Whole stacks seen (see `Pipeline::stacked`), by a hash of what the
/// unwinder returned.
pub struct StackCache {
    stacks: rustc_hash::FxHashMap<u64, SeenStack>,
    /// Stacks remembered at most (then the cache starts again).
    limit: usize,
}

/// A whole stack seen, and what became of it.
pub struct SeenStack {
    pid: u32,
    ips: Box<[u64]>,
    caller: u64,
    end: WalkEnd,
    /// Its walk ended before the outermost frame.
    pub truncated: bool,
    /// The leaf it was interned as (`None`: no stacks are kept).
    pub leaf: Option<u64>,
}

/// Stacks remembered at most, by default.
const STACK_CACHE: usize = 1 << 20;

impl Default for StackCache {
    fn default() -> StackCache {
        StackCache::with_limit(STACK_CACHE)
    }
}

impl StackCache {
    /// A cache that starts again once it holds `limit` stacks.
    pub fn with_limit(limit: usize) -> StackCache {
        StackCache {
            stacks: Default::default(),
            limit,
        }
    }

    /// The key of a stack: process, return addresses, caller and how the
    /// walk ended.
    pub fn key(pid: u32, ips: &[u64], caller: u64, end: WalkEnd) -> u64 {
        use std::hash::BuildHasher;
        rustc_hash::FxBuildHasher.hash_one((pid, ips, caller, end))
    }

    /// The stack seen under `key`, if it was made of the same values.
    pub fn get(
        &self,
        key: u64,
        pid: u32,
        ips: &[u64],
        caller: u64,
        end: WalkEnd,
    ) -> Option<&SeenStack> {
        self.stacks
            .get(&key)
            .filter(|s| s.pid == pid && *s.ips == *ips && s.caller == caller && s.end == end)
    }

    /// Remember a stack under `key` (see [`StackCache::key`]).
    #[allow(clippy::too_many_arguments)]
    pub fn insert(
        &mut self,
        key: u64,
        pid: u32,
        ips: Vec<u64>,
        caller: u64,
        end: WalkEnd,
        truncated: bool,
        leaf: Option<u64>,
    ) {
        if self.stacks.len() >= self.limit {
            self.stacks.clear();
        }
        let seen = SeenStack {
            pid,
            ips: ips.into(),
            caller,
            end,
            truncated,
            leaf,
        };
        self.stacks.insert(key, seen);
    }

    /// Forget the stacks of process `pid` (gone: its number may come back
    /// with other images), or every stack (an image went).
    pub fn forget(&mut self, pid: Option<u32>) {
        match pid {
            Some(pid) => self.stacks.retain(|_, s| s.pid != pid),
            None => self.stacks.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(cache: &StackCache, pid: u32, ips: &[u64], caller: u64) -> Option<Option<u64>> {
        let key = StackCache::key(pid, ips, caller, WalkEnd::Outermost);
        cache
            .get(key, pid, ips, caller, WalkEnd::Outermost)
            .map(|s| s.leaf)
    }

    fn insert(cache: &mut StackCache, pid: u32, ips: &[u64], caller: u64, leaf: u64) {
        let key = StackCache::key(pid, ips, caller, WalkEnd::Outermost);
        let end = WalkEnd::Outermost;
        cache.insert(key, pid, ips.to_vec(), caller, end, false, Some(leaf));
    }

    #[test]
    fn serves_a_stack_made_of_the_same_values_only() {
        let mut cache = StackCache::default();
        insert(&mut cache, 1, &[0x10, 0x20], 0x10, 7);
        assert_eq!(seen(&cache, 1, &[0x10, 0x20], 0x10), Some(Some(7)));
        assert_eq!(seen(&cache, 2, &[0x10, 0x20], 0x10), None);
        assert_eq!(seen(&cache, 1, &[0x10], 0x10), None);
        assert_eq!(seen(&cache, 1, &[0x10, 0x20], 0x11), None);
        // How the walk ended is part of the key.
        let key = StackCache::key(1, &[0x10, 0x20], 0x10, WalkEnd::Failed);
        assert!(
            cache
                .get(key, 1, &[0x10, 0x20], 0x10, WalkEnd::Failed)
                .is_none()
        );
    }

    #[test]
    fn a_key_that_collides_serves_nothing_else() {
        let mut cache = StackCache::default();
        // Another stack filed under this stack's key, as a hash collision
        // would: the key alone does not serve it.
        let key = StackCache::key(1, &[0x10], 0x10, WalkEnd::Outermost);
        cache.insert(key, 1, vec![0x99], 0x99, WalkEnd::Outermost, true, Some(3));
        assert!(
            cache
                .get(key, 1, &[0x10], 0x10, WalkEnd::Outermost)
                .is_none()
        );
        let other = cache.get(key, 1, &[0x99], 0x99, WalkEnd::Outermost);
        assert!(other.is_some_and(|s| s.truncated && s.leaf == Some(3)));
    }

    #[test]
    fn forgets_a_process_or_everything() {
        let mut cache = StackCache::default();
        insert(&mut cache, 1, &[0x10], 0x10, 1);
        insert(&mut cache, 2, &[0x10], 0x10, 2);
        cache.forget(Some(1));
        assert_eq!(seen(&cache, 1, &[0x10], 0x10), None);
        assert_eq!(seen(&cache, 2, &[0x10], 0x10), Some(Some(2)));
        cache.forget(None);
        assert_eq!(seen(&cache, 2, &[0x10], 0x10), None);
    }

    #[test]
    fn starts_again_when_full() {
        let mut cache = StackCache::with_limit(2);
        insert(&mut cache, 1, &[0x10], 0x10, 1);
        insert(&mut cache, 1, &[0x20], 0x20, 2);
        assert_eq!(seen(&cache, 1, &[0x10], 0x10), Some(Some(1)));
        // The third empties the cache first: memory stays bounded.
        insert(&mut cache, 1, &[0x30], 0x30, 3);
        assert_eq!(seen(&cache, 1, &[0x10], 0x10), None);
        assert_eq!(seen(&cache, 1, &[0x20], 0x20), None);
        assert_eq!(seen(&cache, 1, &[0x30], 0x30), Some(Some(3)));
    }
}
