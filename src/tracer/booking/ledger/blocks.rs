//! The ledger's live blocks: (process, block) -> (event id of its
//! allocation, size), for every block live in a traced process.
//!
//! One map of `(u32, u64) -> (u64, u64)` cost 33 bytes a bucket and, while
//! it doubled, both tables at once: 45 bytes a live block at the peak
//! (measured at 770 000 blocks), 207 MB of them at 2.5 M. Here each process
//! has its blocks in [`SHARDS`] maps of `u64 -> u64` (17 bytes a bucket),
//! the id and size packed in the value, a shard chosen by the block's
//! address: a shard doubles a 64th of the blocks at a time. The rare block
//! whose id or size does not fit the packing (an id of 2^40 or more, a size
//! of 16 MiB or more) goes to a map beside them, unpacked.

use rustc_hash::FxHashMap;

/// Maps per process.
const SHARDS: usize = 64;
/// Bits of the size in a packed value; the id has the 40 above them.
const SIZE_BITS: u32 = 24;

/// The shard of a block: the top bits of its address, mixed (addresses
/// share their low bits, being aligned, and their high bits, being in one
/// heap).
fn shard(ptr: u64) -> usize {
    (ptr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (u64::BITS - SHARDS.trailing_zeros())) as usize
}

fn pack(id: u64, size: u64) -> Option<u64> {
    (id < 1 << (u64::BITS - SIZE_BITS) && size < 1 << SIZE_BITS).then_some(id << SIZE_BITS | size)
}

fn unpack(v: u64) -> (u64, u64) {
    (v >> SIZE_BITS, v & ((1 << SIZE_BITS) - 1))
}

#[derive(Default)]
pub struct LiveBlocks {
    /// Per process, its shards.
    packed: FxHashMap<u32, Vec<FxHashMap<u64, u64>>>,
    /// Blocks that do not fit the packing.
    wide: FxHashMap<(u32, u64), (u64, u64)>,
}

impl LiveBlocks {
    fn shards(&mut self, pid: u32) -> &mut Vec<FxHashMap<u64, u64>> {
        self.packed
            .entry(pid)
            .or_insert_with(|| vec![FxHashMap::default(); SHARDS])
    }

    pub fn contains(&self, pid: u32, ptr: u64) -> bool {
        self.packed
            .get(&pid)
            .is_some_and(|s| s[shard(ptr)].contains_key(&ptr))
            || (!self.wide.is_empty() && self.wide.contains_key(&(pid, ptr)))
    }

    /// Block `ptr` of `pid`, released: its (id, size).
    pub fn remove(&mut self, pid: u32, ptr: u64) -> Option<(u64, u64)> {
        if let Some(v) = self
            .packed
            .get_mut(&pid)
            .and_then(|s| s[shard(ptr)].remove(&ptr))
        {
            return Some(unpack(v));
        }
        if self.wide.is_empty() {
            return None;
        }
        self.wide.remove(&(pid, ptr))
    }

    /// Block `ptr` of `pid` allocated by event `id`; the (id, size) of the
    /// block it replaces, if that one was live.
    pub fn insert(&mut self, pid: u32, ptr: u64, id: u64, size: u64) -> Option<(u64, u64)> {
        match pack(id, size) {
            Some(v) => {
                let replaced = self.shards(pid)[shard(ptr)].insert(ptr, v).map(unpack);
                if replaced.is_none() && !self.wide.is_empty() {
                    return self.wide.remove(&(pid, ptr));
                }
                replaced
            }
            None => {
                let replaced = self
                    .packed
                    .get_mut(&pid)
                    .and_then(|s| s[shard(ptr)].remove(&ptr))
                    .map(unpack);
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

    /// Every block of `pid`, gone: their (id, size), in no order.
    pub fn forget(&mut self, pid: u32) -> Vec<(u64, u64)> {
        let mut gone: Vec<(u64, u64)> = self
            .packed
            .remove(&pid)
            .into_iter()
            .flatten()
            .flat_map(|s| s.into_values())
            .map(unpack)
            .collect();
        self.wide.retain(|&(p, _), &mut v| {
            if p == pid {
                gone.push(v);
            }
            p != pid
        });
        gone
    }

    /// Bytes held, roughly (hashbrown: a control byte a bucket).
    #[cfg(test)]
    pub fn footprint(&self) -> usize {
        let packed: usize = self
            .packed
            .values()
            .flatten()
            .map(|s| s.capacity() * 17)
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
            let ptr = 16 * (r >> 8 & 0xffff);
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

    /// The shards share the blocks out evenly (glibc's addresses, 16 bytes
    /// apart, and mmap'd blocks, a page apart), so that no one table holds
    /// most of them; a million blocks take under 40 bytes each.
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
                blocks.footprint() < 40 * 1_000_000,
                "{}",
                blocks.footprint()
            );
        }
    }
}
