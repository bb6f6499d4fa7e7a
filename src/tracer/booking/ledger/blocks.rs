//! The ledger's live blocks: (process, block) -> (event id of its
//! allocation, size), for every block live in a traced process.
//!
//! One map of `(u32, u64) -> (u64, u64)` cost 33 bytes a bucket and, while
//! it doubled, both tables at once: 45 bytes a live block at the peak
//! (measured at 770 000 blocks), 207 MB of them at 2.5 M. Here each process
//! has its blocks in [`SHARDS`] maps of a 32-bit key to the id and size
//! packed in 64 bits (13 bytes a bucket; 17 with a 64-bit key, 28 bytes a
//! live block at 2.56 M), the shard and the key two parts of the block's
//! address mixed ([`place`]): a shard doubles a 4096th of the blocks at a
//! time. The rare block whose address, id or size does not fit the packing
//! (an address not 8-aligned or above 2^47, an id of 2^40 or more, a size
//! of 16 MiB or more) goes to a map beside them, unpacked.

use rustc_hash::FxHashMap;

/// Bits of an address in 8-byte units, below 2^47 (x86-64's user space
/// with 4-level page tables).
const PLACE_BITS: u32 = 44;
/// Maps per process: the bits of the mixed address above the key's 32.
const SHARDS: usize = 1 << (PLACE_BITS - u32::BITS);
/// Bits of the size in a packed value; the id has the 40 above them.
const SIZE_BITS: u32 = 24;

/// A block's shard and key: its address in 8-byte units mixed by a
/// bijection of [`PLACE_BITS`] bits (a multiplication by an odd number,
/// which spreads addresses evenly over the upper bits, the shard; then an
/// xor-shift, which brings them into the lower bits, the key). Distinct
/// addresses have distinct places. `None`: an address that does not fit.
fn place(ptr: u64) -> Option<(usize, u32)> {
    if ptr % 8 != 0 || ptr >> (PLACE_BITS + 3) != 0 {
        return None;
    }
    let mask = (1u64 << PLACE_BITS) - 1;
    let mut h = (ptr / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) & mask;
    h ^= h >> (PLACE_BITS / 2);
    Some(((h >> u32::BITS) as usize, h as u32))
}

/// The id and size in two 32-bit words (a bucket aligned to 4 bytes).
fn pack(id: u64, size: u64) -> Option<[u32; 2]> {
    (id < 1 << (u64::BITS - SIZE_BITS) && size < 1 << SIZE_BITS).then(|| {
        let v = id << SIZE_BITS | size;
        [v as u32, (v >> u32::BITS) as u32]
    })
}

fn unpack([low, high]: [u32; 2]) -> (u64, u64) {
    let v = u64::from(high) << u32::BITS | u64::from(low);
    (v >> SIZE_BITS, v & ((1 << SIZE_BITS) - 1))
}

type Shard = FxHashMap<u32, [u32; 2]>;

#[derive(Default)]
pub struct LiveBlocks {
    /// Per process, its shards.
    packed: FxHashMap<u32, Vec<Shard>>,
    /// Blocks that do not fit the packing.
    wide: FxHashMap<(u32, u64), (u64, u64)>,
}

impl LiveBlocks {
    fn shards(&mut self, pid: u32) -> &mut Vec<Shard> {
        self.packed
            .entry(pid)
            .or_insert_with(|| vec![Shard::default(); SHARDS])
    }

    /// The packed block at `place` of `pid`, taken out.
    fn take(&mut self, pid: u32, place: Option<(usize, u32)>) -> Option<(u64, u64)> {
        let (shard, key) = place?;
        let shards = self.packed.get_mut(&pid)?;
        shards[shard].remove(&key).map(unpack)
    }

    pub fn contains(&self, pid: u32, ptr: u64) -> bool {
        place(ptr).is_some_and(|(shard, key)| {
            self.packed
                .get(&pid)
                .is_some_and(|s| s[shard].contains_key(&key))
        }) || (!self.wide.is_empty() && self.wide.contains_key(&(pid, ptr)))
    }

