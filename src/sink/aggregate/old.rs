//! The live blocks older than the window of [`super::live::LiveBlocks`]:
//! the blocks that stay live (at the end, the leaks), which leave the window
//! in id order. A hash map of them cost 41 bytes a bucket, half of its
//! buckets empty just after it doubled, and both tables at once while it
//! did (84 bytes a block at the peak, measured at 770 000 blocks).
//!
//! Here they are a sorted array instead: the ids apart, for the binary
//! search, each in 32 bits (the upper 32 bits of an id are shared by a run
//! of ids, [`Run`]: a run of 4 billion events), and each block packed in 20
//! bytes, 24 bytes a block in all (32 with a 64-bit id and a 24-byte block:
//! 20 MB more at the 2.56 M blocks live at the end of 100 M calls of the
//! scale workload). A block released is marked (its head 0) and the marks
//! are swept out when they are as many as the live blocks, so the array
//! holds at most twice the live blocks; it grows at its end (a large array
//! is moved by the allocator's `mremap`, not copied) and shrinks when it
//! holds a quarter of its room. The rare block that does not fit the packed
//! form (4 GiB or more, an address not 8-aligned or above 2^48, a time of
//! 2^55 ns, 417 days, or more, a cell index of 2^24 or more) or comes out of
//! id order goes to a map beside it.

use std::ops::Range;

use rustc_hash::FxHashMap;

use super::live::Block;
use crate::event::Op;

/// Blocks below this many are not worth shrinking the arrays for.
const MIN_ROOM: usize = 1024;

/// Bits of the packed head: the address in 8-byte units, the time, the
/// cell, then the op code.
const PTR_BITS: u32 = 45;
const TS_BITS: u32 = 55;
const CELL_BITS: u32 = 24;
const OP_BITS: u32 = 4;
const _: () = assert!(PTR_BITS + TS_BITS + CELL_BITS + OP_BITS == u128::BITS);

/// A block in 20 bytes: its address, time, cell and op code in a 128-bit
/// head (kept as 32-bit words, so that the block needs no 8-byte
/// alignment), its size in 32 bits. A head of 0: released.
#[derive(Clone, Copy, Debug)]
struct Packed {
    head: [u32; 4],
    size: u32,
}

fn low_bits(v: u128, bits: u32) -> u128 {
    v & ((1 << bits) - 1)
}

impl Packed {
    fn pack(b: &Block) -> Option<Packed> {
        let size = u32::try_from(b.size).ok()?;
        let op = b.op as u8;
        let fits = b.ptr != 0
            && b.ptr % 8 == 0
            && b.ptr >> (PTR_BITS + 3) == 0
            && b.ts_ns >> TS_BITS == 0
            && b.cell >> CELL_BITS == 0
            && op >> OP_BITS == 0;
        if !fits {
            return None;
        }
        let head = u128::from(b.ptr / 8)
            | u128::from(b.ts_ns) << PTR_BITS
            | u128::from(b.cell) << (PTR_BITS + TS_BITS)
            | u128::from(op) << (PTR_BITS + TS_BITS + CELL_BITS);
        Some(Packed {
            head: std::array::from_fn(|i| (head >> (32 * i)) as u32),
            size,
        })
    }

    fn head(&self) -> u128 {
        self.head
            .iter()
            .rev()
            .fold(0, |acc, &w| acc << 32 | u128::from(w))
    }

    fn is_live(&self) -> bool {
        self.head != [0; 4]
    }

    fn release(&mut self) {
        self.head = [0; 4];
    }

    fn unpack(&self) -> Block {
        let head = self.head();
        let op = (head >> (PTR_BITS + TS_BITS + CELL_BITS)) as u8;
        Block {
            ptr: low_bits(head, PTR_BITS) as u64 * 8,
            size: u64::from(self.size),
            ts_ns: low_bits(head >> PTR_BITS, TS_BITS) as u64,
            cell: low_bits(head >> (PTR_BITS + TS_BITS), CELL_BITS) as u32,
            // Packed from an `Op`: its code always names one.
            op: Op::from_code(op).unwrap_or(Op::Malloc),
        }
    }
}

/// Ids whose upper 32 bits are `high`, from entry `start` of the arrays
/// to the next run's start.
#[derive(Clone, Copy, Debug)]
struct Run {
    high: u32,
    start: usize,
}

fn split(id: u64) -> (u32, u32) {
    ((id >> 32) as u32, id as u32)
}

fn join(high: u32, low: u32) -> u64 {
    u64::from(high) << 32 | u64::from(low)
}

#[derive(Debug, Default)]
pub struct OldBlocks {
    /// Ascending within each run: `ids[i]`, the lower half of the id of
    /// `packed[i]`.
    ids: Vec<u32>,
    /// Ascending by `high`; the first starts at 0.
    runs: Vec<Run>,
    packed: Vec<Packed>,
    /// Entries of `packed` released and not yet swept out.
    dead: usize,
    /// Blocks not in `packed`: not packable, or out of id order.
    others: FxHashMap<u64, Block>,
}

impl OldBlocks {
    /// The entries of run `r`.
    fn entries(&self, r: usize) -> Range<usize> {
        let end = self.runs.get(r + 1).map_or(self.ids.len(), |n| n.start);
        self.runs[r].start..end
    }

    /// The largest id in the arrays.
    fn last(&self) -> Option<u64> {
        Some(join(self.runs.last()?.high, *self.ids.last()?))
    }

    /// Where id `id` is in the arrays.
    fn find(&self, id: u64) -> Option<usize> {
        let (high, low) = split(id);
        let r = self.runs.binary_search_by_key(&high, |r| r.high).ok()?;
        let entries = self.entries(r);
        let i = self.ids[entries.clone()].binary_search(&low).ok()?;
        Some(entries.start + i)
    }

