//! The ledger's live blocks: (process, block) -> (event id of its
//! allocation, size), for every block live in a traced process.
//!
//! One map of `(u32, u64) -> (u64, u64)` cost 33 bytes a bucket and, while
//! it doubled, both tables at once: 45 bytes a live block at the peak
//! (measured at 770 000 blocks), 207 MB of them at 2.5 M. Here each process
//! has its blocks in [`SHARDS`] maps of a 32-bit key to the id and size
//! packed in 64 bits (13 bytes a bucket; 17 with a 64-bit key, 28 bytes a
//! live block at 2.56 M), the shard and the key two parts of the block's
//! address ([`place`]): a shard doubles a 4096th of the blocks at a time.
//! The rare block whose address, id or size does not fit the packing (an
//! address not 8-aligned or above 2^47, an id of 2^40 or more, a size of
//! 16 MiB or more) goes to a map beside them, unpacked.
//!
//! Blocks of one page stay together ([`PageHash`]): a program allocates
//! and frees near where it just did (python3: 99 % of its calls touch one
//! of the 256 pages touched last), and so the tables are read where they
//! were just read. With the address scrambled over all of a shard's table,
//! every call was two cache misses (the control bytes, then the bucket):
//! on python3 with 2.7 M blocks live, 64 % of the tracer thread's time.

use rustc_hash::FxHashMap;

/// Bits of an address in 8-byte units, below 2^47 (x86-64's user space
/// with 4-level page tables).
const PLACE_BITS: u32 = 44;
/// Maps per process: the bits of the address above the key's 32.
const SHARDS: usize = 1 << (PLACE_BITS - u32::BITS);
/// Bits of the size in a packed value; the id has the 40 above them.
const SIZE_BITS: u32 = 24;
/// Bits of an address in 8-byte units within its 4 KiB page.
const PAGE_BITS: u32 = 9;

/// A block's shard and key, a split of its address in 8-byte units: the
/// page's lowest 12 bits choose the shard (consecutive pages, consecutive
/// shards, so that any heap shares its pages out evenly); the key is the
/// offset in the page below the page's other bits. Distinct addresses
/// have distinct places. `None`: an address that does not fit.
fn place(ptr: u64) -> Option<(usize, u32)> {
    if ptr % 8 != 0 || ptr >> (PLACE_BITS + 3) != 0 {
        return None;
    }
    let unit = ptr / 8;
    let page = unit >> PAGE_BITS;
    let shard = (page as usize) & (SHARDS - 1);
    let key = (page / SHARDS as u64) << PAGE_BITS | (unit & ((1 << PAGE_BITS) - 1));
    Some((shard, key as u32))
}

/// The hash of a key ([`place`]) that keeps a page's blocks in one stretch
/// of their table: its position (the low bits) is the block's offset in
/// the page, moved to a place of the table chosen by the page's bits
/// (a stretch of 512 buckets, and within it 8 buckets at a time, so that
/// pages sharing a stretch interleave rather than collide). The 7 bits
/// hashbrown compares before a key (the top ones) mix the whole key.
#[derive(Default)]
struct PageHash(u64);

impl std::hash::Hasher for PageHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, key: u32) {
        const MIX: u64 = 0x9e37_79b9_7f4a_7c15;
        let offset = u64::from(key) & ((1 << PAGE_BITS) - 1);
        let page = (u64::from(key) >> PAGE_BITS)
            .wrapping_add(1)
            .wrapping_mul(MIX);
        // The stretch (bits 9 and up) and the page's 8-bucket turn (bits
        // 3 to 8) from its mixed bits; the offset's own low 3 bits kept.
        let position = (page >> 7 & !((1 << 3) - 1)) ^ offset;
        let tag = u64::from(key).wrapping_mul(MIX) & (0x7f << 57);
        self.0 = tag | (position & ((1 << 57) - 1));
    }
}

type PageHasher = std::hash::BuildHasherDefault<PageHash>;

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

type Shard = std::collections::HashMap<u32, [u32; 2], PageHasher>;

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

    /// A page's blocks hash to one stretch of 512 buckets (whatever the
    /// table's size: a run of cache lines), with tags that still tell them
    /// apart; pages that share a shard start their stretches apart.
    #[test]
    fn a_page_stays_together() {
        use std::hash::{BuildHasher, Hasher};
        let hash = |ptr: u64| {
            let (shard, key) = place(ptr).unwrap();
            let mut h = PageHasher::default().build_hasher();
            h.write_u32(key);
            (shard, h.finish())
        };
        let page = 0x5555_5555_a000u64;
        let (shard, first) = hash(page);
        let mut tags = std::collections::HashSet::new();
        for offset in (0..4096).step_by(16) {
            let (s, h) = hash(page + offset);
            assert_eq!(s, shard);
            assert_eq!(
                h >> 9 & ((1 << 48) - 1),
                first >> 9 & ((1 << 48) - 1),
                "{offset}"
            );
            tags.insert(h >> 57);
        }
        assert!(tags.len() > 64, "{}", tags.len());
        // The same shard, 4096 pages on: its own stretch.
        let (s, other) = hash(page + (SHARDS as u64) * 4096);
        assert_eq!(s, shard);
        assert_ne!(other >> 9 & 0xffff, first >> 9 & 0xffff);
    }
}