    /// Block `ptr` of `pid`, released: its (id, size).
    pub fn remove(&mut self, pid: u32, ptr: u64) -> Option<(u64, u64)> {
        if let Some(found) = self.take(pid, place(ptr)) {
            return Some(found);
        }
        if self.wide.is_empty() {
            return None;
        }
        self.wide.remove(&(pid, ptr))
    }

    /// Block `ptr` of `pid` allocated by event `id`; the (id, size) of the
    /// block it replaces, if that one was live.
    pub fn insert(&mut self, pid: u32, ptr: u64, id: u64, size: u64) -> Option<(u64, u64)> {
        let place = place(ptr);
        match place.zip(pack(id, size)) {
            Some(((shard, key), v)) => {
                let replaced = self.shards(pid)[shard].insert(key, v).map(unpack);
                if replaced.is_none() && !self.wide.is_empty() {
                    return self.wide.remove(&(pid, ptr));
                }
                replaced
            }
            None => {
                let replaced = self.take(pid, place);
                self.wide.insert((pid, ptr), (id, size)).or(replaced)
            }
        }
    }

    /// Room for `n` more blocks of `pid`, in one growth of each shard.
    pub fn reserve(&mut self, pid: u32, n: usize) {
        for s in self.shards(pid) {
            s.reserve(n / SHARDS + 1);
        }
    }

    /// Every block of `pid`, gone: each (id, size) handed to `each` as its
    /// table is emptied, nothing collected on the way.
    fn remove_all(&mut self, pid: u32, mut each: impl FnMut((u64, u64))) {
        for shard in self.packed.remove(&pid).into_iter().flatten() {
            shard.into_values().map(unpack).for_each(&mut each);
        }
        self.wide.retain(|&(p, _), &mut v| {
            if p == pid {
                each(v);
            }
            p != pid
        });
    }

    /// Every block of `pid`, gone: how many and their bytes. Nothing is
    /// collected (their (id, size) at 16 bytes a block were 41 MB beside
    /// the tables of a 2.56 M-block process, and its map in the recorder).
    pub fn drop_process(&mut self, pid: u32) -> (u64, u64) {
        let (mut blocks, mut bytes) = (0u64, 0u64);
        self.remove_all(pid, |(_, size)| {
            blocks += 1;
            bytes = bytes.wrapping_add(size);
        });
        (blocks, bytes)
    }

    /// Every block of `pid`, gone: their (id, size), in no order.
    pub fn forget(&mut self, pid: u32) -> Vec<(u64, u64)> {
        let mut gone = Vec::new();
        self.remove_all(pid, |block| gone.push(block));
        gone
    }

