//! Which allocations no release has named yet, kept while events are written
//! so that `finish` can store the leaks without searching the whole log.
//!
//! Event ids are sequence numbers, so the recent ones are a bitset indexed by
//! id: one bit per event, a couple of nanoseconds per update. The bitset is a
//! window: when it grows past [`WINDOW_WORDS`], its oldest half moves out,
//! the few allocations there still open going to a set of their own. So the
//! memory grows with the blocks that stay open, never with the number of
//! events. Ids far beyond the number of events seen would make the window
//! huge: then it gives up, and `finish` asks SQLite instead (the same
//! answer, found by the query behind `leaks`).

use std::collections::{HashSet, VecDeque};

/// Bits allowed per event seen, beyond a fixed allowance, before giving up.
const BITS_PER_EVENT: u64 = 4;
const BITS_ALLOWANCE: u64 = 1 << 24;

/// Words of the window (of 64 ids each) before its oldest half moves out:
/// 256 KiB, four million ids.
const WINDOW_WORDS: usize = 1 << 15;

#[derive(Debug, Default)]
pub struct OpenBlocks {
    /// Bit `i` of word `w`: allocation `base + 64 * w + i` is open.
    bits: VecDeque<u64>,
    /// First id the window covers (a multiple of 64).
    base: u64,
    /// Open allocations older than the window.
    old: HashSet<u64>,
    events: u64,
    gave_up: bool,
}

impl OpenBlocks {
    /// An event `id` happened: it allocated a block (`allocated`), and/or it
    /// released the block allocated by event `released`.
    pub fn record(&mut self, id: u64, allocated: bool, released: Option<u64>) {
        self.events += 1;
        if self.gave_up {
            return;
        }
        if let Some(alloc) = released {
            if alloc < self.base {
                self.old.remove(&alloc);
            } else if let Some(word) = self.bits.get_mut(((alloc - self.base) / 64) as usize) {
                *word &= !(1 << (alloc % 64));
            }
        }
        if allocated {
            if id < self.base {
                self.old.insert(id);
                return;
            }
            let word = (id - self.base) / 64;
            if word >= self.bits.len() as u64 {
                if id > BITS_ALLOWANCE + self.events * BITS_PER_EVENT {
                    *self = OpenBlocks {
                        events: self.events,
                        gave_up: true,
                        ..OpenBlocks::default()
                    };
                    return;
                }
                self.bits.resize(word as usize + 1, 0);
            }
            self.bits[word as usize] |= 1 << (id % 64);
            if self.bits.len() > WINDOW_WORDS {
                self.slide(WINDOW_WORDS / 2);
            }
        }
    }

    /// Stop keeping the set (events written may have been rolled back):
    /// `finish` asks SQLite instead.
    pub fn give_up(&mut self) {
        *self = OpenBlocks {
            events: self.events,
            gave_up: true,
            ..OpenBlocks::default()
        };
    }

    /// Move the oldest `words` of the window out.
    fn slide(&mut self, words: usize) {
        for _ in 0..words {
            let Some(mut word) = self.bits.pop_front() else {
                break;
            };
            while word != 0 {
                self.old
                    .insert(self.base + u64::from(word.trailing_zeros()));
                word &= word - 1;
            }
            self.base += 64;
        }
    }

    /// The open allocations in increasing order, or `None` when the ids were
    /// too sparse to track.
    pub fn ids(&self) -> Option<Vec<u64>> {
        if self.gave_up {
            return None;
        }
        let mut ids: Vec<u64> = self.old.iter().copied().collect();
        ids.sort_unstable();
        for (i, &word) in self.bits.iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                ids.push(self.base + i as u64 * 64 + u64::from(rest.trailing_zeros()));
                rest &= rest - 1;
            }
        }
        Some(ids)
    }

    /// Bytes held, roughly: the window and the set of older open blocks.
    #[cfg(test)]
    fn footprint(&self) -> usize {
        self.bits.capacity() * 8 + self.old.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_allocations_until_released() {
        let mut open = OpenBlocks::default();
        open.record(1, true, None);
        open.record(2, true, None);
        open.record(3, false, Some(1));
        open.record(130, true, Some(2));
        open.record(131, false, Some(999_999)); // unknown: ignored
        assert_eq!(open.ids(), Some(vec![130]));
    }

    #[test]
    fn gives_up_on_sparse_ids() {
        let mut open = OpenBlocks::default();
        open.record(1, true, None);
        open.record(u64::MAX / 2, true, None);
        assert_eq!(open.ids(), None);
    }

    /// Millions of short-lived blocks and a few that stay open: the memory
    /// follows the open ones, and old ones are still found and released.
    #[test]
    fn memory_follows_open_blocks_not_events() {
        let mut open = OpenBlocks::default();
        let mut id = 0;
        let mut kept = Vec::new();
        for round in 0..40u64 {
            for _ in 0..250_000 {
                id += 1;
                open.record(id, true, None);
                id += 1;
                open.record(id, false, Some(id - 1));
            }
            id += 1;
            open.record(id, true, None);
            kept.push(id);
            if round == 30 {
                // A block from the first round, long out of the window.
                open.record(id + 1, false, Some(kept[0]));
                id += 1;
                kept.remove(0);
            }
        }
        assert!(id > 20_000_000);
        assert_eq!(open.ids(), Some(kept));
        assert!(
            open.footprint() < 3 * WINDOW_WORDS * 8,
            "{} bytes for 40 open blocks",
            open.footprint()
        );
    }
}
