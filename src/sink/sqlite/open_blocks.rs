//! Which allocations no release has named yet, kept while events are written
//! so that `finish` can store the leaks without searching the whole log.
//!
//! Event ids are sequence numbers, so a bitset indexed by id costs one bit
//! per event and a couple of nanoseconds per update. Ids far beyond the
//! number of events seen would make it huge: then it gives up, and `finish`
//! asks SQLite instead (the same answer, found by the query behind `leaks`).

/// Bits allowed per event seen, beyond a fixed allowance, before giving up.
const BITS_PER_EVENT: u64 = 4;
const BITS_ALLOWANCE: u64 = 1 << 24;

#[derive(Debug, Default)]
pub struct OpenBlocks {
    bits: Vec<u64>,
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
            if let Some(word) = self.bits.get_mut((alloc / 64) as usize) {
                *word &= !(1 << (alloc % 64));
            }
        }
        if allocated {
            let word = id / 64;
            if word >= self.bits.len() as u64 {
                if id > BITS_ALLOWANCE + self.events * BITS_PER_EVENT {
                    self.gave_up = true;
                    self.bits = Vec::new();
                    return;
                }
                let len = (word + 1).max(self.bits.len() as u64 * 2);
                self.bits.resize(len as usize, 0);
            }
            self.bits[word as usize] |= 1 << (id % 64);
        }
    }

    /// The open allocations in increasing order, or `None` when the ids were
    /// too sparse to track.
    pub fn ids(&self) -> Option<Vec<u64>> {
        if self.gave_up {
            return None;
        }
        let mut ids = Vec::new();
        for (i, &word) in self.bits.iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                ids.push(i as u64 * 64 + u64::from(rest.trailing_zeros()));
                rest &= rest - 1;
            }
        }
        Some(ids)
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
}
