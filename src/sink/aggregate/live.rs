//! The blocks live now, by the id of the event that allocated them: the one
//! structure of live blocks a trace keeps (its leaks at the end, the size
//! and stack a release takes back from the heap).
//!
//! Event ids are sequence numbers, and most blocks die young, so the recent
//! ids are a window: a slot per id, indexed by `id - base`, no hashing. When
//! the window grows past [`WINDOW`] slots its oldest half moves out, the few
//! blocks there still live going, in id order, to a compact store of their
//! own ([`OldBlocks`]). An id far beyond the window moves it whole. So the
//! memory follows the blocks that stay live, never the number of events.

use std::collections::VecDeque;

use super::old::OldBlocks;
use crate::event::Op;

/// Slots of the window before its oldest half moves out: 64 Ki ids, 2 MiB.
const WINDOW: usize = 1 << 16;

/// A live block: where, how large, when, and the call that allocated it
/// (its op, and the aggregator's index of its stack and thread). `ptr` 0
/// marks an empty slot: an allocation that returned no block is not live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub ptr: u64,
    pub size: u64,
    pub ts_ns: u64,
    pub cell: u32,
    pub op: Op,
}

impl Default for Block {
    fn default() -> Block {
        Block {
            ptr: 0,
            size: 0,
            ts_ns: 0,
            cell: 0,
            op: Op::Malloc,
        }
    }
}

#[derive(Debug, Default)]
pub struct LiveBlocks {
    /// Slot `i`: the block of event `base + i`, or an empty one.
    window: VecDeque<Block>,
    base: u64,
    /// Live blocks older than the window.
    old: OldBlocks,
    len: usize,
}

impl LiveBlocks {
    /// Blocks live now.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Event `id` allocated `block` (its `ptr` is not 0).
    pub fn insert(&mut self, id: u64, block: Block) {
        debug_assert_ne!(block.ptr, 0);
        if id < self.base {
            if self.old.insert(id, block) {
                self.len += 1;
            }
            return;
        }
        let mut index = id - self.base;
        if index >= WINDOW as u64 {
            // Keep the newest half of the window before `id`.
            self.slide(index - (WINDOW / 2) as u64 + 1);
            index = id - self.base;
        }
        let index = index as usize;
        if index >= self.window.len() {
            self.window.resize(index + 1, Block::default());
        }
        let slot = &mut self.window[index];
        if slot.ptr == 0 {
            self.len += 1;
        }
        *slot = block;
    }

    /// The block allocated by event `id`, now released; `None` when no
    /// block of that id is live.
    pub fn remove(&mut self, id: u64) -> Option<Block> {
        let block = if id < self.base {
            self.old.remove(id)
        } else {
            let slot = self.window.get_mut((id - self.base) as usize)?;
            (slot.ptr != 0).then(|| std::mem::take(slot))
        };
        if block.is_some() {
            self.len -= 1;
        }
        block
    }

    /// Move the oldest `ids` out of the window (past its end: all of it,
    /// and the base moves on).
    fn slide(&mut self, ids: u64) {
        let moved = ids.min(self.window.len() as u64);
        for (i, block) in self.window.drain(..moved as usize).enumerate() {
            if block.ptr != 0 {
                self.old.insert(self.base + i as u64, block);
            }
        }
        self.base = self.base.saturating_add(ids);
    }

    /// Every live block with its id, in id order (the older blocks' ids
    /// are all below the window's base).
    pub fn iter(&self) -> impl Iterator<Item = (u64, Block)> + '_ {
        let base = self.base;
        self.old.iter().chain(
            self.window
                .iter()
                .enumerate()
                .filter(|(_, b)| b.ptr != 0)
                .map(move |(i, &b)| (base + i as u64, b)),
        )
    }

    /// Bytes held, roughly: the window and the store of older live blocks.
    #[cfg(test)]
    pub fn footprint(&self) -> usize {
        self.window.capacity() * std::mem::size_of::<Block>() + self.old.footprint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(ptr: u64) -> Block {
        Block {
            ptr,
            size: 8,
            ts_ns: 0,
            cell: 0,
            op: Op::Malloc,
        }
    }

    fn ids(live: &LiveBlocks) -> Vec<u64> {
        let ids: Vec<u64> = live.iter().map(|(id, _)| id).collect();
        assert!(ids.is_sorted(), "in id order: {ids:?}");
        ids
    }

    #[test]
    fn tracks_blocks_until_released() {
        let mut live = LiveBlocks::default();
        live.insert(1, block(0x10));
        live.insert(2, block(0x20));
        assert_eq!(live.remove(1), Some(block(0x10)));
        live.insert(130, block(0x30));
        assert_eq!(live.remove(2), Some(block(0x20)));
        assert_eq!(live.remove(999_999), None); // unknown: ignored
        assert_eq!(live.remove(2), None); // released twice
        assert_eq!(ids(&live), vec![130]);
        assert_eq!(live.len(), 1);
    }

    /// An id far beyond the others moves the window; the blocks before it
    /// stay live and are found.
    #[test]
    fn sparse_ids_move_the_window() {
        let mut live = LiveBlocks::default();
        live.insert(1, block(0x10));
        live.insert(u64::MAX / 2, block(0x20));
        live.insert(5, block(0x50));
        assert_eq!(ids(&live), vec![1, 5, u64::MAX / 2]);
        assert_eq!(live.remove(1), Some(block(0x10)));
        assert_eq!(live.remove(u64::MAX / 2), Some(block(0x20)));
        assert_eq!(ids(&live), vec![5]);
        assert!(live.footprint() < 4 * WINDOW * std::mem::size_of::<Block>());
    }

    /// Millions of short-lived blocks and a few that stay live: the memory
    /// follows the live ones, and old ones are still found and released.
    #[test]
    fn memory_follows_live_blocks_not_events() {
        let mut live = LiveBlocks::default();
        let mut id = 0;
        let mut kept = Vec::new();
        for round in 0..40u64 {
            for _ in 0..250_000 {
                id += 1;
                live.insert(id, block(id));
                id += 1;
                assert_eq!(live.remove(id - 1), Some(block(id - 1)));
            }
            id += 1;
            live.insert(id, block(id));
            kept.push(id);
            if round == 30 {
                // A block from the first round, long out of the window.
                assert_eq!(live.remove(kept[0]), Some(block(kept[0])));
                kept.remove(0);
            }
        }
        assert!(id > 20_000_000);
        assert_eq!(ids(&live), kept);
        assert_eq!(live.len(), kept.len());
        assert!(
            live.footprint() < 3 * WINDOW * std::mem::size_of::<Block>(),
            "{} bytes for 40 live blocks",
            live.footprint()
        );
    }
}