    /// Event `id` allocated `block`; false when it replaced a block of that
    /// id.
    pub fn insert(&mut self, id: u64, block: Block) -> bool {
        let replaced = self.remove(id).is_some();
        match Packed::pack(&block) {
            Some(p) if self.last().is_none_or(|last| id > last) => {
                let (high, low) = split(id);
                if self.runs.last().is_none_or(|r| r.high != high) {
                    self.runs.push(Run {
                        high,
                        start: self.ids.len(),
                    });
                }
                self.ids.push(low);
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
        let newer = self.last().is_none_or(|last| id > last);
        if !newer {
            if let Some(i) = self.find(id) {
                let slot = &mut self.packed[i];
                if slot.is_live() {
                    let block = slot.unpack();
                    slot.release();
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
        let mut runs = Vec::with_capacity(self.runs.len());
        for r in 0..self.runs.len() {
            let start = kept;
            for i in self.entries(r) {
                if self.packed[i].is_live() {
                    self.ids[kept] = self.ids[i];
                    self.packed[kept] = self.packed[i];
                    kept += 1;
                }
            }
            if kept > start {
                runs.push(Run {
                    high: self.runs[r].high,
                    start,
                });
            }
        }
        self.runs = runs;
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
        let mut packed = (0..self.runs.len())
            .flat_map(move |r| {
                let high = self.runs[r].high;
                self.entries(r).map(move |i| (join(high, self.ids[i]), i))
            })
            .filter(|&(_, i)| self.packed[i].is_live())
            .map(|(id, i)| (id, self.packed[i].unpack()))
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
        self.ids.capacity() * 4
            + self.runs.capacity() * std::mem::size_of::<Run>()
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
    fn a_packed_block_is_20_bytes_and_every_field_survives_packing() {
        assert_eq!(std::mem::size_of::<Packed>(), 20);
        for op in Op::RECORDED {
            let b = Block {
                ptr: (1 << 48) - 8,
                size: u64::from(u32::MAX),
                ts_ns: (1 << 55) - 1,
                cell: (1 << 24) - 1,
                op,
            };
            assert_eq!(Packed::pack(&b).map(|p| p.unpack()), Some(b));
            let low = Block {
                ptr: 8,
                size: 0,
                ts_ns: 0,
                cell: 0,
                op,
            };
            assert_eq!(Packed::pack(&low).map(|p| p.unpack()), Some(low));
        }
        let fits = block(0x10, 1, 0, Op::Malloc);
        for b in [
            Block {
                size: 1 << 32,
                ..fits
            },
            Block {
                cell: 1 << 24,
                ..fits
            },
            Block { ptr: 0x14, ..fits },
            Block {
                ptr: 1 << 48,
                ..fits
            },
            Block { ptr: 0, ..fits },
            Block {
                ts_ns: 1 << 55,
                ..fits
            },
        ] {
            assert!(Packed::pack(&b).is_none(), "{b:?}");
        }
    }

    /// Against a map, on a random mix: in-order inserts (packed), blocks
    /// that do not pack or come out of order (beside), removals of live,
    /// released and unknown ids; the iteration is the map's, in id order.
    /// From `first`, ids a few apart, and one insert in `leap` a jump of
    /// 2^31 (ids whose upper halves differ).
    fn behaves_as_a_map(first: u64, leap: u64) {
        let mut old = OldBlocks::default();
        let mut model: std::collections::BTreeMap<u64, Block> = Default::default();
        let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
        let mut next = || rng.next_u64();
        let mut id = first;
        for step in 0..200_000u64 {
            let r = next();
            match r % 8 {
                0..=3 => {
                    id += 1 + r % 5;
                    if r % leap == 0 {
                        id += 1 << 31;
                    }
                    let size = if r % 97 == 0 { 1 << 33 } else { r % 5000 };
                    let ptr = if r % 89 == 0 { id * 16 + 4 } else { id * 16 };
                    let b = block(ptr, size, (r >> 8) as u32 % 1000, Op::Calloc);
                    assert_eq!(old.insert(id, b), model.insert(id, b).is_none());
                }
                4 => {
                    // Out of order, or an id seen before.
                    let at = first + r % (id - first + 1);
                    let b = block(at * 16 + 8, 1, 3, Op::Realloc);
                    assert_eq!(old.insert(at, b), model.insert(at, b).is_none());
                }
                _ => {
                    // Mostly recent ids, some anywhere.
                    let span = if r % 3 == 0 { id - first + 2 } else { 64 };
                    let at = (id + 1).saturating_sub(r % span);
                    assert_eq!(old.remove(at), model.remove(&at), "step {step}");
                }
            }
        }
        let got: Vec<(u64, Block)> = old.iter().collect();
        let want: Vec<(u64, Block)> = model.into_iter().collect();
        assert_eq!(got, want);
    }

    #[test]
    fn behaves_as_a_map_with_ids_of_one_run() {
        behaves_as_a_map(0, u64::MAX);
    }

    #[test]
    fn behaves_as_a_map_with_ids_across_runs() {
        behaves_as_a_map((1 << 32) - 20_000, 5_000);
    }

    /// Released blocks are swept out: the room follows the live blocks,
    /// not all that went through.
    #[test]
    fn room_follows_the_live_blocks() {
        let mut old = OldBlocks::default();
        for id in 1..=1_000_000u64 {
            old.insert(id, block(id * 16, 32, 1, Op::Malloc));
        }
        assert!(old.footprint() <= 2 * 1_000_000 * 24, "{}", old.footprint());
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
