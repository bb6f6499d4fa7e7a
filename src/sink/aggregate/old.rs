//! The live blocks older than the window of [`super::live::LiveBlocks`]:
//! the blocks that stay live (at the end, the leaks), which leave the window
//! in id order. A hash map of them cost 41 bytes a bucket, half of its
//! buckets empty just after it doubled, and both tables at once while it
//! did (84 bytes a block at the peak, measured at 770 000 blocks).
//!
//! Here they are a sorted array instead: the ids apart, for the binary
//! search, and each block packed in 24 bytes, 32 bytes a block in all. A
//! block released is marked (its `ptr` 0) and the marks are swept out when
//! they are as many as the live blocks, so the array holds at most twice
//! the live blocks; it grows at its end (a large array is moved by the
//! allocator's `mremap`, not copied) and shrinks when it holds a quarter of
//! its room. The rare block that does not fit the packed form (4 GiB or
//! more, a cell index of 2^24 or more) or comes out of id order goes to a
//! map beside it.

use rustc_hash::FxHashMap;

use super::live::Block;
use crate::event::Op;

/// Blocks below this many are not worth shrinking the arrays for.
const MIN_ROOM: usize = 1024;

/// A block in 24 bytes: its size in 32 bits, its cell in 24 and its op
/// code in 8. `ptr` 0: released.
#[derive(Clone, Copy, Debug)]
struct Packed {
    ptr: u64,
    ts_ns: u64,
    size: u32,
    cell_op: u32,
}

impl Packed {
    fn pack(b: &Block) -> Option<Packed> {
        let size = u32::try_from(b.size).ok()?;
        if b.ptr == 0 || b.cell >= 1 << 24 {
            return None;
        }
        Some(Packed {
            ptr: b.ptr,
            ts_ns: b.ts_ns,
            size,
            cell_op: b.cell << 8 | u32::from(b.op as u8),
        })
    }

    fn unpack(&self) -> Block {
        Block {
            ptr: self.ptr,
            size: u64::from(self.size),
            ts_ns: self.ts_ns,
            cell: self.cell_op >> 8,
            // Packed from an `Op`: its code always names one.
            op: Op::from_code(self.cell_op as u8).unwrap_or(Op::Malloc),
        }
    }
}

#[derive(Debug, Default)]
pub struct OldBlocks {
    /// Ascending; `ids[i]` is the id of `packed[i]`.
    ids: Vec<u64>,
    packed: Vec<Packed>,
    /// Entries of `packed` released and not yet swept out.
    dead: usize,
    /// Blocks not in `packed`: too large to pack, or out of id order.
    others: FxHashMap<u64, Block>,
}

impl OldBlocks {
    /// Event `id` allocated `block`; false when it replaced a block of that
    /// id.
    pub fn insert(&mut self, id: u64, block: Block) -> bool {
        let replaced = self.remove(id).is_some();
        match Packed::pack(&block) {
            Some(p) if self.ids.last().is_none_or(|&last| id > last) => {
                self.ids.push(id);
                self.packed.push(p);
            }
            _ => {
                self.others.insert(id, block);
            }
        }
        !replaced
    }

    /// The block of `id`, released; `None` when none is live.
    pub fn remove(&mut self, id: u64) -> Option<Block> {
        let newer = self.ids.last().is_none_or(|&last| id > last);
        if !newer {
            if let Ok(i) = self.ids.binary_search(&id) {
                let slot = &mut self.packed[i];
                if slot.ptr != 0 {
                    let block = slot.unpack();
                    slot.ptr = 0;
                    self.dead += 1;
                    if self.dead * 2 > self.ids.len() {
                        self.sweep();
                    }
                    return Some(block);
                }
            }
        }
        if self.others.is_empty() {
            return None;
        }
        self.others.remove(&id)
    }

    /// Sweep the released entries out, and give back room no longer
    /// needed.
    fn sweep(&mut self) {
        let mut kept = 0;
        for i in 0..self.ids.len() {
            if self.packed[i].ptr != 0 {
                self.ids[kept] = self.ids[i];
                self.packed[kept] = self.packed[i];
                kept += 1;
            }
        }
        self.ids.truncate(kept);
        self.packed.truncate(kept);
        self.dead = 0;
        if self.ids.capacity() > 4 * kept.max(MIN_ROOM) {
            self.ids.shrink_to(2 * kept);
            self.packed.shrink_to(2 * kept);
        }
    }