    /// Bytes held, roughly (hashbrown: a control byte a bucket).
    #[cfg(test)]
    pub fn footprint(&self) -> usize {
        let packed: usize = self
            .packed
            .values()
            .flatten()
            .map(|s| s.capacity() * 13)
            .sum();
        packed + self.wide.capacity() * 33
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::RngCore;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    use std::collections::HashMap;

    use super::*;

    /// Against a map of (pid, ptr) -> (id, size), on a random mix of
    /// inserts (some not packable, some over a live block), removals and
    /// lookups, in two processes, one of them then forgotten.
    #[test]
    fn behaves_as_a_map() {
        let mut blocks = LiveBlocks::default();
        let mut model: HashMap<(u32, u64), (u64, u64)> = HashMap::new();
        let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
        let mut next = || rng.next_u64();
        for id in 1..300_000u64 {
            let r = next();
            let pid = 1 + (r & 1) as u32;
            let ptr = match r % 97 {
                // Addresses that do not fit the packing.
                0 => 16 * (r >> 8 & 0xff) + 4,
                1 => (1 << 47) | (16 * (r >> 8 & 0xff)),
                _ => 16 * (r >> 8 & 0xffff),
            };
            match r >> 40 & 3 {
                0 | 1 => {
                    let id = if r % 101 == 0 { id << 40 } else { id };
                    let size = if r % 89 == 0 { 1 << 30 } else { r >> 50 };
                    assert_eq!(
                        blocks.insert(pid, ptr, id, size),
                        model.insert((pid, ptr), (id, size))
                    );
                }
                2 => assert_eq!(blocks.remove(pid, ptr), model.remove(&(pid, ptr))),
                _ => assert_eq!(blocks.contains(pid, ptr), model.contains_key(&(pid, ptr))),
            }
        }
        let mut gone = blocks.forget(2);
        gone.sort_unstable();
        let mut want: Vec<(u64, u64)> = model
            .iter()
            .filter(|(k, _)| k.0 == 2)
            .map(|(_, &v)| v)
            .collect();
        want.sort_unstable();
        assert_eq!(gone, want);
        model.retain(|k, _| k.0 != 2);
        for (&(pid, ptr), &v) in &model {
            assert_eq!(blocks.remove(pid, ptr), Some(v));
        }
        assert!(blocks.forget(1).is_empty());
    }

    /// A process dropped: its blocks, packed and wide, counted with their
    /// bytes and gone; another's kept.
    #[test]
    fn dropping_a_process_counts_its_blocks() {
        let mut blocks = LiveBlocks::default();
        let mut want = (0, 0);
        for i in 0..10_000u64 {
            let (ptr, size) = match i % 3 {
                0 => (16 * i + 4, 24),     // not aligned: wide
                1 => (16 * i, 1 << 40),    // too large: wide
                _ => (16 * i, 8 + i % 50), // packed
            };
            assert_eq!(blocks.insert(1, ptr, i, size), None);
            assert_eq!(blocks.insert(2, ptr, i, 7), None);
            want = (want.0 + 1, want.1 + size);
        }
        assert_eq!(blocks.drop_process(1), want);
        assert!(!blocks.contains(1, 32) && !blocks.contains(1, 4));
        assert_eq!(blocks.drop_process(1), (0, 0));
        assert!(blocks.contains(2, 32) && blocks.contains(2, 4));
        assert_eq!(blocks.forget(2).len(), 10_000);
    }

    /// Distinct addresses, distinct places: a heap's addresses 8 bytes
    /// apart, and addresses that differ in their upper bits only.
    #[test]
    fn places_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..1_000_000u64 {
            for ptr in [0x5555_0000_0000 + 8 * i, (i << 27) | 0x10] {
                if let Some(place) = place(ptr) {
                    seen.insert((ptr, place));
                }
            }
        }
        let places: std::collections::HashSet<_> = seen.iter().map(|&(_, p)| p).collect();
        assert!(seen.len() > 1_999_000, "{}", seen.len());
        assert_eq!(places.len(), seen.len());
        assert!(place(1 << 47).is_none() && place(0x5555_0000_0004).is_none());
    }

    /// The shards share the blocks out evenly (glibc's addresses, 16 bytes
    /// apart, and mmap'd blocks, a page apart), so that no one table holds
    /// most of them; a million blocks take under 30 bytes each (13 a
    /// bucket, a shard's table between 44 and 88 % full).
    #[test]
    fn shards_are_even_and_compact() {
        for step in [16u64, 4096] {
            let mut blocks = LiveBlocks::default();
            for i in 0..1_000_000u64 {
                blocks.insert(7, 0x5555_0000_0000 + i * step, i + 1, 24);
            }
            let most = blocks.packed[&7].iter().map(|s| s.len()).max();
            assert!(most < Some(1_000_000 / SHARDS * 5 / 4), "{most:?}");
            assert!(
                blocks.footprint() < 30 * 1_000_000,
                "{}",
                blocks.footprint()
            );
        }
    }
}