    /// Every block with its id, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Block)> + '_ {
        let mut others: Vec<(u64, Block)> = self.others.iter().map(|(&id, &b)| (id, b)).collect();
        others.sort_unstable_by_key(|&(id, _)| id);
        let mut others = others.into_iter().peekable();
        let mut packed = self
            .ids
            .iter()
            .zip(&self.packed)
            .filter(|(_, p)| p.ptr != 0)
            .map(|(&id, p)| (id, p.unpack()))
            .peekable();
        std::iter::from_fn(move || match (packed.peek(), others.peek()) {
            (Some(&(a, _)), Some(&(b, _))) if b < a => others.next(),
            (Some(_), _) => packed.next(),
            (None, _) => others.next(),
        })
    }

    /// Bytes held, roughly.
    #[cfg(test)]
    pub fn footprint(&self) -> usize {
        self.ids.capacity() * 8
            + self.packed.capacity() * std::mem::size_of::<Packed>()
            + self.others.capacity() * (8 + std::mem::size_of::<Block>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::RngCore;
    use proptest::test_runner::{RngAlgorithm, TestRng};

    fn block(ptr: u64, size: u64, cell: u32, op: Op) -> Block {
        Block {
            ptr,
            size,
            ts_ns: ptr * 3,
            cell,
            op,
        }
    }

    #[test]
    fn a_packed_block_is_24_bytes_and_every_op_survives_packing() {
        assert_eq!(std::mem::size_of::<Packed>(), 24);
        for code in 0..=u8::MAX {
            let Some(op) = Op::from_code(code) else {
                continue;
            };
            let b = block(0x10, 7, (1 << 24) - 1, op);
            assert_eq!(Packed::pack(&b).map(|p| p.unpack()), Some(b));
        }
        assert!(Packed::pack(&block(0x10, 1 << 32, 0, Op::Malloc)).is_none());
        assert!(Packed::pack(&block(0x10, 1, 1 << 24, Op::Malloc)).is_none());
    }

    /// Against a map, on a random mix: in-order inserts (packed), blocks too
    /// large or out of order (beside), removals of live, released and
    /// unknown ids; the iteration is the map's, in id order.
    #[test]
    fn behaves_as_a_map() {
        let mut old = OldBlocks::default();
        let mut model: std::collections::BTreeMap<u64, Block> = Default::default();
        let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
        let mut next = || rng.next_u64();
        let mut id = 0;
        for step in 0..200_000u64 {
            let r = next();
            match r % 8 {
                0..=3 => {
                    id += 1 + r % 5;
                    let size = if r % 97 == 0 { 1 << 33 } else { r % 5000 };
                    let b = block(id * 16, size, (r >> 8) as u32 % 1000, Op::Calloc);
                    assert_eq!(old.insert(id, b), model.insert(id, b).is_none());
                }
                4 => {
                    // Out of order, or an id seen before.
                    let at = r % (id + 1);
                    let b = block(at * 16 + 8, 1, 3, Op::Realloc);
                    assert_eq!(old.insert(at, b), model.insert(at, b).is_none());
                }
                _ => {
                    let at = r % (id + 2);
                    assert_eq!(old.remove(at), model.remove(&at), "step {step}");
                }
            }
        }
        let got: Vec<(u64, Block)> = old.iter().collect();
        let want: Vec<(u64, Block)> = model.into_iter().collect();
        assert_eq!(got, want);
    }

    /// Released blocks are swept out: the room follows the live blocks,
    /// not all that went through.
    #[test]
    fn room_follows_the_live_blocks() {
        let mut old = OldBlocks::default();
        for id in 1..=1_000_000u64 {
            old.insert(id, block(id * 16, 32, 1, Op::Malloc));
        }
        assert!(old.footprint() <= 2 * 1_000_000 * 32, "{}", old.footprint());
        for id in 1..=1_000_000u64 {
            if id % 1000 != 0 {
                assert!(old.remove(id).is_some());
            }
        }
        assert_eq!(old.iter().count(), 1000);
        assert!(old.footprint() < 300_000, "{}", old.footprint());
        assert_eq!(old.remove(1000).map(|b| b.ptr), Some(16_000));
        assert_eq!(old.remove(1000), None);
    }
}
